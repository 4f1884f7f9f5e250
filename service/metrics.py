"""Every Prometheus metric Lattice exports, in one place.

Dashboards, alert rules and their tests read the names from here (see tests/deploy), so a
rename breaks a test rather than a dashboard. Labels are low-cardinality: per-job series
carry `job_id`, `job_name` and `tenant` (one set of values per job: `job_labels`) and exist only
while the job is active (`forget_job` removes them).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from workers.policies import FailureKind

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_RECOVERY_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)

# ---- service -----------------------------------------------------------------------------
HTTP_REQUESTS = Counter(
    "lattice_http_requests_total",
    "HTTP requests served, by route template, method and status.",
    ["route", "method", "status"],
    registry=REGISTRY,
)
HTTP_LATENCY = Histogram(
    "lattice_http_request_duration_seconds",
    "HTTP request latency, by route template and method.",
    ["route", "method"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)

# ---- jobs --------------------------------------------------------------------------------
JOBS_BY_STATE = Gauge("lattice_jobs", "Jobs in the store, by state.", ["state"], registry=REGISTRY)
QUEUE_DEPTH = Gauge(
    "lattice_queue_depth", "Jobs waiting for capacity (pending or queued).", registry=REGISTRY
)
QUEUE_WAIT = Histogram(
    "lattice_queue_wait_seconds",
    "Time from submit to start of a job.",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600),
    registry=REGISTRY,
)

# ---- per active job ------------------------------------------------------------------------
# The job's id, its name and its tenant: a job's name and tenant never change, so these add no series.
JOB_LABELS = ("job_id", "job_name", "tenant")
JOB_STEP = Gauge("lattice_job_step", "Last completed optimizer step.", JOB_LABELS, registry=REGISTRY)
JOB_LOSS = Gauge("lattice_job_loss", "Training loss at the last step.", JOB_LABELS, registry=REGISTRY)
JOB_VAL_LOSS = Gauge(
    "lattice_job_val_loss", "Loss on the held-out split at its last evaluation.", JOB_LABELS,
    registry=REGISTRY,
)
JOB_TOKENS_PER_S = Gauge(
    "lattice_job_tokens_per_second", "Training throughput.", JOB_LABELS, registry=REGISTRY
)
JOB_MFU = Gauge("lattice_job_mfu", "Measured model FLOPs utilisation.", JOB_LABELS, registry=REGISTRY)
JOB_MFU_PREDICTED = Gauge(
    "lattice_job_mfu_predicted", "The planner's predicted MFU.", JOB_LABELS, registry=REGISTRY
)
JOB_STEP_TIME = Histogram(
    "lattice_job_step_seconds",
    "Optimizer step wall time.",
    JOB_LABELS,
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
    registry=REGISTRY,
)
JOB_STEP_TIME_PREDICTED = Gauge(
    "lattice_job_step_seconds_predicted", "The planner's predicted step time.", JOB_LABELS, registry=REGISTRY
)
JOB_STEP_TIME_MEDIAN = Gauge(
    "lattice_job_step_seconds_median", "Median measured step time after warm-up (the ranks' timers).",
    JOB_LABELS, registry=REGISTRY,
)
JOB_CHECKPOINT_SECONDS = Gauge(
    "lattice_job_checkpoint_seconds", "Duration of the last checkpoint save.", JOB_LABELS, registry=REGISTRY
)
JOB_CHECKPOINT_BYTES = Gauge(
    "lattice_job_checkpoint_bytes", "Size of the last checkpoint.", JOB_LABELS, registry=REGISTRY
)
JOB_RESTARTS = Counter(
    "lattice_job_restarts_total", "Job restarts, by cause.", [*JOB_LABELS, "cause"], registry=REGISTRY
)
JOB_TIME_TO_DETECT = Histogram(
    "lattice_job_time_to_detect_seconds",
    "Fault to detection.",
    JOB_LABELS,
    buckets=_RECOVERY_BUCKETS,
    registry=REGISTRY,
)
JOB_TIME_TO_RECOVER = Histogram(
    "lattice_job_time_to_recover_seconds",
    "Detection to the first step after resume.",
    JOB_LABELS,
    buckets=_RECOVERY_BUCKETS,
    registry=REGISTRY,
)
JOB_STEPS_LOST = Counter(
    "lattice_job_steps_lost_total",
    "Steps computed and then thrown away by a restore.",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_STEPS_LOST_PER_FAULT = Histogram(
    "lattice_job_steps_lost_per_fault",
    "Steps thrown away by each restore (0 on the peer path).",
    JOB_LABELS,
    buckets=(0, 1, 2, 5, 10, 20, 50, 100, 500, 1000),
    registry=REGISTRY,
)
JOB_RECOVERIES = Counter(
    "lattice_job_recoveries_total",
    "Recoveries by path: peer (the DP peers' memory, no rollback), checkpoint (fast path or full "
    "restart from the verified checkpoint), replan (a new layout for the capacity left or returned).",
    [*JOB_LABELS, "path"],
    registry=REGISTRY,
)
JOB_GOODPUT = Gauge(
    "lattice_job_goodput_ratio",
    "Useful step time over the time since the first step (queue and start-up are their own parts).",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_GOODPUT_SECONDS = Gauge(
    "lattice_job_goodput_seconds",
    "Where the job's wall time since submission went, by part (useful, startup, queued, restarting, "
    "lost, checkpoint); the parts add up to the wall time.",
    [*JOB_LABELS, "part"],
    registry=REGISTRY,
)
JOB_SDC = Counter(
    "lattice_job_sdc_detections_total", "Silent data corruption detections.", JOB_LABELS, registry=REGISTRY
)
JOB_SPARES = Gauge(
    "lattice_spares", "Hot spare rank actors kept beside the job (workers.spares), by state.",
    [*JOB_LABELS, "state"], registry=REGISTRY,
)
JOB_SPARE_AGE = Gauge(
    "lattice_spare_age_seconds", "Age of the job's oldest hot spare (0: none).", JOB_LABELS, registry=REGISTRY
)
JOB_WARM_PROCESSES = Gauge(
    "lattice_warm_processes",
    "Idle worker processes with the engine imported kept for the job's replacement ranks "
    "(workers.warm_workers), as last counted.",
    JOB_LABELS, registry=REGISTRY,
)
JOB_REPLACEMENT_SECONDS = Histogram(
    "lattice_job_replacement_seconds",
    "Time from asking for a replacement rank to a warm actor (imports done), by whether a spare was used.",
    [*JOB_LABELS, "spare"],
    buckets=_RECOVERY_BUCKETS,
    registry=REGISTRY,
)

# ---- fleet-wide fault counters (survive the job) ---------------------------------------------
RESTARTS_BY_CAUSE = Counter(
    "lattice_restarts_total", "Job restarts across all jobs, by cause.", ["cause"], registry=REGISTRY
)
SDC_DETECTIONS = Counter("lattice_sdc_detections_total", "SDC detections across all jobs.", registry=REGISTRY)
PREEMPTIONS = Counter(
    "lattice_preemptions_total", "Jobs stopped by a preemption notice and returned to the queue.",
    registry=REGISTRY,
)
STEPS_LOST_TO_PREEMPTION = Counter(
    "lattice_steps_lost_to_preemption_total",
    "Steps after the last verified checkpoint thrown away by preemptions past their grace period.",
    registry=REGISTRY,
)

# ---- cluster -------------------------------------------------------------------------------
GPUS_TOTAL = Gauge("lattice_cluster_gpus_total", "GPUs per node.", ["node", "rack"], registry=REGISTRY)
GPUS_FREE = Gauge("lattice_cluster_gpus_free", "Free GPUs per node.", ["node", "rack"], registry=REGISTRY)
NODE_HEALTH = Gauge(
    "lattice_node_health",
    "1 for the node's current health state, by state.",
    ["node", "rack", "state"],
    registry=REGISTRY,
)
NODES_QUARANTINED = Gauge("lattice_nodes_quarantined", "Nodes in quarantine.", registry=REGISTRY)
SCHEDULER_LEADER = Gauge(
    "lattice_scheduler_leader",
    "1 while this process is the elected scheduler leader (it acts), else 0 (a standby or an API replica).",
    registry=REGISTRY,
)

PER_JOB_METRICS = (
    JOB_STEP,
    JOB_LOSS,
    JOB_VAL_LOSS,
    JOB_TOKENS_PER_S,
    JOB_MFU,
    JOB_MFU_PREDICTED,
    JOB_STEP_TIME,
    JOB_STEP_TIME_PREDICTED,
    JOB_STEP_TIME_MEDIAN,
    JOB_CHECKPOINT_SECONDS,
    JOB_CHECKPOINT_BYTES,
    JOB_RESTARTS,
    JOB_TIME_TO_DETECT,
    JOB_TIME_TO_RECOVER,
    JOB_STEPS_LOST,
    JOB_STEPS_LOST_PER_FAULT,
    JOB_RECOVERIES,
    JOB_GOODPUT,
    JOB_GOODPUT_SECONDS,
    JOB_SDC,
    JOB_SPARES,
    JOB_SPARE_AGE,
    JOB_WARM_PROCESSES,
    JOB_REPLACEMENT_SECONDS,
)
# Restart causes (the failure kinds and "unknown"): each job's restart series, and the fleet's, start at
# 0 for every cause, so that increase() counts the first restart.
RESTART_CAUSES = (*(kind.value for kind in FailureKind), "unknown")
for _cause in RESTART_CAUSES:
    RESTARTS_BY_CAUSE.labels(_cause)

_JOB_NAMES: dict[str, tuple[str, str]] = {}


def name_job(job_id: str, job_name: str, tenant: str) -> None:
    """Remember a job's name and tenant for its series (the scheduler calls it on every snapshot)."""
    if _JOB_NAMES.get(job_id) != (job_name, tenant):
        forget_job(job_id)  # series made before the name was known would be duplicates
        _JOB_NAMES[job_id] = (job_name, tenant)
        for cause in RESTART_CAUSES:
            JOB_RESTARTS.labels(*job_labels(job_id), cause)


