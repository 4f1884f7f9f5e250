"""Job specs the API tests submit."""

from __future__ import annotations

import copy
from typing import Any

TINY: dict[str, Any] = {
    "name": "tiny",
    "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
    "train": {"steps": 10, "global_batch": 4},
    "parallelism": {"tp": 2, "dp": 2, "micro_batch_size": 1, "num_microbatches": 2},
}


def tiny(**overrides: Any) -> dict[str, Any]:
    spec = copy.deepcopy(TINY)
    spec.update(overrides)
    return spec
