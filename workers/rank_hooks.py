"""The training hooks of a rank actor (`make_hooks`): they report every step, restore, checkpoint and
integrity error into the actor's event buffer, run the faults due at each step, and carry the actor's
peer-recovery plan and kept state to the training loop (training.checkpoint.peer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.events import CheckpointReport, CollectiveReport, EventKind, plain

if TYPE_CHECKING:
    from workers.rank import RankActor


def make_hooks(actor: RankActor) -> Any:
    """A `training.train.TrainHooks` that reports into `actor`'s buffer (imported lazily so that
    an actor which only reports where it runs never imports torch)."""
    from training.train import Action, TrainHooks

    class RankHooks(TrainHooks):
        def on_step(self, info: Any) -> Any:
            actor.record(EventKind.STEP, {**plain(info), "dp": actor.coord.get("dp", 0)})
            actor.report_flips(info.step)
            actor.after_step(info.step, "step")
            wanted = actor.take_action()
            return Action(wanted) if wanted else None

        def on_restore(self, step: int | None) -> None:
            actor.kept_state = None  # consumed (a peer recovery) or stale (a checkpoint restore)
            actor.record(EventKind.RESTORED, {"step": step, "source": "peers" if self.peer_plan else
                                              "checkpoint" if step is not None else "scratch"})

        def keep_state(self, kept: Any) -> None:
            actor.kept_state = kept

        def on_validation(self, step: int, loss: float) -> None:
            actor.record(EventKind.VALIDATION, {"step": step, "loss": loss})

        def on_collective(self, step: int, name: str) -> None:
            actor.record(EventKind.COLLECTIVE, CollectiveReport(step=step, name=name))

        def on_checkpoint_start(self, step: int) -> None:
            actor.after_step(step, "checkpoint")  # a fault here stops this rank before the save...
            # ...while the others are in it:
            actor.record(EventKind.COLLECTIVE, CollectiveReport(step=step, name="checkpoint"))

        def on_verified(self, step: int) -> None:
            actor.record(EventKind.VERIFIED, {"step": step})

        def on_checkpoint(self, step: int, path: str, nbytes: int, seconds: float) -> None:
            actor.after_commit(step, path)  # a corrupt_checkpoint fault lands before anyone hears of it
            actor.record(EventKind.CHECKPOINT,
                         CheckpointReport(step=step, path=path, bytes=nbytes, seconds=seconds))

        def on_gradient_rerun(self, step: int, same: list[int], changed: list[int]) -> None:
            actor.record(EventKind.GRADIENT_RERUN, {"step": step, "same": same, "changed": changed})

        def on_gradient_spike(self, error: Any) -> None:
            actor.record(EventKind.GRADIENT_SPIKE, _error_fields(error))

        def on_integrity_error(self, error: Any) -> Any:
            actor.record(EventKind.INTEGRITY_ERROR, {**_error_fields(error), "message": str(error)})
            raise error

    hooks = RankHooks()
    hooks.injector = actor.injector
    hooks.restore_steps = actor.restore_steps
    hooks.rerun_spikes = actor.rerun_spikes
    hooks.keep_state_on_failure = True
    if actor.peer_request is not None:  # a peer recovery (training.checkpoint.peer)
        from training.checkpoint.peer import PeerPlan

        sources = {int(k): int(v) for k, v in actor.peer_request["sources"].items()}
        hooks.peer_plan = PeerPlan.for_rank(actor.rank, int(actor.peer_request["step"]), sources)
        hooks.kept_state = actor.kept_state
    return hooks


def _error_fields(error: Any) -> dict[str, Any]:
    """What the controller reads of an engine IntegrityError (kind, step, ranks, evidence)."""
    return {"error_kind": error.kind, "step": error.step, "ranks": list(error.ranks),
            "evidence": plain(error.evidence)}
