"""`--set` overrides (pure) and `lattice submit --from JOB --set ...` / `lattice resume` (client faked)."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from service.cli import app
from service.cli import jobs as cli_jobs
from service.cli.client import CliError
from service.cli.overrides import OverrideError, apply_overrides, parse_override

STORED = {"name": "demo", "train": {"steps": 30, "lr": 0.001}, "model": {"preset": "demo"}, "faults": []}


@pytest.mark.parametrize(("item", "path", "value"), [
    ("train.steps=2000", ("train", "steps"), 2000),
    ("train.lr=3e-4", ("train", "lr"), 3e-4),
    ("train.lr=0.0003", ("train", "lr"), 0.0003),
    ("name=my job", ("name",), "my job"),
    ("name='007'", ("name",), "007"),
    ("name='1e5'", ("name",), "1e5"),
    ("model.init_from=null", ("model", "init_from"), None),
    ("data.shuffle=false", ("data", "shuffle"), False),
    ("parallelism={tp: 2, dp: 2}", ("parallelism",), {"tp": 2, "dp": 2}),
    ("a.b=x=y", ("a", "b"), "x=y"),
])
def test_parse_override_reads_dotted_keys_and_yaml_values(
    item: str, path: tuple[str, ...], value: Any
) -> None:
    assert parse_override(item) == (path, value)


@pytest.mark.parametrize(("item", "words"), [
    ("train.steps", "expected KEY=VALUE"),
    ("=5", "expected KEY=VALUE"),
    ("train..steps=5", "segment ''"),
    ("train.st eps=5", "segment 'st eps'"),
    ("train.steps=[1", "not valid YAML"),
])
def test_parse_override_refuses_malformed_items(item: str, words: str) -> None:
    with pytest.raises(OverrideError, match=words.replace("[", r"\[")) as info:
        parse_override(item)
    assert "\n" not in str(info.value)


def test_apply_overrides_copies_creates_and_later_wins() -> None:
    result = apply_overrides(STORED, ["train.steps=2000", "data.seed=7", "train.steps=16"])
    assert result["train"] == {"steps": 16, "lr": 0.001}
    assert result["data"] == {"seed": 7}
    assert STORED["train"] == {"steps": 30, "lr": 0.001} and "data" not in STORED  # input untouched
    assert apply_overrides(STORED, []) == STORED


def test_apply_overrides_refuses_a_key_through_a_scalar() -> None:
    with pytest.raises(OverrideError, match=r"train\.steps is int 30, not a mapping"):
        apply_overrides(STORED, ["train.steps.max=5"])


class FakeClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    def request(self, method: str, path: str, json: Any = None, headers: Any = None) -> dict[str, Any]:
        self.calls.append((method, path, json))
        if method == "GET" and path == "/v1/jobs/MISSING":
            raise CliError("404 Not Found: job 'MISSING' not found")
        if method == "GET":
            return {"id": "OLD", "spec": STORED}
        if path.endswith("/resume"):
            return {"id": "OLD", "state": "queued", "attempt": 2, "reason": "queued: resumed by user of "
                    "tenant a from its last verified checkpoint (step 8)"}
        return {"id": "NEW", "name": json["name"], "state": "pending"}


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    fake = FakeClient()
    monkeypatch.setattr(cli_jobs, "client_for", lambda ctx: fake)
    return fake


def test_submit_from_job_with_overrides_posts_the_copy(client: FakeClient) -> None:
    result = CliRunner().invoke(app, ["submit", "--from", "OLD", "--set", "train.steps=2000",
                                      "--set", "name=demo-long"])
    assert result.exit_code == 0, result.output
    (_, get_path, _), (method, post_path, body) = client.calls
    assert (get_path, method, post_path) == ("/v1/jobs/OLD", "POST", "/v1/jobs")
    assert body == {**STORED, "name": "demo-long", "train": {"steps": 2000, "lr": 0.001}}
    assert "submitted job NEW (demo-long)" in result.stdout


@pytest.mark.parametrize(("args", "words"), [
    (["submit", "--from", "OLD", "--set", "train..steps=1"], "segment ''"),
    (["submit", "--from", "OLD", "--set", "train.steps"], "expected KEY=VALUE"),
    (["submit", "--from", "OLD", "--set", "train.steps.x=1"], "not a mapping"),
    (["submit"], "exactly one"),
    (["submit", "spec.yaml", "--from", "OLD"], "exactly one"),
])
def test_bad_usage_is_one_line_and_exit_2(client: FakeClient, args: list[str], words: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], result.stderr
    assert not [c for c in client.calls if c[0] == "POST"]  # nothing submitted


def test_submit_from_an_unknown_job_is_exit_1(client: FakeClient) -> None:
    result = CliRunner().invoke(app, ["submit", "--from", "MISSING"])
    assert result.exit_code == 1 and "404" in result.stderr


def test_resume_prints_the_new_attempt(client: FakeClient) -> None:
    result = CliRunner().invoke(app, ["resume", "OLD"])
    assert result.exit_code == 0, result.output
    assert client.calls == [("POST", "/v1/jobs/OLD/resume", None)]
    assert "attempt 2" in result.stdout and "step 8" in result.stdout
