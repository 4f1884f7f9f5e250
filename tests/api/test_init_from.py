"""Submit-time checks of `model.init_from` and `data.validation.path` (no torch in the API process):
inside the data root, and tensors that match the spec exactly; each refusal names its field and
stores nothing."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.settings import Settings
from tests.api.conftest import bearer
from tests.api.specs import TINY, tiny
from training.config.spec import ModelSpec
from training.interop.names import hf_shapes


def _safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    """A safetensors file with these float32 shapes (zero bytes), written without torch."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4
        for d in shape:
            size *= d
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return path


@pytest.fixture
def root(settings: Settings) -> Path:
    path = Path(os.path.realpath(settings.data_root_path))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _submit(client: TestClient, token: str, spec: dict) -> tuple[int, dict]:
    r = client.post("/v1/jobs", json=spec, headers=bearer(token))
    return r.status_code, r.json()


def test_init_from_must_match_the_spec_and_live_in_the_data_root(
    client: TestClient, tokens: dict[str, str], root: Path, tmp_path: Path
) -> None:
    model = {k: v for k, v in TINY["model"].items()}
    spec = ModelSpec(**model)
    _safetensors(root / "w" / "model.safetensors", hf_shapes(spec))
    ok, job = _submit(client, tokens["a"], tiny(model={**model, "init_from": {"path": "w", "format": "hf"}}))
    assert ok == 201, job
    assert job["spec"]["model"]["init_from"]["path"] == str(root / "w")  # resolved, as the ranks open it

    wider = {**model, "ffn": (spec.ffn_dim + 64), "init_from": {"path": "w", "format": "hf"}}
    code, body = _submit(client, tokens["a"], tiny(model=wider))
    assert code == 422 and body["errors"][0]["field"] == "model.init_from", body
    assert "'model.layers.0.mlp.gate_proj.weight' has shape" in body["detail"]
    assert str(root) not in body["detail"]  # the user's path, not the server's layout

    _safetensors(tmp_path / "outside" / "model.safetensors", hf_shapes(spec))
    for path in (str(tmp_path / "outside"), "../outside", "missing"):
        code, body = _submit(client, tokens["a"], tiny(model={**model, "init_from": {"path": path}}))
        assert code == 422 and body["errors"][0]["field"] == "model.init_from.path", body
    listed = client.get("/v1/jobs", headers=bearer(tokens["a"])).json()["items"]
    assert len(listed) == 1  # nothing refused was stored


def test_validation_path_follows_the_data_root_rules(
    client: TestClient, tokens: dict[str, str], root: Path
) -> None:
    (root / "val.bin").write_bytes(bytes(2 * 100))
    good = tiny(data={"kind": "synthetic", "validation": {"path": "val.bin", "every_steps": 5}})
    code, job = _submit(client, tokens["a"], good)
    assert code == 201, job
    assert job["spec"]["data"]["validation"]["path"] == str(root / "val.bin")
    bad = tiny(data={"kind": "synthetic", "validation": {"path": "../x.bin", "every_steps": 5}})
    code, body = _submit(client, tokens["a"], bad)
    assert code == 422 and body["errors"][0]["field"] == "data.validation.path", body
    both = tiny(data={"kind": "synthetic", "validation": {"path": "val.bin", "fraction": 0.1}})
    code, body = _submit(client, tokens["a"], both)
    assert code == 422 and "exactly one of path or fraction" in json.dumps(body)
