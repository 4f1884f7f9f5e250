"""Every knob of Lattice, in one typed settings object (environment prefix `LATTICE_`).

Nothing else in the service reads `os.environ`: a knob that is not a field here does not
exist. `lattice serve --help` prints this list, so the documentation cannot drift from it.
Paths that are relative are taken relative to `home` (default `.lattice` in the working
directory), so one `LATTICE_HOME` moves the whole embedded deployment.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.checkpoint_period import LLAMA3_GPU_MTBF_HOURS

DEFAULT_HOME = Path(".lattice")
AUTO_API_WORKERS_MAX = 8  # api_workers=auto: past this, more replicas rather than more processes


class Settings(BaseSettings):
    """Configuration of the Lattice service and CLI; each field is `LATTICE_<FIELD>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="LATTICE_", extra="ignore", validate_default=True)

    home: Path = Field(
        DEFAULT_HOME,
        description="State directory of the embedded deployment (SQLite file, token, checkpoints).",
    )
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL of the store; unset = SQLite file <home>/lattice.db. "
        "Production: postgresql+psycopg://user@host:5432/db.",
    )
    ray_address: str | None = Field(
        None, description="Address of an existing Ray cluster; unset = start an embedded local cluster."
    )
    embedded_racks: int = Field(2, ge=1, description="Embedded cluster: simulated racks.")
    embedded_nodes_per_rack: int = Field(2, ge=1, description="Embedded cluster: simulated nodes per rack.")
    embedded_gpus_per_node: int = Field(4, ge=1, description="Embedded cluster: virtual GPUs per node.")
    gpu_type: str = Field(
        "cpu-virtual", description="GPU type the planner assumes for the cluster (a planner hardware preset)."
    )
    planner_feedback: bool = Field(
        True, description="A finished job without faults refines the compute efficiency of the hardware "
        "profile its plan used (a bounded step toward what it measured; docs/planner.md, "
        "\"Learning from jobs\")."
    )
    auto_calibrate: bool = Field(
        True, description="The leading scheduler calibrates each node type that has no hardware profile "
        "when its first node joins: a quick grid (seconds) as a Ray task on one GPU of that node, in the "
        "background, stored as the type's profile (docs/planner.md, \"Background calibration\").",
    )
    calibration_hold_s: float = Field(
        90.0, ge=0, le=3600,
        description="While a node type's first hardware profile is being measured, jobs for it stay pending "
        "up to this long, then are planned from the catalogue: a plan made before the profile is off by an "
        "order of magnitude on a CPU host, and a job started meanwhile would skew the measurement. 0: never "
        "wait. A job planned from the catalogue is re-planned with the profile while it has not started.",
    )
    checkpoint_root: Path | None = Field(
        None,
        description="Where job checkpoints go; unset = <home>/checkpoints. Shared storage in production.",
    )
    rank_log_max_bytes: int = Field(
        10 * 2**20, ge=4096, le=2**34,
        description="Each rank's log file per attempt "
        "(<checkpoint_root>/<job>/logs/attempt-<k>/rank-<r>.log) rotates at this size.",
    )
    rank_log_backups: int = Field(
        2, ge=0, le=20, description="Rotated files kept beside each rank's log (older output is dropped).",
    )
    host: str = Field("127.0.0.1", description="Interface `lattice serve` binds to.")
    port: int = Field(8000, ge=1, le=65535, description="Port `lattice serve` listens on.")
    auth_enabled: bool = Field(
        True, description="Require `Authorization: Bearer <token>`; false = every caller is admin (dev only)."
    )
    token_file: Path | None = Field(
        None,
        description="Where `lattice serve` stores the bootstrap admin token (mode 0600); "
        "unset = <home>/token.",
    )
    server: str | None = Field(
        None, description="CLI: URL of the Lattice server; unset = <home>/server, then http://<host>:<port>."
    )
    token: str | None = Field(None, description="CLI: bearer token; unset = the token file.")
    metrics_auth: bool = Field(
        False,
        description="/metrics needs `Authorization: Bearer <token>`: an admin token or the scrape token "
        "of LATTICE_METRICS_TOKEN_FILE (false = open, for the embedded mode on loopback).",
    )
    metrics_token_file: Path | None = Field(
        None,
        description="File holding the token Prometheus sends to /metrics (read on every scrape, so it "
        "can be rotated); unset = only admin tokens may scrape when LATTICE_METRICS_AUTH is true.",
    )
    migrate_on_start: bool = Field(
        True, description="`lattice serve` runs the database migrations (under a lock) before serving."
    )
    fault_injection: bool = Field(
        False, description="Act on the `faults` list of job specs (testing only; off in production)."
    )
    heartbeat_timeout_s: float = Field(
        10.0, gt=0, description="A rank silent for this long (or for 5 of the job's median step times, if "
        "longer) is treated as hung (default for job specs)."
    )
    gpu_mtbf_hours: float = Field(
        LLAMA3_GPU_MTBF_HOURS, gt=0, le=1e9, description="Mean GPU-hours between interruptions of a job, "
        "per GPU (Llama 3's pre-training: 50,676): with the plan, the checkpoint period of a job whose "
        "spec leaves checkpoint.every_steps out (service.checkpoint_period)."
    )
    checkpoint_write_gbps: float = Field(
        1.0, gt=0, le=1e6, description="GB/s at which one GPU's checkpoint shard is written (an "
        "assumption: a node's NVMe shared by its GPUs), for the same checkpoint period."
    )
    spares_per_job: int = Field(
        0, ge=0, le=64, description="Warm spare rank actors kept beside each running job, outside its "
        "placement (default for job specs' fault_tolerance.spares; docs/fault_tolerance.md, \"Hot spares\").",
    )
    warm_workers_per_node: int = Field(
        1, ge=0, le=8, description="Idle worker processes with torch and the engine imported kept on each "
        "node of a running job, for a replacement rank to start in without importing torch, and (without "
        "hot spares, for a job on several nodes) where its ranks would move if a node were lost (0: none; "
        "docs/fault_tolerance.md, \"Warm worker processes\").",
    )
    warm_standby: Literal["auto", "on", "off"] = Field(
        "auto", description="Also keep warm processes on the nodes a job's ranks would move to if one of its "
        "nodes were lost (its standby nodes). auto: on GPU node types only; where ranks compute on the "
        "host's own cores (cpu-virtual), each standby process's imports (~3-4 s of a core) are taken from "
        "the job's ranks in its first minute (docs/fault_tolerance.md, \"Warm worker processes\").",
    )
    scheduler_interval_s: float = Field(
        1.0, gt=0, description="Period of the scheduler/reconciler loop when nothing wakes it earlier."
    )
    role: Literal["all", "api", "scheduler"] = Field(
        "all", description="What `lattice serve` runs: all (API + scheduler), api (HTTP only, never touches "
        "Ray; several may run), scheduler (no HTTP; several may run, one elected leader acts).",
    )
    api_workers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto", description="Role api: HTTP worker processes behind one port (uvicorn's multi-process "
        "mode), each with its own database pool, load-shedding slots and planning pool; /metrics sums "
        f"the counters of all. auto: one per CPU the process may use (its affinity and cgroup quota), at "
        f"most {AUTO_API_WORKERS_MAX}. Roles all and scheduler run one (they hold Ray and the leader lease).",
    )
    scheduler_port: int | None = Field(
        None, ge=1, le=65535, description="Role scheduler: serve /healthz, /readyz and /metrics on this port "
        "(unset: no HTTP at all).",
    )
    leader_lease_s: float = Field(
        6.0, gt=0, description="Scheduler leader lease: a leader not renewing for this long is replaced.",
    )
    leader_renew_s: float = Field(
        2.0, gt=0, description="How often the scheduler leader renews its lease (below leader_lease_s).",
    )
    log_level: str = Field("info", description="Log level of the service (debug, info, warning, error).")
    data_root: Path | None = Field(
        None,
        description="Folder that holds the token files jobs may read (`data.path` is resolved inside it; "
        "created 0700 if missing); unset = <home>/data. Must not contain the service's own state.",
    )
    preempt_for_priority: bool = Field(
        True, description="A queued job that does not fit preempts running jobs of lower priority (they "
        "checkpoint at the next step and requeue, losing no step; docs/fault_tolerance.md); tenants' "
        "max_priority bounds who may. Off: it waits for them to end.",
    )
    reclaim_borrowed: bool = Field(
        True, description="A queued job within its tenant's GPU quota that does not fit preempts other "
        "tenants' jobs running on borrowed GPUs beyond their quotas, whatever their priority (lending is "
        "only safe if it can be taken back). Off: it waits for them to end.",
    )
    preempt_notice_dir: Path | None = Field(
        None,
        description="Where a node agent writes a cloud preemption notice (a file named after the node): the "
        "scheduler drains that node, its jobs checkpoint and move; unset = <home>/preempt.",
    )
    max_body_bytes: int = Field(
        1 << 20, ge=1024, description="Largest request body, checked before authentication (413 above)."
    )
    max_user_priority: int = Field(
        100, ge=-1000, le=1000, description="Highest job priority a non-admin may set, unless the tenant's "
        "own cap (tenants.max_priority) says otherwise; admins may set any priority.",
    )
    max_inflight_requests: int = Field(
        64, ge=0, description="Requests the API holds at once (running or waiting for a thread); past it "
        "503 with Retry-After at once. 0 = never shed (requests wait for an API slot without bound).",
    )
    api_threads: int = Field(
        4, ge=1, le=256, description="Requests an API process runs at once, each on a worker thread (a "
        "few more threads serve probes, streams and planning). Few keep the event loop, which admits and "
        "sheds, off the GIL's queue; the database pool holds a connection for each thread.",
    )
    max_queue_wait_ms: float = Field(
        200.0, gt=0, le=60_000, description="Bound on the wait for a free API slot: while the oldest "
        "waiting request has waited longer, new ones get 503 with Retry-After at once; one already queued "
        "gives up after 10 times this.",
    )
    rate_limit_per_s: float = Field(
        100.0, ge=0, description="Requests per second per token (per client address without one); "
        "over it 429 with Retry-After. 0 = off.",
    )
    rate_limit_burst: int = Field(
        200, ge=1, description="Requests a token may send at once before the rate applies."
    )
    plan_workers: int = Field(
        2, ge=1, le=64, description="Processes that run POST /v1/plans searches (a bounded pool: planning "
        "never holds the API's event loop or its threads).",
    )
    plan_cpu_budget_s: float = Field(
        2.0, gt=0, le=600, description="CPU seconds one plan search may use; over it 422 'search too large' "
        "naming the layout fields to pin.",
    )

    @model_validator(mode="after")
    def _resolve_paths(self) -> Settings:
        if self.database_url is None:
            self.database_url = f"sqlite:///{self.home / 'lattice.db'}"
        if self.checkpoint_root is None:
            self.checkpoint_root = self.home / "checkpoints"
        if self.token_file is None:
            self.token_file = self.home / "token"
        if self.data_root is None:
            self.data_root = self.home / "data"
        if self.preempt_notice_dir is None:
            self.preempt_notice_dir = self.home / "preempt"
        return self

    # Typed accessors (the validator above guarantees these are set).
    @property
    def db_url(self) -> str:
        assert self.database_url is not None
        return self.database_url

    @property
    def token_path(self) -> Path:
        assert self.token_file is not None
        return self.token_file

    @property
    def data_root_path(self) -> Path:
        assert self.data_root is not None
        return self.data_root

    @property
    def server_file(self) -> Path:
        """Where `lattice serve` records its URL for the CLI."""
        return self.home / "server"

    @property
    def embedded_num_gpus(self) -> int:
        return self.embedded_racks * self.embedded_nodes_per_rack * self.embedded_gpus_per_node

    def node_shape(self, gpu_type: str) -> tuple[int | None, int]:
        """(GPUs per node, nodes per rack) a plan for `gpu_type` assumes where it is not told: this
        cluster's own for its own GPU type (as its jobs are planned), else the planner's defaults (the
        catalogue's node size, 4 nodes a rack)."""
        if gpu_type.lower() == self.gpu_type.lower():
            return self.embedded_gpus_per_node, self.embedded_nodes_per_rack
        return None, 4

    @property
    def api_processes(self) -> int:
        """Worker processes `api_workers` names as it stands: auto is one until `lattice serve` resolves
        it (`api_worker_count`); an embedded Runtime serves in one process."""
        return self.api_workers if isinstance(self.api_workers, int) else 1

    def api_worker_count(self, role: str) -> int:
        """API worker processes `lattice serve` runs in `role`: `api_workers`, or for auto one per
        usable CPU (at most AUTO_API_WORKERS_MAX) in role api and one otherwise."""
        if isinstance(self.api_workers, int):
            return self.api_workers
        from service.cpus import usable_cpus

        return min(usable_cpus(), AUTO_API_WORKERS_MAX) if role == "api" else 1

    @property
    def api_thread_tokens(self) -> int:
        """anyio's thread limiter in an API process: a thread per slot, and spares for what holds no
        slot (probes, log streams, planning's profile read)."""
        return self.api_threads + 4

    @property
    def db_pool_size(self) -> int:
        """Connections each process keeps: one per API thread, and the scheduler's (role all)."""
        return self.api_thread_tokens + 4

    @property
    def is_sqlite(self) -> bool:
        return self.db_url.startswith("sqlite")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()


def describe_settings() -> list[tuple[str, str, str]]:
    """(environment variable, default, description) for every field, for `--help` and the README."""
    rows = []
    for name, field in Settings.model_fields.items():
        default = "unset" if field.default is None else str(field.default)
        rows.append((f"LATTICE_{name.upper()}", default, field.description or ""))
    return rows
