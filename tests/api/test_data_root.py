"""`data.path` is resolved inside LATTICE_DATA_ROOT and checked at submit: 422 naming data.path for a
path outside the root (the same answer whether or not it exists), a missing, short or ragged file;
the service refuses to start with a data root that would expose its own state."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from service.api.app import create_app
from service.api.data_root import DataRootError
from service.settings import Settings
from service.store.models import Job, JobEvent
from tests.api.conftest import bearer
from tests.api.specs import tiny

SEQ_LEN = 32  # tiny()'s model.seq_len


def tokens_spec(path: str) -> dict:
    return tiny(data={"kind": "tokens", "path": path})


def write_tokens(path: Path, n: int, width: int = 2) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(n * width))  # token id 0, n times
    return path


def stored(sf: sessionmaker[Session]) -> tuple[int, int]:
    with sf() as s:
        return (
            s.scalar(select(func.count()).select_from(Job)) or 0,
            s.scalar(select(func.count()).select_from(JobEvent)) or 0,
        )


@pytest.fixture
def root(settings: Settings) -> Path:
    return Path(os.path.realpath(settings.data_root_path))


def refused(client: TestClient, token: str, path: str) -> str:
    r = client.post("/v1/jobs", json=tokens_spec(path), headers=bearer(token))
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert [e["field"] for e in body["errors"]] == ["data.path"], body
    assert "Errno" not in body["detail"] and "No such file" not in body["detail"]
    return body["detail"]


def test_bad_data_paths_are_422_naming_data_path_and_store_nothing(
    client: TestClient, tokens: dict[str, str], root: Path, tmp_path: Path,
    db_session_factory: sessionmaker[Session],
) -> None:
    outside = write_tokens(tmp_path / "outside.bin", 100)
    os.symlink(outside, root / "link.bin")
    write_tokens(root / "ragged.bin", 1, width=3)  # 3 bytes: not whole uint16 tokens
    write_tokens(root / "short.bin", SEQ_LEN)  # one token short of a sample
    (root / "empty-folder").mkdir()
    before = stored(db_session_factory)
    token = tokens["a"]
    for path in ("../outside.bin", "../../outside.bin", str(outside), "link.bin", "/etc/passwd"):
        assert "must be inside the data root" in refused(client, token, path), path
    assert "does not exist in the data root" in refused(client, token, "missing.bin")
    assert "not a whole number of uint16 tokens" in refused(client, token, "ragged.bin")
    assert f"at least one sample of seq_len + 1 = {SEQ_LEN + 1} tokens" in refused(client, token, "short.bin")
    assert "folder without .bin shards" in refused(client, token, "empty-folder")
    assert stored(db_session_factory) == before


def test_outside_the_root_existing_and_missing_files_get_the_same_answer(
    client: TestClient, tokens: dict[str, str], tmp_path: Path
) -> None:
    existing = write_tokens(tmp_path / "secret.bin", 100)
    missing = tmp_path / "absent.bin"
    answers = {
        refused(client, tokens["a"], str(p)).replace(str(p), "PATH") for p in (existing, missing)
    }
    assert len(answers) == 1, answers
    dotted = {
        refused(client, tokens["a"], p).replace(p, "PATH") for p in ("../../secret.bin", "../../absent.bin")
    }
    assert dotted == answers


def test_valid_files_inside_the_root_pass_and_the_resolved_path_is_stored(
    client: TestClient, tokens: dict[str, str], root: Path
) -> None:
    tenant_file = write_tokens(root / "team-a" / "ok.bin", 10 * SEQ_LEN + 1)  # per-tenant subfolder
    r = client.post("/v1/jobs", json=tokens_spec("team-a/ok.bin"), headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["data"]["path"] == str(tenant_file)  # what the ranks open, absolute
    r = client.post("/v1/jobs", json=tokens_spec(str(tenant_file)), headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text
    shards = root / "shards"
    write_tokens(shards / "000.bin", SEQ_LEN + 1)
    write_tokens(shards / "001.bin", SEQ_LEN + 1)
    r = client.post("/v1/jobs", json=tokens_spec("shards"), headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text


def test_data_root_is_created_0700_and_may_not_expose_the_service_state(
    tmp_path: Path, db_engine: Engine, db_url: str
) -> None:
    home = tmp_path / "svc"
    settings = Settings(home=home, database_url=db_url)
    create_app(settings, engine=db_engine)
    assert stat.S_IMODE(os.stat(home / "data").st_mode) == 0o700
    for bad in (
        Settings(home=home, database_url=db_url, data_root=home),  # the home itself
        Settings(home=home, database_url=db_url, data_root=tmp_path),  # a folder above the home
        Settings(home=home, database_url=db_url, data_root=tmp_path / "d", token_file=tmp_path / "d" / "t"),
        Settings(
            home=home, database_url=db_url, data_root=tmp_path / "d", checkpoint_root=tmp_path / "d" / "c"
        ),
        Settings(home=home, data_root=tmp_path / "d", database_url=f"sqlite:///{tmp_path / 'd' / 'x.db'}"),
    ):
        with pytest.raises(DataRootError, match="LATTICE_DATA_ROOT"):
            create_app(bad, engine=db_engine)
