"""One training rank as a Ray actor (one per GPU, `num_gpus=1`, inside its placement bundle).

The actor says where it really runs (`where()`: node id, rack and node-name labels, the GPU id
Ray gave it), offers the rendezvous address when it is rank 0, then runs
`training.train.train(ctx, run_cfg, hooks, resume=...)` in a background thread so that the
controller can `poll()` it while it trains. Hooks (workers.rank_hooks) push events (steps,
checkpoints, integrity errors, the result) into an in-actor buffer; `poll()` drains it and reports a
heartbeat: seconds since the training thread last made progress, measured on the actor's own
monotonic clock.

Fault injection (`schedule_fault`, specs in workers.faults): kill_rank, hang_rank
and slow_rank act from the step hook (or, with phase "checkpoint", when a save begins); bit flips
go through the engine's injector (`RankActor.injector`). Before a kill the actor tells its job's
controller (`JobController.report`), since its own event buffer dies with it.

The actor outlives a failed attempt: `reset()` waits for its training thread to end and
`start()` may then run again with a new rendezvous (the controller's fast path keeps healthy
ranks' processes and replaces only the dead ones).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

from workers import engine_imports
from workers.collective_trace import dump_path, watchdog_prefix
from workers.engine_imports import PIPELINE_MODULES, import_callable, warm_imports
from workers.events import EventKind, FaultReport, plain, rank_event
from workers.logs import LogTarget, capture_rank_output
from workers.names import NAMESPACE, controller_name
from workers.rank_hooks import make_hooks

log = logging.getLogger(__name__)

DEFAULT_TRAIN_FN = "training.train:train"
MAX_BUFFERED_EVENTS = 10_000
MAX_TRACEBACK_CHARS = 8192  # the end of a failed rank's traceback that travels to the job's status
RANK_FAULT_KINDS = ("kill_rank", "hang_rank", "slow_rank", "bitflip", "kill_node", "corrupt_checkpoint")
ACTIONS = ("checkpoint", "stop", "checkpoint_and_stop")


def exception_report(e: BaseException, step: int | None) -> dict[str, Any]:
    """What the controller classifies a rank's exception by (workers.controller.classify): its
    message, type names (the class and its bases), the file that raised it, the step, and the
    formatted traceback (its last MAX_TRACEBACK_CHARS)."""
    frames = traceback.extract_tb(e.__traceback__)
    return {"error": f"{type(e).__name__}: {e}"[:2000],
            "error_types": [c.__name__ for c in type(e).__mro__ if c not in (BaseException, object)],
            "origin": frames[-1].filename if frames else None, "step": step,
            "traceback": "".join(traceback.format_exception(e))[-MAX_TRACEBACK_CHARS:]}


class RankActor:
    """Wrapped with `ray.remote` by the worker group (resources come from its bundle)."""

    def __init__(self, job_id: str, rank: int, world_size: int, coord: dict[str, int] | None = None) -> None:
        # The job's environment (ControllerOptions.env_vars, OMP_NUM_THREADS) comes in the actor's
        # runtime env (workers.warm_workers.rank_runtime_env), set before the process imports torch.
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.coord = dict(coord or {})
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._dropped = 0
        self._state = "idle"
        self._result: dict[str, Any] | None = None
        self._error: str | None = None
        self._last_progress = time.monotonic()
        self._stepped = False
        self._step: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._faults: list[dict[str, Any]] = []
        self._slow_s = 0.0
        self._action: str | None = None
        # The engine's bit-flip injector for this rank (bitflip faults), handed to the engine.
        self.injector: Any = None
        self._flips_reported = 0
        self.restore_steps: set[int] | None = None  # the checkpoints this attempt may restore
        self.rerun_spikes: dict[int, Mapping[int, float]] = {}  # spikes this attempt re-runs
        self._controller_handle: Any = None
        self._attempts = 0
        self._log_target: LogTarget | None = None
        self._job_dir: str | None = None  # where the flight recorder is dumped (workers.collective_trace)
        self._backend = "gloo"
        self.kept_state: Any = None  # a failed attempt's state for a peer recovery (training.checkpoint.peer)
        self.peer_request: dict[str, Any] | None = None  # this attempt's peer recovery plan, if any
        self.ready_at = time.time()  # up and imported (a hot spare's age, a replacement's warm-up)
        # A replacement rank imports the engine while its peers reset; a hot spare is warm only
        # once this is done (`ready`): seconds of imports otherwise land on the recovery path.
        engine_imports.claim()  # a warm process's own preload, if still running, at full priority now
        self._imports = warm_imports(on_done=self._imported)

    def _imported(self) -> None:
        self.ready_at = time.time()

    # ---- where am I -------------------------------------------------------------------------
    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        labels = ctx.get_node_labels() or {}
        gpu_ids = ray.get_gpu_ids()
        node_id = ctx.get_node_id()
        return {
            "rank": self.rank,
            "node_id": node_id,
            "node_name": str(labels.get("node_name") or f"{socket.gethostname()}-{node_id[:8]}"),
            "rack": str(labels.get("rack") or "default"),
            # Ray's ids are indices unless CUDA_VISIBLE_DEVICES names GPUs by UUID.
            "gpu": int(gpu_ids[0]) if gpu_ids and str(gpu_ids[0]).isdigit() else -1,
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }

    def ready(self) -> dict[str, Any]:
        """`where`, once the engine's imports are done (workers.spares counts a spare warm then),
        the pipeline engine's too: a spare may replace a rank of any layout."""
        self._imports.join()
        for name in PIPELINE_MODULES:
            importlib.import_module(name)
        return self.where()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port on it, for every rank's init_process_group."""
        import ray

        from training.parallel.dist import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def ping(self) -> bool:
        return True

    def replay(self, cfg_dict: dict[str, Any], snapshot: str) -> dict[str, Any]:
        """As the SDC referee (a warm spare, workers.referee): replay one DP step alone from the
        replicas' pre-step snapshot; its parameter fingerprint (training.integrity.referee)."""
        import torch

        from training.config.run import RunConfig
        from training.integrity.referee import replay_step

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        return replay_step(RunConfig.from_dict(cfg_dict), snapshot)

    def warm_since(self) -> float:  # when this actor was up with its imports done (wall clock)
        return self.ready_at

    def process_since(self) -> float | None:
        """When this actor's worker process was created (workers.warm_workers: a warm process was
        created before the actor was asked for); None: a process that did not run the hook."""
        return engine_imports.process_started_at

    def assign(self, rank: int, world_size: int, coord: dict[str, int] | None = None) -> None:
        """Make this idle hot spare (created as rank -1, workers.spares) rank `rank` of `world_size`."""
        if self._thread is not None:
            raise RuntimeError(f"rank {self.rank} already trained: only an idle spare can be assigned")
        self.rank, self.world_size, self.coord = int(rank), int(world_size), dict(coord or {})

    # ---- training -----------------------------------------------------------------------------
    def start(
        self,
        master_addr: str,
        master_port: int,
        run_cfg: Any,
        *,
        resume: bool = True,
        train_fn: str = DEFAULT_TRAIN_FN,
        flops_per_token: float | None = None,
        rendezvous_timeout_s: float = 120.0,
        restore_steps: list[int] | None = None,
        log_target: LogTarget | None = None,
        collective_timeout_s: float | None = None,
        peer: Mapping[str, Any] | None = None,
        rerun_spikes: Mapping[int, Mapping[int, float]] | None = None,
    ) -> None:
        """Train in a background thread. `restore_steps`: the checkpoints it may resume from
        (the verified ones; None = any valid one); `log_target`: the attempt's log folder (this
        rank's output goes to its file there); `collective_timeout_s`: the process group's timeout
        (rendezvous and every collective; default `rendezvous_timeout_s`); `peer`: a peer recovery
        ({"step", "sources": {lost rank: survivor}}, workers.recovery_path) instead of a checkpoint
        restore; `rerun_spikes`: training.hooks.TrainHooks.rerun_spikes. May run again after `reset()`."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"rank {self.rank} is still training")
        self.peer_request = dict(peer) if peer is not None else None
        if peer is None:
            self.kept_state = None  # a checkpoint restore: the kept state is of no use
        self.restore_steps = None if restore_steps is None else set(restore_steps)
        self.rerun_spikes = dict(rerun_spikes or {})
        self._attempts += 1
        with self._lock:
            self._state = "running"
            self._result = None
            self._error = None
            self._stepped = False
            self._step = None
            self._last_progress = time.monotonic()
        self._log_target = log_target
        self._thread = threading.Thread(
            target=self._run_captured,
            args=(master_addr, master_port, run_cfg, resume, train_fn, flops_per_token,
                  max(rendezvous_timeout_s, collective_timeout_s or 0.0)),
            name=f"lattice-rank-{self.rank}",
            daemon=True,
        )
        self._thread.start()

    def _run_captured(self, *args: Any) -> None:
        with capture_rank_output(self._log_target, self.rank):
            self._run(*args)

    def _run(
        self,
        master_addr: str,
        master_port: int,
        run_cfg: Any,
        resume: bool,
        train_fn: str,
        flops_per_token: float | None,
        timeout_s: float,
    ) -> None:
        os.environ.update(
            {
                "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0",
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            }
        )
        try:
            import torch

            from training.parallel.dist import init_distributed, shutdown

            if not torch.cuda.is_available():
                torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
            fn = import_callable(train_fn)
            job_dir = getattr(getattr(run_cfg, "checkpoint", None), "dir", None)
            self._job_dir = job_dir
            ctx = init_distributed(self.rank, self.world_size, master_addr, master_port, timeout_s=timeout_s,
                                   trace_prefix=watchdog_prefix(job_dir) if job_dir else None)
            self._backend = ctx.backend
            self.record(EventKind.STARTED, {"backend": ctx.backend, "device": str(ctx.device)})
            try:
                result = fn(ctx, run_cfg, make_hooks(self), resume=resume, flops_per_token=flops_per_token)
            finally:
                shutdown()
            value = plain(result)
            with self._lock:
                self._result = value if isinstance(value, dict) else {"value": value}
                self._state = "finished"
            self.record(EventKind.FINISHED, {"final_step": self._result.get("final_step")})
        except BaseException as e:  # a rank's failure is reported (and logged), not raised
            log.warning("rank %d failed: %s", self.rank, e, exc_info=e)  # the traceback goes to its log
            report = exception_report(e, self._step)
            # The report first: a poll that sees the rank failed has its traceback too.
            self.record(EventKind.FAILED, report)
            with self._lock:
                self._error = report["error"]
                self._state = "failed"

    def record(self, kind: EventKind, data: Mapping[str, Any]) -> None:
        """Buffer an event for the controller's next poll (it also counts as progress)."""
        event = rank_event(kind, self.rank, time.time(), data)
        with self._lock:
            self._last_progress = time.monotonic()
            if kind == EventKind.STEP:
                self._stepped = True
                step = data.get("step")
                if isinstance(step, int):
                    self._step = step
            self._events.append(event)
            if len(self._events) > MAX_BUFFERED_EVENTS:
                self._events.pop(0)
                self._dropped += 1

    def after_step(self, step: Any, phase: str = "step") -> None:
        """Run the faults due at this step: after the step's hook (phase
        "step") or when a checkpoint save begins (phase "checkpoint")."""
        if self._slow_s > 0 and phase == "step":
            time.sleep(self._slow_s)
        if not isinstance(step, int):
            return
        due = [f for f in self._faults if f["at_step"] <= step and f.get("phase", "step") == phase
               and f["kind"] not in ("bitflip", "corrupt_checkpoint")]
        for fault in due:
            self._faults.remove(fault)
            if fault["kind"] == "kill_rank":
                self._controller()  # look it up first: the fault's time is the death, not the lookup
            info = FaultReport(fault=fault["kind"], step=step, phase=phase, t_fault=time.time())
            if fault["kind"] == "kill_node":  # the controller removes the node (ours dies with it)
                self._trigger({**fault, "step": step, "phase": phase})
            elif fault["kind"] == "kill_rank":
                self.record(EventKind.FAULT_INJECTED, info)
                self._tell_controller(EventKind.FAULT_INJECTED, info)
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault["kind"] == "hang_rank":
                self.record(EventKind.FAULT_INJECTED, info)
                while not self._stop.is_set():
                    time.sleep(0.05)
            elif fault["kind"] == "slow_rank":
                self._slow_s = float(fault.get("seconds", 1.0))
                self.record(EventKind.FAULT_INJECTED, {**info, "seconds": self._slow_s})

    def after_commit(self, step: int, path: str) -> None:
        """corrupt_checkpoint: the controller damages the first checkpoint committed at or after
        the fault's step."""
        for fault in [f for f in self._faults if f["kind"] == "corrupt_checkpoint" and f["at_step"] <= step]:
            self._faults.remove(fault)
            self._trigger({**fault, "step": step, "path": path})

    def _trigger(self, fault: dict[str, Any]) -> None:
        try:
            import ray

            handle = ray.get_actor(controller_name(self.job_id), namespace=NAMESPACE)
            ray.get(handle.trigger.remote(self.rank, fault), timeout=60.0)
        except Exception as e:  # noqa: BLE001 - any failure of the Ray call is reported; training goes on
            log.warning("rank %d: %s fault could not be carried out: %s", self.rank, fault.get("kind"), e)
            self.record(EventKind.FAULT_FAILED, {"fault": fault.get("kind"), "error": str(e)[:500]})

    def report_flips(self, step: Any) -> None:
        """Bit flips the engine applied since the last step (they fire inside the step)."""
        applied = list(getattr(self.injector, "applied", []) or [])
        for flip in applied[self._flips_reported:]:
            self.record(EventKind.FAULT_INJECTED, FaultReport(
                fault="bitflip", step=flip.step, phase="step", t_fault=time.time(), target=flip.target,
                name=flip.name, index=flip.index, bit=flip.bit))
        self._flips_reported = len(applied)

    def _controller(self) -> Any:
        """This job's controller actor (looked up once), or None without one."""
        if self._controller_handle is None:
            try:
                import ray

                self._controller_handle = ray.get_actor(controller_name(self.job_id), namespace=NAMESPACE)
            except Exception as e:  # noqa: BLE001 - no controller (a bare group in a test)
                log.debug("rank %d: no controller: %s", self.rank, e)
                return None
        return self._controller_handle

    def _tell_controller(self, kind: EventKind, data: Mapping[str, Any]) -> None:
        """Deliver an event that must outlive this process (best effort, bounded wait)."""
        try:
            import ray

            handle = self._controller()
            if handle is None:
                return
            event = rank_event(kind, self.rank, time.time(), data)
            ray.get(handle.report.remote(self.rank, event), timeout=5.0)
        except Exception as e:  # noqa: BLE001 - no controller (a bare group in a test), or it is gone
            log.debug("rank %d: could not report %s to the controller: %s", self.rank, kind, e)

    def request_action(self, action: str) -> None:
        """Ask the engine, at the next step boundary, to 'checkpoint', 'stop' or
        'checkpoint_and_stop' (the engine ORs the request over all ranks)."""
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {', '.join(ACTIONS)}, got {action!r}")
        with self._lock:
            self._action = action

    def take_action(self) -> str | None:
        """The action requested since the last step, if any (taken once)."""
        with self._lock:
            action, self._action = self._action, None
        return action

    def schedule_fault(self, kind: str, at_step: int, **params: Any) -> None:
        if kind not in RANK_FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(RANK_FAULT_KINDS)}, got {kind!r}")
        fault = {"kind": kind, "at_step": int(at_step), **params}
        if kind == "bitflip":
            from training.integrity.injection import BitFlip, BitFlipInjector

            flip = BitFlip(step=max(int(at_step), 1), rank=self.rank, target=params.get("target", "param"),
                           name=params.get("name", "layers.0.attention.wq.weight"),
                           index=int(params.get("index", 0)), bit=int(params.get("bit", 30)),
                           persistent=bool(params.get("persistent", False)))
            if self.injector is None:
                self.injector = BitFlipInjector([], self.rank)
            self.injector.flips.append(flip)
        self._faults.append(fault)

    def reset(self, timeout_s: float = 10.0) -> bool:
        """Wait for the training thread of the last attempt to end (it fails once a peer is gone)
        and clear its state, so that `start()` can run again. False if it is still running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                return False
        # A save in flight when the attempt failed died with the attempt's Checkpointer (train()
        # closes it), so nothing carries over into the next start.
        with self._lock:
            self._state = "idle"
            self._events = [e for e in self._events if e["kind"] == EventKind.FAULT_INJECTED]
        self._thread = None
        self._stop.clear()
        return True

    def kept(self) -> int | None:
        """The step whose state the last (failed) attempt kept in memory for a peer recovery."""
        kept = self.kept_state
        return None if kept is None else int(kept.step)

    # ---- what the controller reads ------------------------------------------------------------
    def poll(self) -> dict[str, Any]:
        with self._lock:
            events, self._events = self._events, []
            dropped, self._dropped = self._dropped, 0
            return {
                "rank": self.rank,
                "state": self._state,
                "events": events,
                "dropped": dropped,
                "since_progress_s": time.monotonic() - self._last_progress,
                "stepped": self._stepped,
                "step": self._step,
                "result": self._result,
                "error": self._error,
            }

    def dump_collectives(self) -> str | None:
        """Write this rank's flight recorder (its recent collectives) into the job's folder; the file
        or None (no job folder, no process group yet, or no flight recorder in this torch)."""
        if self._job_dir is None:
            return None
        from training.parallel.dist import dump_flight_recorder

        return dump_flight_recorder(dump_path(self._job_dir, self.rank), self._backend)

    def stop(self) -> None:
        """Release a hung hook; the process itself is ended by the worker group (ray.kill)."""
        self._stop.set()
