"""How many CPUs this process may use: its affinity mask, bounded by a cgroup CPU quota (a container's
`--cpus`, a Kubernetes pod's CPU limit), as Go's automaxprocs and Python 3.13's process_cpu_count do."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def usable_cpus(cgroup: Path = CGROUP) -> int:
    """CPUs of the affinity mask, at most the cgroup quota rounded up; at least 1."""
    mask = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup)
    return max(1, min(mask, math.ceil(quota)) if quota is not None else mask)


def cgroup_cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """CPUs the cgroup may use (quota / period), None when unlimited or unknown. cgroup v2 `cpu.max`
    ("max 100000" or "200000 100000"), else v1 `cpu/cpu.cfs_quota_us` (-1: unlimited) and its period."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
