"""Every Prometheus metric Lattice exports, in one place.

Dashboards, alert rules and their tests read the names from here (see tests/deploy), so a
rename breaks a test rather than a dashboard. Labels are low-cardinality: per-job series
carry `job_id` and exist only while the job is active (`forget_job` removes them).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
JOB_STEP = Gauge("lattice_job_step", "Last completed optimizer step.", ["job_id"], registry=REGISTRY)
JOB_LOSS = Gauge("lattice_job_loss", "Training loss at the last step.", ["job_id"], registry=REGISTRY)
JOB_TOKENS_PER_S = Gauge(
    "lattice_job_tokens_per_second", "Training throughput.", ["job_id"], registry=REGISTRY
)
JOB_MFU = Gauge("lattice_job_mfu", "Measured model FLOPs utilisation.", ["job_id"], registry=REGISTRY)
JOB_MFU_PREDICTED = Gauge(
    "lattice_job_mfu_predicted", "The planner's predicted MFU.", ["job_id"], registry=REGISTRY
)
JOB_STEP_TIME = Histogram(
    "lattice_job_step_seconds",
    "Optimizer step wall time.",
    ["job_id"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
    registry=REGISTRY,
)
JOB_CHECKPOINT_SECONDS = Gauge(
    "lattice_job_checkpoint_seconds", "Duration of the last checkpoint save.", ["job_id"], registry=REGISTRY
)
JOB_CHECKPOINT_BYTES = Gauge(
    "lattice_job_checkpoint_bytes", "Size of the last checkpoint.", ["job_id"], registry=REGISTRY
)
JOB_RESTARTS = Counter(
    "lattice_job_restarts_total", "Job restarts, by cause.", ["job_id", "cause"], registry=REGISTRY
)
JOB_TIME_TO_DETECT = Histogram(
    "lattice_job_time_to_detect_seconds",
    "Fault to detection.",
    ["job_id"],
    buckets=_RECOVERY_BUCKETS,
    registry=REGISTRY,
)
JOB_TIME_TO_RECOVER = Histogram(
    "lattice_job_time_to_recover_seconds",
    "Detection to the first step after resume.",
    ["job_id"],
    buckets=_RECOVERY_BUCKETS,
    registry=REGISTRY,
)
JOB_STEPS_LOST = Counter(
    "lattice_job_steps_lost_total",
    "Steps computed and then thrown away by a restore.",
    ["job_id"],
    registry=REGISTRY,
)
JOB_GOODPUT = Gauge(
    "lattice_job_goodput_ratio", "Useful step time over wall time since start.", ["job_id"], registry=REGISTRY
)
JOB_SDC = Counter(
    "lattice_job_sdc_detections_total", "Silent data corruption detections.", ["job_id"], registry=REGISTRY
)

# ---- fleet-wide fault counters (survive the job) ---------------------------------------------
RESTARTS_BY_CAUSE = Counter(
    "lattice_restarts_total", "Job restarts across all jobs, by cause.", ["cause"], registry=REGISTRY
)
SDC_DETECTIONS = Counter("lattice_sdc_detections_total", "SDC detections across all jobs.", registry=REGISTRY)

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

PER_JOB_METRICS = (
    JOB_STEP,
    JOB_LOSS,
    JOB_TOKENS_PER_S,
    JOB_MFU,
    JOB_MFU_PREDICTED,
    JOB_STEP_TIME,
    JOB_CHECKPOINT_SECONDS,
    JOB_CHECKPOINT_BYTES,
    JOB_TIME_TO_DETECT,
    JOB_TIME_TO_RECOVER,
    JOB_STEPS_LOST,
    JOB_GOODPUT,
    JOB_SDC,
)


def forget_job(job_id: str) -> None:
    """Drop every per-job series of a job that ended, so label cardinality stays bounded."""
    for metric in PER_JOB_METRICS:
        try:
            metric.remove(job_id)
        except KeyError:
            pass
    for cause in list(_restart_causes(job_id)):
        JOB_RESTARTS.remove(job_id, cause)


def _restart_causes(job_id: str) -> set[str]:
    return {sample.labels["cause"] for family in JOB_RESTARTS.collect() for sample in family.samples
            if sample.labels.get("job_id") == job_id}


def metric_names() -> set[str]:
    """Every sample name this registry can expose (with _total/_bucket/... suffixes)."""
    names: set[str] = set()
    # prometheus_client has no public listing of the names a registry may expose (collect() skips
    # labelled metrics without series yet), so this reads its index.
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - no public equivalent
        names.update(REGISTRY._collector_to_names[collector])  # noqa: SLF001 - no public equivalent
    return names
