"""Errors the service raises at its boundaries, each with the HTTP status it maps to.

The API turns every `LatticeError` into an RFC 9457 `application/problem+json` body; the
store raises the state-machine errors below and the routes never catch-and-rephrase them.
"""

from __future__ import annotations

from typing import Any


class LatticeError(Exception):
    """Base of the service's errors. `status` and `title` become the problem document."""

    status: int = 500
    title: str = "Internal error"
    problem_type: str = "about:blank"

    def __init__(self, detail: str, *, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = errors


class NotFound(LatticeError):
    status = 404
    title = "Not found"


class JobNotFound(NotFound):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} not found")
        self.job_id = job_id


class Unauthorized(LatticeError):
    status = 401
    title = "Unauthorized"


class Forbidden(LatticeError):
    status = 403
    title = "Forbidden"


class Conflict(LatticeError):
    status = 409
    title = "Conflict"


class IllegalTransition(Conflict):
    """A state change the job state machine does not allow (including any change of a terminal state)."""

    title = "Illegal state transition"

    def __init__(self, job_id: str, from_state: str, to_state: str, allowed: tuple[str, ...]) -> None:
        allowed_text = ", ".join(allowed) if allowed else "none (terminal state)"
        super().__init__(
            f"job {job_id!r} cannot go from {from_state!r} to {to_state!r}; "
            f"allowed from {from_state!r}: {allowed_text}"
        )
        self.job_id = job_id
        self.from_state = from_state
        self.to_state = to_state


class ConcurrentUpdate(Conflict):
    """The job changed since it was read (compare-and-set on `version` failed)."""

    title = "Concurrent update"

    def __init__(self, job_id: str, expected_version: int, actual_version: int | None) -> None:
        super().__init__(
            f"job {job_id!r} was modified concurrently: expected version {expected_version}, "
            f"found {actual_version}; re-read and retry"
        )
        self.job_id = job_id
        self.expected_version = expected_version
        self.actual_version = actual_version


class IdempotencyConflict(Conflict):
    title = "Idempotency key reused"


class InvalidRequest(LatticeError):
    """Input that passed the schema but is semantically impossible; `errors` names the fields."""

    status = 422
    title = "Invalid request"


class ServiceUnavailable(LatticeError):
    status = 503
    title = "Service unavailable"


class NotLeader(ServiceUnavailable):
    """A scheduler write refused by the leader fence: this process is not (or no longer) the elected
    scheduler, so its term is not the lease's current term (service.scheduler.leader)."""

    title = "Not the scheduler leader"
