"""The planner is pure Python: importing it pulls in neither torch nor Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_planner_loads_neither_torch_nor_ray():
    code = (
        "import sys\n"
        "import service.planner, service.planner.search, service.planner.layout_text\n"
        "from service.planner import plan, get_preset, ClusterSpec, TrainSpec\n"
        "plan(get_preset('tiny'), TrainSpec(8, 32), ClusterSpec('cpu-virtual', 8, 4))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'fastapi'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "", f"planner imported {out.stdout.strip()}"
