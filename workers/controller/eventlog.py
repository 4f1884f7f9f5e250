"""The controller's event channels: the numbered log the service reads (`emit`, `since`) and the
inbox of events ranks deliver directly (`deliver`, `take_delivered`), under one lock since the
actor serves calls from other threads while its loop runs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from workers.events import Event, EventKind, Payload, event_record


class EventLog:
    def __init__(
        self, first_seq: int, max_events: int, wall_clock: Callable[[], float], state: Callable[[], str]
    ) -> None:
        """`state()` is the controller state each event is stamped with."""
        self.lock = threading.RLock()
        self.events: list[dict[str, Any]] = []
        self.seq = first_seq
        self._max = max_events
        self._wall = wall_clock
        self._state = state
        self._inbox: list[tuple[int, dict[str, Any]]] = []

    def emit(self, kind: EventKind, message: str, payload: Payload | None = None, **data: Any) -> None:
        """Append an event; `payload`'s fields, then `data`, become its keys."""
        event = Event.of(kind, message, payload, **data)
        with self.lock:
            self.seq += 1
            self.events.append(event_record(self.seq, self._wall(), self._state(), event))
            if len(self.events) > self._max:
                del self.events[: len(self.events) - self._max]

    def since(self, seq: int) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(e) for e in self.events if e["seq"] > seq]

    def deliver(self, rank: int, event: dict[str, Any]) -> None:
        """A rank event sent directly (its sender may be about to die); read with the next poll."""
        with self.lock:
            self._inbox.append((rank, event))

    def take_delivered(self) -> list[tuple[int, dict[str, Any]]]:
        with self.lock:
            inbox, self._inbox = self._inbox, []
        return inbox