def job_labels(job_id: str) -> tuple[str, str, str]:
    """The label values of a job's series: (job_id, job_name, tenant); name and tenant empty for a
    job the scheduler has not named."""
    return (job_id, *_JOB_NAMES.get(job_id, ("", "")))


def forget_job(job_id: str) -> None:
    """Drop every per-job series of a job that ended, so label cardinality stays bounded."""
    _JOB_NAMES.pop(job_id, None)
    for metric in PER_JOB_METRICS:
        for values in _series_of(metric, job_id):
            try:
                metric.remove(*values)
            except KeyError:
                pass


def _series_of(metric: Gauge | Counter | Histogram, job_id: str) -> set[tuple[str, ...]]:
    names = metric._labelnames  # noqa: SLF001 - prometheus_client has no public listing of a metric's labels
    return {tuple(sample.labels[n] for n in names) for family in metric.collect() for sample in family.samples
            if sample.labels.get("job_id") == job_id and all(n in sample.labels for n in names)}


def metric_names() -> set[str]:
    """Every sample name this registry can expose (with _total/_bucket/... suffixes)."""
    names: set[str] = set()
    # prometheus_client has no public listing of the names a registry may expose (collect() skips
    # labelled metrics without series yet), so this reads its index.
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - no public equivalent
        names.update(REGISTRY._collector_to_names[collector])  # noqa: SLF001 - no public equivalent
    return names
