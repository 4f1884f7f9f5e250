"""A statistical gradient check settled before the optimizer applies the step, so that a job's own
gradient spike costs one re-run of the step instead of a restart from the last checkpoint.

The local gradient-norm checks (training.integrity.rerun.STATISTICAL_KINDS: a rank's norm far above
its own history or its DP peers') fire after the backward, before the optimizer step: the parameters
and the optimizer state are still those the step started from. Where no pre-step snapshot is kept
(ZeRO >= 1; DP >= 3 under `audit.snapshot: auto`), every rank agrees on that flag before its
optimizer step (one small all-reduce a step: `AuditConfig.settles_before_update`), and a flagged
step is re-run there, from those parameters, with the swap probe (training.integrity.swap) between:

- the same spike again, and the same batch giving the same norm on a DP peer's device: the data's.
  The step is applied (its gradients are the first run's, to the bit) and training goes on; the
  hooks hear of it after the step (`settle.attribute` returns the verdict: `on_gradient_spike`).
- otherwise the named rank's device's (transient: the re-run changed the norm; persistent: the
  batch gave another norm elsewhere). The step is applied with the re-run's gradients and the
  verdict fails the attempt after it, as a re-run from a snapshot would (`on_integrity_error`).

Before this, such a spike failed the attempt, nobody was blamed, and the restart from the checkpoint
re-ran the step (training.integrity.settle): a clean DP 8 run of the demo model with no checkpoint
lost 123 and then 147 steps to two ordinary spikes of its own data. That path remains where the
re-run is off (`audit.snapshot: never`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from training.integrity.gradient import take_gradient_checks
from training.integrity.rerun import STATISTICAL_KINDS, data_spike, rerun_attribution, shared_error
from training.integrity.settle import local_norm
from training.parallel.dist import agree_flags

log = logging.getLogger(__name__)

ATTRIBUTION = "re-run before the update"


def settle_before_update(trainer: Any, step: int, inputs: torch.Tensor, targets: torch.Tensor,
                         rng: torch.Tensor) -> None:
    """After the DP reduction of `step` and before its optimizer step, on every rank: a statistical
    gradient check that fired on any rank is re-run from the unchanged parameters and attributed;
    the verdict waits in `trainer.settled` for the check after the step (settle.attribute).
    `rng`: the CPU generator's state when the step's forward began."""
    mine = trainer._local_error  # noqa: SLF001 - the trainer's own report of this step
    flagged = mine is not None and mine.kind in STATISTICAL_KINDS
    if not agree_flags([flagged], trainer.ctx.device)[0]:
        return
    shared, found = shared_error(mine, local_norm(trainer))
    if not all(kind in STATISTICAL_KINDS for kind, *_ in found):
        return  # an exact check fired too: attributed after the step, as before

    def rerun() -> None:  # its loss is this rank's own, not the step's: left out of the agreed verdict
        torch.set_rng_state(rng)
        trainer.arm_step(step)  # a faulty device corrupts whatever it computes at this step
        trainer.rerun_local = None
        trainer.forward_backward(inputs, targets,
                                 before_sync=lambda: trainer.check_local_grads(step, rerun=True))
        take_gradient_checks(trainer, step, rerun=True)

    _drop_gradients(trainer)  # the probe and the re-run start from no gradients, as the step did
    verdict = rerun_attribution(trainer, step, shared, found, rerun=(rerun, ATTRIBUTION))
    trainer.settled = (step, verdict, data_spike(verdict, found))
    log.info("gradient check at step %d re-run before the update: %s", step, verdict)


def _drop_gradients(trainer: Any) -> None:
    for _, p in trainer.named_parameters():
        p.grad = None
