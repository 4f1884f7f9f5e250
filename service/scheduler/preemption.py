"""Preemption that loses nothing, from the scheduler's side: who gets a preemption notice, and why.

Three triggers send the same notice (workers.controller.preempt: checkpoint at the next step
boundary, stop, back to `queued`, resume from that step):

- a node drain (`POST /v1/cluster/nodes/{node}/drain`, `lattice cluster drain NODE`): the node is
  cordoned and every job with ranks on it is preempted;
- a cloud preemption notice: the node agent writes a file named after the node into the notice
  directory (settings.preempt_notice_dir, default <home>/preempt); the loop reads it each tick and
  drains the node (`read_notices`);
- a higher-priority job that cannot be placed: `choose_victims` (pure) picks the running jobs whose
  GPUs let it fit, losing least;
- a tenant taking back GPUs it lent: a job within its tenant's quota that cannot be placed while
  other tenants' jobs run on borrowed GPUs (beyond their own quotas) preempts those, whatever their
  priority (`choose_reclaim`: `choose_victims` over the borrowed jobs only). Lending idle GPUs is
  only safe because it can be undone.

A job whose spec says `preemption.preemptible: false` (admins only) is never preempted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A running job as a possible victim."""

    job_id: str
    gpus: int
    priority: int
    steps_since_checkpoint: int = 0  # what a preemption past its grace period would lose
    borrowing: bool = False  # runs on GPUs lent beyond its tenant's quota (reclaimable)
    preemptible: bool = True
    tenant: str = ""


def victim_order(c: Candidate) -> tuple[int, int, int, str]:
    """Lose least first: lowest priority, then fewest steps since the last checkpoint, then borrowed
    GPUs before owned ones (then the job id, for a stable order)."""
    return (c.priority, c.steps_since_checkpoint, 0 if c.borrowing else 1, c.job_id)


def choose_victims(need_gpus: int, free_gpus: int, priority: int | None,
                   running: Iterable[Candidate]) -> list[Candidate] | None:
    """The running jobs to preempt so that a job of `priority` needing `need_gpus` fits, or None when
    no such set exists (then nobody is preempted). Only preemptible jobs of lower priority (any
    priority when `priority` is None: a reclaim) are candidates, taken in `victim_order` until the
    freed GPUs and the free ones cover the need; a job already fitting needs no victims ([]).
    Counts GPUs only: the caller checks placement."""
    if need_gpus <= free_gpus:
        return []
    chosen: list[Candidate] = []
    freed = free_gpus
    eligible = (c for c in running if c.preemptible and (priority is None or c.priority < priority))
    for c in sorted(eligible, key=victim_order):
        chosen.append(c)
        freed += c.gpus
        if freed >= need_gpus:
            return _drop_unneeded(chosen, need_gpus, freed)
    return None


def choose_reclaim(need_gpus: int, free_gpus: int, tenant: str, gpu_quota: int | None,
                   running: Iterable[Candidate]) -> list[Candidate] | None:
    """The borrowing jobs of other tenants to preempt so that `tenant`'s job needing `need_gpus`
    fits, whatever their priority; None when the job is beyond its tenant's quota (its own GPUs held
    within the quota plus `need_gpus` exceed `gpu_quota`; None = no cap) or when the lent GPUs and
    the free ones together would not cover it."""
    running = list(running)
    held = sum(c.gpus for c in running if c.tenant == tenant and not c.borrowing)
    if gpu_quota is not None and held + need_gpus > gpu_quota:
        return None
    lent = [c for c in running if c.borrowing and c.tenant != tenant]
    return choose_victims(need_gpus, free_gpus, None, lent)


def _drop_unneeded(chosen: list[Candidate], need: int, freed: int) -> list[Candidate]:
    """Keep no victim whose GPUs the others already cover (the latest chosen are the dearest)."""
    for c in sorted(chosen, key=victim_order, reverse=True):
        if freed - c.gpus >= need:
            chosen.remove(c)
            freed -= c.gpus
    return chosen


def jobs_on_nodes(placements: Iterable[tuple[str, Iterable[str]]], nodes: Iterable[str]) -> list[str]:
    """The job ids (of (job_id, node names) pairs) with a rank on any of `nodes`."""
    wanted = set(nodes)
    return sorted(job_id for job_id, on in placements if wanted & set(on))


def read_notices(directory: Path | None) -> list[str]:
    """Node names of the cloud preemption notices in `directory` (one file per node, any content);
    each file is removed once read, so a notice acts once."""
    if directory is None or not directory.is_dir():
        return []
    nodes = []
    for f in sorted(directory.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        nodes.append(f.name)
        try:
            f.unlink()
        except OSError as e:  # read again next tick; a drain twice is harmless
            log.warning("could not remove the preemption notice %s: %s", f, e)
    return nodes

