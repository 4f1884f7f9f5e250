"""What the train loop tells its caller and what the caller may ask of it: the hooks every rank calls
(`TrainHooks`), the actions they return, the per-step progress (`StepInfo`) and the result of a run."""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from training.checkpoint.checkpointer import CheckpointInfo
from training.checkpoint.peer import KeptState, PeerPlan
from training.integrity.attribution import AuditConfig
from training.integrity.detectors import IntegrityError
from training.integrity.injection import BitFlipInjector


class Action(enum.Enum):
    CONTINUE = "continue"
    CHECKPOINT = "checkpoint"
    STOP = "stop"  # stop after this step, without a final checkpoint
    CHECKPOINT_AND_STOP = "checkpoint_and_stop"


@dataclass(frozen=True)
class StepInfo:
    step: int
    loss: float  # global-batch mean, the same on every rank
    tokens_per_s: float
    step_time_s: float
    mfu: float | None  # None when the device's peak FLOP/s is unknown (CPU)
    data_positions: list[int]  # global sample indices this rank trained on in this step
    # Seconds per phase of the step (training.phase_timer.PHASES: data, compute = forward + backward
    # (with pp > 1 the whole pipeline schedule), integrity, dp_sync, optimizer, summary).
    phases: dict[str, float] = field(default_factory=dict)
    # This rank's bytes per memory term (training.parallel.memory.MemoryAccount), on the first step
    # of an attempt only: params, grads, optimizer, activations (peak), peak_allocated (CUDA).
    memory: dict[str, int | None] | None = None


class TrainHooks:
    """Override what you need. Every rank calls its own hooks; actions are agreed across ranks."""

    #: Bit flips to inject (tests of the integrity checks): a rank's local gradient as backward
    #: produces it, before the DP reduction averages it into every replica; params after the
    #: optimizer step, so a flip on one replica makes it diverge from the others.
    injector: BitFlipInjector | None = None
    #: Checks beyond RunConfig.integrity: local gradient norms, pre-step snapshots for re-runs.
    audit: AuditConfig | None = AuditConfig()
    #: Restore only a checkpoint of one of these steps (the verified ones); None = any valid one.
    restore_steps: Collection[int] | None = None
    #: Local gradient-norm spikes a failed attempt saw with no pre-step snapshot to re-run them:
    #: step -> {rank: local norm}. The restart is the re-run: the same spike again, to the bit, is
    #: the data's (training.integrity.settle.attribute) and training goes on.
    rerun_spikes: Mapping[int, Mapping[int, float]] | None = None
    #: A peer recovery (training.checkpoint.peer): this rank's part, and the state its previous
    #: attempt kept (survivors); set, the loop starts from the peers' step instead of a checkpoint.
    peer_plan: PeerPlan | None = None
    kept_state: KeptState | None = None
    #: Keep the state in memory when the attempt fails (`keep_state`), for a peer recovery.
    keep_state_on_failure: bool = False

    def keep_state(self, kept: KeptState) -> None:
        """The failed attempt's state at the end of step `kept.step` (see `keep_state_on_failure`)."""
        return None

    def on_step(self, info: StepInfo) -> Action | None:
        return None

    def on_validation(self, step: int, loss: float) -> None:
        """The held-out loss after `step` (data.validation; the same on every rank)."""
        return None

    def on_restore(self, step: int | None) -> None:
        """Training starts from checkpoint `step` (None: from scratch)."""
        return None

    def on_collective(self, step: int, name: str) -> None:
        """About to enter the per-step control collective `name` that every rank joins (a rank that
        never reports it while the others did is the one they wait for)."""
        return None

    def on_checkpoint_start(self, step: int) -> None:
        """A checkpoint save of `step` begins."""
        return None

    def on_verified(self, step: int) -> None:
        """Every rank's integrity checks passed at `step`, replica comparison included."""
        return None

    def should_checkpoint(self, step: int) -> bool:
        return False

    def on_checkpoint(self, step: int, path: str, nbytes: int, seconds: float) -> None:
        return None

    def on_gradient_rerun(self, step: int, same: list[int], changed: list[int]) -> None:
        """A restart re-ran `step`, whose gradient spike failed an earlier attempt (`rerun_spikes`),
        and no check failed this time: the ranks whose local norm came out `same` to the bit (the
        data's) and those whose norm `changed` (a transient fault then). Every rank; agreed."""
        return None

    def on_gradient_spike(self, error: IntegrityError) -> None:
        """A gradient-norm check fired and the re-run from the snapshot reproduced it bit for bit on
        every rank: the data's spike, not corruption; the re-run step stands and training goes on."""
        return None

    def on_integrity_error(self, error: IntegrityError) -> Action | None:
        """Default: raise. Return an Action to keep going (CONTINUE) or stop (STOP) instead."""
        raise error


@dataclass
class TrainResult:
    final_step: int
    losses: list[float]  # one per step run in this call
    model_digest: str
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    resumed_from: int | None = None
