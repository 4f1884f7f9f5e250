"""`make run`'s watch (service/demo.py): while the demo job waits it says why, once per reason (e.g.
the cluster's first hardware profile being measured), then follows the steps to the end."""

from __future__ import annotations

import io
from typing import Any

import httpx
import pytest
from rich.console import Console

from service import demo

WAITING = "pending: waiting for the cpu-virtual nodes' first hardware profile, being measured now"


def _job(state: str, step: int, reason: str) -> dict[str, Any]:
    return {"state": state, "reason": reason,
            "progress": {"step": step, "total_steps": 2, "loss": 1.5 if step else None,
                         "tokens_per_s": 100.0 if step else None}}


def test_the_watch_says_why_the_job_waits_once_and_follows_it_to_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = [_job("pending", 0, WAITING), _job("pending", 0, WAITING),
               _job("queued", 0, "queued: admitted"), _job("running", 1, "running"),
               _job("succeeded", 2, "succeeded: all ranks finished")]
    served: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        served.append(request.url.path)
        return httpx.Response(200, json=answers[min(len(served), len(answers)) - 1])

    out = io.StringIO()
    monkeypatch.setattr(demo, "console", Console(file=out, width=200, highlight=False))
    with httpx.Client(base_url="http://lattice", transport=httpx.MockTransport(handler)) as client:
        seen = demo.watch(client, "J1", interval_s=0.0)
    assert served == ["/v1/jobs/J1"] * len(answers)
    assert seen.job["state"] == "succeeded" and seen.first_step_at is not None
    text = out.getvalue()
    assert text.count(WAITING) == 1 and text.count("queued: admitted") == 1
    assert "all ranks finished" not in text  # a running or finished job's reason is not a wait


def test_the_outcome_shows_the_measured_step_time_against_the_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(demo, "console", Console(file=out, width=200, highlight=False))
    job = {**_job("succeeded", 2, "succeeded"), "spec": {"train": {"steps": 2, "global_batch": 8}},
           "plan": {"train": {"seq_len": 64}}, "attempt": 0,
           "result": {"loss_first": 6.2, "loss_first_step": 1, "loss_last": 2.4, "final_step": 2},
           "performance": {"predicted": {"step_time_s": 1.015}, "ratio": 1.43,
                           "measured": {"step_time_s": 1.451, "steps": 27, "warmup_steps": 3}}}
    demo.print_outcome(job, demo.Watch(submitted=0.0))
    text = out.getvalue()
    lines = [line.split() for line in text.splitlines()]
    assert ["predicted", "1015", "ms/step"] in lines, text
    assert ["measured", "1451", "ms/step", "(1.43x", "predicted;", "median", "of", "27", "steps", "after",
            "warm-up)"] in lines, text
