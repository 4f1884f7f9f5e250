"""The train loop: what every rank runs for one job.

    result = train(ctx, cfg, hooks)

Builds the mesh (training.parallel.mesh), the model or this rank's pipeline stages on the meta device,
applies the layout (training.parallel.parallelize / training.parallel.pipeline), the optimiser and the data
source, restores the newest valid checkpoint, then runs `cfg.steps` optimizer steps. One step:

  1. every DP rank reads its disjoint slice of the step's global batch;
  2. forward + backward over `num_microbatches` micro-batches (pp = 1: gradient accumulation,
     the DP reduction held back until the last one), or the pipeline schedule (pp > 1);
  3. the DP gradient average completes; optional clipping; the optimizer steps;
  4. the global-batch mean loss (the same on every rank), NaN/Inf and spike checks, and every
     `integrity.fingerprint_every` steps the DP replicas' fingerprints are compared (ZeRO-0/1 with
     dp > 1, HSDP); each rank checks its own gradient norm before the DP reduction (`hooks.audit`),
     which carries the gradient checks (training.integrity.gradient; opt-in .abft);
  5. the hooks see the progress and may ask for a checkpoint or a stop.
Control decisions (checkpoint, stop, integrity failure) are agreed by all ranks with one small
all-reduce per step, so no rank leaves a collective the others are in. A failed check that a vote
cannot attribute (two replicas disagreeing) is re-run from the pre-step snapshot to find the
replica that does not reproduce (training.integrity.attribution).

A step whose checks all passed (replicas compared where they exist) is *verified* (`hooks.on_verified`,
`integrity.json` in its checkpoint); a restart restores only those (`hooks.restore_steps` or saved so).

Step numbers count completed optimizer steps: step s (1-based) consumes the data of step s, and
a checkpoint of step s resumes at step s + 1.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from training.checkpoint import peer
from training.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from training.checkpoint.manifest import INTEGRITY, vouched_steps
from training.config.arithmetic import mfu, model_flops_per_token
from training.config.run import RunConfig
from training.config.validate import check_layout_for_model
from training.data.sources import make_data_source
from training.data.validation import evaluate, validation_source
from training.hooks import Action, StepInfo, TrainHooks, TrainResult
from training.integrity.abft import GradABFT
from training.integrity.attribution import LocalGradCheck, StepSnapshot
from training.integrity.before_update import settle_before_update
from training.integrity.detectors import IntegrityError, LossSpikeDetector, check_finite
from training.integrity.digest import full_state, model_digest
from training.integrity.fingerprint import FingerprintVote, param_fingerprint, summarize_step
from training.integrity.gradient import attach_gradient_audits, take_gradient_checks
from training.integrity.history import history_state, load_history
from training.integrity.settle import attribute, probe_rerun, rerun_check
from training.model.transformer import Transformer
from training.parallel.dist import DistContext, agree_flags, gloo_links, peak_flops
from training.parallel.memory import MemoryAccount, SavedTensorMeter, account, grad_bytes
from training.parallel.mesh import ParallelDims
from training.parallel.optim import (
    build_optimizer,
    clip_grad_norm,
    finish_grad_sync,
    microbatch_context,
    no_grad_sync,
)
from training.parallel.precision import masters_in_place, with_masters
from training.parallel.stages import build_rank_modules
from training.parallel.wrapping import unwrap
from training.phase_timer import PhaseTimer

__all__ = ["Action", "StepInfo", "TrainHooks", "TrainResult", "Trainer", "train"]

log = logging.getLogger(__name__)


class Trainer:
    """One rank's model parts, optimizers and data, and the step function."""

    def __init__(self, ctx: DistContext, cfg: RunConfig, hooks: TrainHooks | None = None,
                 flops_per_token: float | None = None) -> None:
        self.ctx, self.cfg, self.hooks = ctx, cfg, hooks or TrainHooks()
        layout = cfg.layout
        check_layout_for_model(cfg.model, layout)
        torch.manual_seed(cfg.seed)
        self.dims = ParallelDims.build(layout, ctx.device.type)
        # Ranks with identical parameters (dp x cp; expert-DP with EP): ZeRO-1 and fingerprints.
        self.dp_group = self.dims.replica_group()
        self.pipeline, self.modules = build_rank_modules(cfg, self.dims, ctx.device)
        self.parts: list[Transformer] = [_as_transformer(unwrap(m)) for m in self.modules]
        # One optimizer per model part (checkpoints pair each part with its optimizer).
        if cfg.init_from is not None:  # pretrained weights; a checkpoint restored later wins
            from training.interop.load import load_init_weights

            load_init_weights(list(self.parts), cfg.init_from, cfg.model, layout.ep)
        self.optimizers = [with_masters(build_optimizer([p], layout, cfg, self.dp_group), p)
                           for p in self.parts]  # bf16 runs step fp32 masters (parallel.precision)
        self.data = make_data_source(cfg.data, cfg.model, cfg.global_batch)
        self.val_source = validation_source(cfg, self.data)  # None without data.validation
        self.spikes = LossSpikeDetector(cfg.integrity.loss_spike_factor)
        audit = self.hooks.audit
        self.local_check = (LocalGradCheck(audit.grad_spike_factor, audit.grad_warmup)
                            if audit is not None and audit.local_grad_check else None)
        self.grad_audits = attach_gradient_audits(self.modules, audit, self.hooks.injector,
                                                  outliers=cfg.model.num_experts == 0)
        self.abft = (GradABFT(self.parts[0]) if cfg.integrity.abft and layout.pp == 1
                     and cfg.dp_impl == "lattice" else None)  # p.grad is local before our DDP's sync
        snapshot = audit is not None and audit.wants_snapshot(layout.dp, layout.zero_stage)
        self.snapshot = StepSnapshot(self.parts, self.optimizers) if snapshot else None
        self.settles_early = audit is not None and audit.settles_before_update(layout.dp, layout.zero_stage)
        self.last_vote: FingerprintVote | None = None
        self.links = gloo_links() if self.hooks.keep_state_on_failure else None  # parallel.links
        if self.links is not None:
            self.links.record()
        self.pending_vote: FingerprintVote | None = None
        self.fingerprint_ran = False
        self.verified_step: int | None = None  # the last step whose integrity checks all passed
        self._local_error: IntegrityError | None = None
        self.rerun_local: tuple[float, bool] | None = None  # the local gradient check on a re-run
        self.flops_per_token = flops_per_token or model_flops_per_token(cfg.model)
        self.peak = peak_flops(ctx.device)
        self.step = 0
        # True while the state is not that of a whole step (being built or restored, or inside an
        # optimizer update): a failure then keeps nothing for a peer recovery (training.checkpoint.peer).
        self.updating = True
        self.memory: MemoryAccount | None = None  # measured on this attempt's first step
        self.steps_run, self.memory_reported = 0, False
        self.timer = PhaseTimer(ctx.device)  # per-phase step times, reported with each step
        # Owns the async save in flight; closed when the attempt ends (`close`).
        self.checkpointer = Checkpointer()

    # ---- checkpoints -------------------------------------------------------------------------
    def restore(self) -> int | None:
        root = self.cfg.checkpoint.dir
        if not root:
            return None
        allowed = None if (heard := self.hooks.restore_steps) is None else {*heard, *vouched_steps(root)}
        with masters_in_place(self.optimizers):
            parts, opts = list(self.parts), self.optimizers
            loaded = self.checkpointer.load_latest(root, parts, opts, allowed_steps=allowed)
        if loaded is None:
            return None
        step, extra = loaded
        if "data" in extra:
            self.data.load_state_dict(extra["data"])
        load_history(self, extra.get("checks"))  # the detectors' (training.integrity.history)
        self.step = step
        log.info("resumed from checkpoint step %d", step)
        return step

    def save(self) -> list[CheckpointInfo]:
        """Save this step; returns the checkpoints committed by this call (async: the previous one)."""
        c = self.cfg.checkpoint
        assert c.dir
        done = []
        previous = self.checkpointer.wait_pending()
        if previous is not None:
            done.append(previous)
        with masters_in_place(self.optimizers):  # the fp32 masters are what a checkpoint keeps
            info = self.checkpointer.save(c.dir, self.step, list(self.parts), self.optimizers,
                                          {"data": self.data.state_dict(), "checks": history_state(self)},
                                          keep=c.keep, async_save=c.async_save,
                                          describe={"model.json": self.cfg.model.to_dict(),
                                                    "layout.json": self.cfg.layout.to_dict(),
                                                    INTEGRITY: {"verified": self.verified_step == self.step}})
        if info.committed:
            done.append(info)
        return done

    # ---- one step ----------------------------------------------------------------------------
    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                         before_sync: Callable[[], None] | None = None) -> torch.Tensor | None:
        """Gradients of the mean loss over this rank's slice; returns the local mean loss (None on
        pipeline ranks without the last stage). `before_sync` runs after the last backward, while
        `p.grad` still holds this rank's own gradients (our DDP reduces bucket copies and writes
        the average back in finish_grad_sync)."""
        layout = self.cfg.layout
        if self.pipeline is not None:
            with no_grad_sync(self.modules):
                loss = self.pipeline.step(inputs, targets)
            if before_sync is not None:
                before_sync()
            finish_grad_sync(self.modules)
            return loss
        module, n = self.modules[0], layout.num_microbatches
        total = torch.zeros((), device=self.ctx.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n), strict=True)):
            with microbatch_context(module, is_last=i == n - 1):
                # Mean over this rank's tokens (with CP: its shard of the sequence).
                loss = self.parts[0].loss(module(x), y) / n
                loss.backward()
            total += loss.detach()
        if before_sync is not None:
            before_sync()
        finish_grad_sync(self.modules)
        return total

    def step_summary(self, local: torch.Tensor | None,
                     fingerprint: int | None) -> tuple[float, FingerprintVote | None]:
        """One collective per step: every rank's last-stage loss and, when due, its parameter
        fingerprint, all-gathered over the world. Returns the mean loss over the replicas
        (identical on every rank) and the vote of this rank's DP group (None when not due)."""
        layout = self.cfg.layout
        value = float(local.detach().float().item()) if local is not None else 0.0
        return summarize_step(value, fingerprint, self.dp_group, self.ctx.device,
                              layout.dp * layout.cp * layout.tp)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [item for part in self.parts for item in part.named_parameters()]

    def check_local_grads(self, step: int, rerun: bool) -> None:
        if self.abft is not None:  # read by take_gradient_checks
            self.abft.verify(step, self.ctx.rank)
        check = self.local_check
        if check is None or self.grad_audits:  # with the gradient checksums: take_gradient_checks
            return
        params = [p for _, p in self.named_parameters()]
        if rerun:
            self.rerun_local = check.recheck(params)
        else:
            self._local_error = check.check(params, step, self.ctx.rank)

    def arm_step(self, step: int) -> None:
        """Before a step's forward (or re-run): a faulty device's gradient flips, the gradient audits."""
        if (injector := self.hooks.injector) is not None:
            injector.arm_grad_flips(step, self.named_parameters())
        for grad_audit in self.grad_audits:  # gradient SDC checks inside the DP reduction
            grad_audit.begin(step)

    def train_step(self, step: int, rerun: bool = False) -> tuple[float, list[int]]:
        """One optimizer step. `rerun`: the same step again from the snapshot (no new snapshot;
        the local gradient check reports without adding to its history)."""
        dims, timer = self.dims, self.timer
        timer.start()
        inputs, targets = self.data.batch(step, dims.dp_rank, dims.dp_size)
        positions = self.data.positions(step, dims.dp_rank, dims.dp_size)
        if self.snapshot is not None and not rerun:
            with masters_in_place(self.optimizers):
                self.snapshot.capture(step)
        self.arm_step(step)
        rng = torch.get_rng_state() if self.settles_early and not rerun else None
        self._local_error = None
        inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
        timer.mark("data")

        def before_sync() -> None:
            timer.mark("compute")
            self.check_local_grads(step, rerun)
            timer.mark("integrity")

        # The first step's memory account; a pipeline's second (the first infers the stages' shapes).
        self.steps_run += 0 if rerun else 1
        due = self.memory is None and not rerun and self.steps_run == (1 if self.pipeline is None else 2)
        meter = SavedTensorMeter(self.parts, saved_hooks=not self.cfg.compile) if due else None
        with (meter.track(self.ctx.device, self.pipeline.stages if self.pipeline is not None else ())
              if meter is not None else contextlib.nullcontext()):
            local_loss = self.forward_backward(inputs, targets, before_sync=before_sync)
        grads = grad_bytes(self.parts) if meter is not None else 0  # zero_grad frees them below
        take_gradient_checks(self, step, rerun)
        timer.mark("dp_sync")
        if rng is not None:  # a statistical gradient check, re-run before the update if it fired
            settle_before_update(self, step, inputs, targets, rng)
            timer.mark("integrity")
        self.updating = True
        if self.cfg.optim.grad_clip:
            clip_grad_norm(list(self.parts), self.cfg.optim.grad_clip, dims.group("pp"))
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if meter is not None:  # the first step's memory account (training.parallel.memory)
            self.memory = account(self.parts, self.optimizers, grads, meter, self.ctx.device,
                                  self.cfg.layout.zero_stage)
        timer.mark("optimizer")
        if (injector := self.hooks.injector) is not None:
            injector.maybe_flip_params(step, self.named_parameters())
        self.step = step
        self.updating = False
        fingerprint = None
        if self.fingerprint_due(step):
            with masters_in_place(self.optimizers, replicated_only=True):  # fp32 masters (not ZeRO-1's)
                fingerprint = param_fingerprint(list(self.parts))
        loss, self.pending_vote = self.step_summary(local_loss, fingerprint)
        timer.mark("summary")
        return loss, positions

    def fingerprint_due(self, step: int) -> bool:
        every = self.cfg.integrity.fingerprint_every
        return bool(every) and step % every == 0 and self.replicas_comparable

    @property
    def replicas_comparable(self) -> bool:
        """DP replicas hold bitwise-equal (local) parameters: ZeRO-0/1 with dp > 1, or HSDP."""
        layout = self.cfg.layout
        return layout.dp > 1 and (layout.zero_stage <= 1 or layout.dp_replicate > 1)

    def check_integrity(self, step: int, loss: float) -> IntegrityError | None:
        cfg = self.cfg
        self.last_vote, self.fingerprint_ran = None, False
        error = self._local_error
        try:
            if cfg.integrity.check_finite:
                check_finite(loss, step)
            self.spikes.check(loss, step)
        except IntegrityError as e:
            error = error or e
        vote = self.pending_vote  # gathered with the step's loss (every rank took part)
        if vote is not None:
            self.last_vote, self.fingerprint_ran = vote, True
            if vote.divergent and error is None:
                error = IntegrityError("divergent_replicas", step, vote.divergent,
                                       {"dp_group": vote.ranks, "ambiguous": vote.ambiguous})
        return error

    # ---- results -----------------------------------------------------------------------------
    def close(self) -> None:
        """End of the attempt: drop an async checkpoint that could not be committed."""
        self.checkpointer.close()

    def full_state(self) -> dict[str, torch.Tensor]:
        with masters_in_place(self.optimizers):
            return full_state(list(self.parts), self.cfg.layout, self.dims.mesh)

    def digest(self) -> str:
        with masters_in_place(self.optimizers):
            return model_digest(list(self.parts), self.cfg.layout, self.dims.mesh)


