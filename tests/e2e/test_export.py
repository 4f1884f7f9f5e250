"""Export and import end to end: a dense GQA job trained by the service on a token file in the data
root is exported with `lattice export` (Hugging Face) and `POST /v1/jobs/{id}/exports` (torch); the
HF folder loads in `transformers` with no missing or unexpected keys and gives Lattice's loss within
1e-4; a new job with `model.init_from` on the export (another layout: TP 2) starts at the export's
evaluation; a spec whose shapes do not match is refused at submit naming the tensor."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from service.cli import app
from tests.e2e.conftest import TERMINAL, LiveService, make_service, wait_for, wait_for_free_gpus
from training.config.layout import Layout
from training.config.run import DataConfig, RunConfig, ValidationConfig
from training.config.spec import ModelSpec
from training.data.sources import make_data_source, write_token_file
from training.data.validation import offline_loss
from training.interop.export import consolidated_state, find_checkpoint
from training.model.transformer import Transformer, cross_entropy_loss

pytestmark = pytest.mark.ray

MODEL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 96, "seq_len": 16,
         "rope_theta": 5000.0}
VAL = ValidationConfig(fraction=0.25, every_steps=2, batches=2)
SPEC: dict[str, Any] = {
    "name": "export-me",
    "model": MODEL,
    "data": {"kind": "tokens", "path": "tokens.bin", "seed": 3,
             "validation": {"fraction": 0.25, "every_steps": 2, "batches": 2}},
    "train": {"steps": 4, "global_batch": 4, "seed": 1},
    "parallelism": {"dp": 2, "micro_batch_size": 2},
    "fault_tolerance": {"max_restarts": 0},
}


@pytest.fixture(scope="module")
def svc(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    wait_for_free_gpus()
    service = make_service(ray_cluster, tmp_path_factory.mktemp("export") / "home")
    root = service.settings.data_root_path
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tokens = (5 * (torch.arange(128 * 16) % 10) + 1) % 96  # a learnable cycle, 5% noise
    noise = torch.rand(tokens.shape, generator=gen) < 0.05
    tokens[noise] = torch.randint(0, 96, (int(noise.sum()),), generator=gen)
    write_token_file(root / "tokens.bin", tokens)
    try:
        yield service
    finally:
        service.close()


def _eval(state: dict[str, torch.Tensor], spec: ModelSpec, inputs: torch.Tensor,
          targets: torch.Tensor) -> float:
    model = Transformer(spec)
    model.load_state_dict(state)
    with torch.no_grad():
        return float(cross_entropy_loss(model(inputs), targets))


def _succeeded(svc: LiveService, spec: dict[str, Any]) -> dict[str, Any]:
    job = svc.wait_state(svc.submit(spec)["id"], TERMINAL, timeout_s=300)
    assert job["state"] == "succeeded", job.get("error")
    return job


def test_export_to_hf_and_torch_then_import_into_a_new_job(svc: LiveService) -> None:
    from transformers import AutoModelForCausalLM

    job = _succeeded(svc, SPEC)
    assert svc.runtime is not None and svc.settings.checkpoint_root is not None
    url = svc.runtime.serve_in_thread(port=0)
    cli = CliRunner().invoke(app, ["--server", url, "--token", svc.admin, "export", job["id"],
                                   "--output", "exports/hf"])  # hf unless --format says otherwise
    assert cli.exit_code == 0, cli.output
    assert "exported step 4 as hf" in cli.output and "model.safetensors" in cli.output
    hf_dir = svc.settings.data_root_path / "exports" / "hf"

    spec = ModelSpec(**MODEL)
    source = make_data_source(DataConfig(kind="tokens", path=str(svc.settings.data_root_path / "tokens.bin")),
                              spec, 6)
    inputs, targets = source.batch(0, 0, 1)
    ckpt = find_checkpoint(svc.settings.checkpoint_root / job["id"], None)
    ours = _eval(consolidated_state(ckpt, spec), spec, inputs, targets)

    # Validation: a `validation` event every 2 steps, the last one equal to an offline evaluation.
    validation = [e["payload"] for e in svc.events(job["id"]) if e["type"] == "validation"]
    assert [e["step"] for e in validation] == [2, 4], validation
    cfg = RunConfig(model=spec, layout=Layout(dp=2, micro_batch_size=2), steps=4,
                    data=DataConfig(kind="tokens", path=str(svc.settings.data_root_path / "tokens.bin"),
                                    seed=3, validation=VAL))
    assert abs(validation[-1]["loss"] - offline_loss(consolidated_state(ckpt, spec), cfg)) < 1e-5
    hf, info = AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True,
                                                    dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = hf.eval()(input_ids=inputs).logits
    theirs = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    assert abs(ours - theirs) < 1e-4, (ours, theirs)

    # The API: torch format, asynchronous with a status; bad requests are 4xx naming the field.
    r = svc.api("POST", f"/v1/jobs/{job['id']}/exports", json={"format": "torch", "step": 4})
    assert r.status_code == 202, r.text
    path = f"/v1/jobs/{job['id']}/exports/{r.json()['id']}"
    done = wait_for(lambda: (lambda s: s if s["state"] != "running" else None)(svc.api("GET", path).json()),
                    120, "the torch export")
    assert done["state"] == "succeeded" and {"model.pt", "model.json"} <= set(done["files"]), done
    bad_step = svc.api("POST", f"/v1/jobs/{job['id']}/exports", json={"step": 3})  # format: hf by default
    assert bad_step.status_code == 422 and bad_step.json()["errors"][0]["field"] == "step"
    outside = svc.api("POST", f"/v1/jobs/{job['id']}/exports", json={"format": "hf", "output": "../x"})
    assert outside.status_code == 422 and outside.json()["errors"][0]["field"] == "output"
    other = svc.api("POST", f"/v1/jobs/{job['id']}/exports", token=svc.user, json={"format": "hf"})
    assert other.status_code == 404

    # Import: a new job (TP 2, another data order) starts where the export ended.
    spec2 = copy.deepcopy(SPEC)
    spec2.update(name="import-me", train={"steps": 1, "global_batch": 2, "seed": 7},
                 parallelism={"tp": 2, "micro_batch_size": 2})
    spec2["data"]["seed"] = 11
    spec2["model"] = {**MODEL, "init_from": {"path": "exports/hf", "format": "hf"}}
    job2 = _succeeded(svc, spec2)
    source2 = make_data_source(DataConfig(kind="tokens", path=str(svc.settings.data_root_path / "tokens.bin"),
                                          seed=11, validation=VAL), spec, 2)
    expected = _eval(consolidated_state(ckpt, spec), spec, *source2.batch(1, 0, 1))
    assert abs(job2["result"]["loss_first"] - expected) < 1e-4, (job2["result"], expected)

    # Shapes that do not match the spec are refused at submit, naming the first mismatch.
    spec3 = copy.deepcopy(spec2)
    spec3["model"] = {**MODEL, "ffn": 64, "init_from": {"path": "exports/hf", "format": "hf"}}
    refused = svc.api("POST", "/v1/jobs", json=spec3)
    assert refused.status_code == 422, refused.text
    assert "model.layers.0.mlp.gate_proj.weight" in refused.json()["detail"]
    spec3["model"]["init_from"]["path"] = "../../etc"
    assert svc.api("POST", "/v1/jobs", json=spec3).json()["errors"][0]["field"] == "model.init_from.path"
