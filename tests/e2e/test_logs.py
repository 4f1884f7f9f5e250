"""Each rank's output per attempt, end to end on the shared Ray cluster: a rank's printed and logged
markers reach `lattice logs` (following a running job until it ends) and the endpoint; a rank whose
training raises has the traceback in its log of that attempt; the logs survive a service restart;
another tenant gets 404."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from service.auth import create_token
from service.cli import app
from tests.e2e.conftest import TERMINAL, LiveService, make_service, wait_for_free_gpus
from tests.e2e.log_standin import FAILING_SEED

pytestmark = pytest.mark.ray

CHATTY = "tests.e2e.log_standin:chatty_train"


def spec(name: str, seed: int) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16},
        "train": {"steps": 4, "global_batch": 2, "seed": seed},
        "parallelism": {"tp": 2, "dp": 2},
        "fault_tolerance": {"max_restarts": 0},
    }


@pytest.fixture(scope="module")
def svc(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    wait_for_free_gpus()
    service = make_service(ray_cluster, tmp_path_factory.mktemp("logs") / "home",
                           controller_defaults={"train_fn": CHATTY})
    try:
        yield service
    finally:
        service.close()


def _cli(url: str, token: str, *args: str) -> Any:
    return CliRunner().invoke(app, ["--server", url, "--token", token, "logs", *args])


def _logs(svc: LiveService, job_id: str, token: str | None = None, **params: Any) -> Any:
    return svc.api("GET", f"/v1/jobs/{job_id}/logs", token=token, params=params)


def test_rank_output_and_tracebacks_are_kept_per_attempt_and_survive_a_restart(svc: LiveService) -> None:
    ok = svc.api("POST", "/v1/jobs", token=svc.user, json=spec("chatty", 0))
    bad = svc.api("POST", "/v1/jobs", token=svc.user, json=spec("raises", FAILING_SEED))
    assert ok.status_code == bad.status_code == 201, (ok.text, bad.text)
    ok_id, bad_id = ok.json()["id"], bad.json()["id"]
    assert svc.runtime is not None
    url = svc.runtime.serve_in_thread(port=0)

    # `lattice logs -f` on a job that has not started yet waits, streams, and ends with the job.
    followed = _cli(url, svc.user, ok_id, "-f", "--rank", "2")
    assert followed.exit_code == 0, followed.output
    assert "stdout-marker rank=2 seed=0" in followed.stdout
    assert "INFO tests.chatty: logging-marker rank=2" in followed.stdout
    assert svc.job(ok_id)["state"] == "succeeded"
    assert svc.wait_state(bad_id, TERMINAL)["state"] == "failed"

    listed = _cli(url, svc.user, bad_id, "--list")
    assert listed.exit_code == 0 and "0-3" in listed.stdout, listed.output
    tb = _cli(url, svc.user, bad_id, "-r", "1", "-a", "1")
    assert tb.exit_code == 0, tb.output
    assert "Traceback (most recent call last)" in tb.stdout
    assert "RuntimeError: chatty rank 1 gives up before its first step" in tb.stdout
    missing = _cli(url, svc.user, bad_id, "-a", "9")
    assert missing.exit_code == 1 and "attempts with logs: 1" in missing.output

    before = {(j, r): _logs(svc, j, svc.user, rank=r).text for j in (ok_id, bad_id) for r in range(4)}
    assert "stdout-marker rank=0 seed=0" in before[(ok_id, 0)]
    assert "native-marker rank=3" in before[(ok_id, 3)]  # what bypasses sys.stderr is kept too
    assert "RuntimeError: chatty rank 1 gives up" in before[(bad_id, 1)]
    assert "Traceback" not in before[(ok_id, 1)]

    svc.restart()  # a new app and scheduler on the same home read the same files
    for (job_id, rank), text in before.items():
        r = _logs(svc, job_id, svc.user, rank=rank)
        assert r.status_code == 200 and r.text == text
        assert r.headers["x-lattice-log-attempt"] == "1"
    with svc.session() as s:
        other = create_token(s, tenant="team-b")
        s.commit()
    for path in (f"/v1/jobs/{bad_id}/logs", f"/v1/jobs/{bad_id}/logs/index"):
        assert svc.api("GET", path, token=other).status_code == 404
        assert svc.api("GET", path, token=svc.admin).status_code == 200