def _as_transformer(module: nn.Module) -> Transformer:
    assert isinstance(module, Transformer), type(module)
    return module


def train(ctx: DistContext, cfg: RunConfig, hooks: TrainHooks | None = None, *, resume: bool = True,
          flops_per_token: float | None = None) -> TrainResult:
    """Run `cfg.steps` steps on this rank (see the module docstring); every rank of the job calls it."""
    hooks = hooks or TrainHooks()
    trainer = Trainer(ctx, cfg, hooks, flops_per_token)
    try:
        return _run(trainer, hooks, resume)
    except BaseException:
        _keep_for_peers(trainer, hooks)
        if trainer.links is not None:  # then free the peers blocked on this rank in a collective
            trainer.links.sever()
        raise
    finally:
        trainer.close()  # an async save still in flight after a failure dies with the attempt


def _keep_for_peers(trainer: Trainer, hooks: TrainHooks) -> None:
    """The attempt failed (a peer died, most often): keep this rank's state for a peer recovery when
    it is that of a whole step and its DP replicas can stand in for it (training.checkpoint.peer)."""
    if not hooks.keep_state_on_failure or trainer.updating or not peer.eligible(trainer.cfg):
        return
    try:
        hooks.keep_state(peer.capture(trainer))
    except Exception:  # the failure being raised matters more; the checkpoint path remains
        log.exception("could not keep the state of step %d for a peer recovery", trainer.step)


def _run(trainer: Trainer, hooks: TrainHooks, resume: bool) -> TrainResult:
    cfg, device = trainer.cfg, trainer.ctx.device
    plan = hooks.peer_plan
    if plan is not None:  # a DP peer's state, not a checkpoint: nothing is rolled back
        resumed = peer.restore_from_peers(trainer, plan, hooks.kept_state)
        hooks.kept_state = None  # the failed attempt's tensors are free once copied
    else:
        resumed = trainer.restore() if resume else None
    trainer.updating = False
    tokens_per_step = cfg.global_batch * cfg.model.seq_len
    losses: list[float] = []
    checkpoints: list[CheckpointInfo] = []
    last_saved = resumed if plan is None else None  # the peers' step has no checkpoint

    hooks.on_restore(resumed)

    def checkpoint() -> None:
        nonlocal last_saved
        hooks.on_checkpoint_start(trainer.step)
        for info in trainer.save():
            checkpoints.append(info)
            hooks.on_checkpoint(info.step, info.path, info.bytes, info.seconds)
        last_saved = trainer.step

    stopped = False
    for step in range(trainer.step + 1, cfg.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        probe_rerun(trainer, step, hooks.rerun_spikes)  # a restart's re-run of a spike: other devices too
        started = time.perf_counter()
        loss, positions = trainer.train_step(step)
        error = trainer.check_integrity(step, loss)
        elapsed = time.perf_counter() - started
        losses.append(loss)
        tps = tokens_per_step / elapsed
        utilisation = mfu(tps, trainer.flops_per_token, cfg.layout.world_size, trainer.peak)
        memory = trainer.memory.to_dict() if trainer.memory and not trainer.memory_reported else None
        trainer.memory_reported = trainer.memory is not None
        info = StepInfo(step, loss, tps, elapsed, utilisation, positions, trainer.timer.read(), memory=memory)
        action = hooks.on_step(info) or Action.CONTINUE
        want_ckpt, want_stop = _agree_on_step(trainer, hooks, step, action, error)
        val = cfg.data.validation
        if val is not None and trainer.val_source is not None and step % val.every_steps == 0:
            hooks.on_validation(step, evaluate(trainer, trainer.val_source, val.batches))
        every = cfg.checkpoint.every_steps
        if cfg.checkpoint.dir and (want_ckpt or (every and step % every == 0)):
            checkpoint()
        if step % 10 == 0 or step == cfg.steps:
            log.info("step %d loss %.4f %.0f tok/s", step, loss, tps)
        if want_stop:
            stopped = True
            log.info("stopping after step %d as asked", step)
            break
    if cfg.checkpoint.dir and not stopped and last_saved != trainer.step:
        checkpoint()
    if cfg.checkpoint.dir:
        pending = trainer.checkpointer.wait_pending()
        if pending is not None:
            checkpoints.append(pending)
            hooks.on_checkpoint(pending.step, pending.path, pending.bytes, pending.seconds)
    return TrainResult(final_step=trainer.step, losses=losses, model_digest=trainer.digest(),
                       checkpoints=checkpoints, resumed_from=resumed)


def _agree_on_step(trainer: Trainer, hooks: TrainHooks, step: int, action: Action,
                   error: IntegrityError | None) -> tuple[bool, bool]:
    """(checkpoint, stop) as every rank agrees after `step`; a failed integrity check anywhere is
    attributed (re-run from the snapshot when there is one) and shown to `hooks.on_integrity_error`."""
    device = trainer.ctx.device
    want_ckpt = action in (Action.CHECKPOINT, Action.CHECKPOINT_AND_STOP) or hooks.should_checkpoint(step)
    want_stop = action in (Action.STOP, Action.CHECKPOINT_AND_STOP)
    hooks.on_collective(step, "agree")
    want_ckpt, want_stop, failed = agree_flags([want_ckpt, want_stop, error is not None], device)
    if failed:
        shared, datas = attribute(trainer, step, error, hooks.rerun_spikes)
        if datas:  # the re-run step stands (the same on every rank)
            log.warning("gradient spike reproduced on the re-run, the data's: %s", shared)
            hooks.on_gradient_spike(shared)
            return want_ckpt, want_stop
        log.error("integrity check failed: %s", shared)
        reaction = hooks.on_integrity_error(shared) or Action.STOP
        want_stop = want_stop or agree_flags([reaction != Action.CONTINUE], device)[0]
    else:
        if step in (seen := hooks.rerun_spikes or {}):  # a restart's re-run (training.integrity.settle)
            hooks.on_gradient_rerun(step, *rerun_check(trainer, seen[step]))
        if trainer.fingerprint_ran or not trainer.replicas_comparable:
            trainer.verified_step = step  # also written into this step's checkpoint
            hooks.on_verified(step)
    return want_ckpt, want_stop
