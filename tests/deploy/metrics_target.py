"""A stand-in scrape target: service.metrics.REGISTRY served by prometheus_client in its own process.

It fills every Lattice metric with plausible values (job "t" active on a 2-rack cluster), so that
Prometheus has real series to scrape before the job runner exists, without touching the metrics of
the test process. Started by the `metrics_target` fixture (conftest.py):

    python -m tests.deploy.metrics_target      # prints "PORT <n>", then reads commands on stdin:
    set-job <job_id> <step> <tokens_per_s>     # create or update a per-job series
    forget <job_id>                            # service.metrics.forget_job: the job ended
"""

from __future__ import annotations

import sys

from prometheus_client import start_http_server

from service import metrics as m

EXAMPLE_JOB = "t"
EXAMPLE_STEP = 3
EXAMPLE_TOKENS_PER_S = 1234.5


def set_job(job_id: str, step: int, tokens_per_s: float) -> None:
    m.name_job(job_id, f"{job_id}-name", "team-a")
    labels = m.job_labels(job_id)
    m.JOB_STEP.labels(*labels).set(step)
    m.JOB_TOKENS_PER_S.labels(*labels).set(tokens_per_s)
    m.JOB_LOSS.labels(*labels).set(4.2)
    m.JOB_MFU.labels(*labels).set(0.31)
    m.JOB_MFU_PREDICTED.labels(*labels).set(0.35)
    m.JOB_STEP_TIME.labels(*labels).observe(0.2)
    m.JOB_CHECKPOINT_SECONDS.labels(*labels).set(1.5)
    m.JOB_CHECKPOINT_BYTES.labels(*labels).set(2.5e8)
    m.JOB_RESTARTS.labels(*labels, "rank_died").inc()
    m.JOB_TIME_TO_DETECT.labels(*labels).observe(3.0)
    m.JOB_TIME_TO_RECOVER.labels(*labels).observe(12.0)
    m.JOB_STEPS_LOST.labels(*labels).inc(2)
    m.JOB_GOODPUT.labels(*labels).set(0.9)
    for part, seconds in (("useful", 90.0), ("startup", 5.0), ("queued", 2.0), ("restarting", 0.0),
                          ("lost", 2.0), ("checkpoint", 1.0)):
        m.JOB_GOODPUT_SECONDS.labels(*labels, part).set(seconds)
    m.JOB_SDC.labels(*labels)  # exists at 0 while the job is active


def fill_cluster() -> None:
    for state, count in (("running", 1), ("queued", 2), ("succeeded", 5)):
        m.JOBS_BY_STATE.labels(state).set(count)
    m.QUEUE_DEPTH.set(2)
    m.QUEUE_WAIT.observe(4.0)
    m.HTTP_REQUESTS.labels("/v1/jobs", "GET", "200").inc(10)
    m.HTTP_REQUESTS.labels("/v1/jobs", "POST", "500").inc()
    m.HTTP_LATENCY.labels("/v1/jobs", "GET").observe(0.02)
    m.RESTARTS_BY_CAUSE.labels("rank_died").inc()
    nodes = (
        ("n1", "r1", "ready"),
        ("n2", "r1", "ready"),
        ("n3", "r2", "suspect"),
        ("n4", "r2", "quarantined"),
    )
    for node, rack, health in nodes:
        m.GPUS_TOTAL.labels(node, rack).set(4)
        m.GPUS_FREE.labels(node, rack).set(0 if health == "quarantined" else 2)
        for state in ("ready", "suspect", "quarantined", "dead"):
            m.NODE_HEALTH.labels(node, rack, state).set(1 if state == health else 0)
    m.NODES_QUARANTINED.set(1)


def main() -> None:
    fill_cluster()
    set_job(EXAMPLE_JOB, EXAMPLE_STEP, EXAMPLE_TOKENS_PER_S)
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=m.REGISTRY)
    print(f"PORT {server.server_port}", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "set-job" and len(words) == 4:
            set_job(words[1], int(words[2]), float(words[3]))
        elif words[0] == "forget" and len(words) == 2:
            m.forget_job(words[1])
        elif words[0] == "quit":
            break
        else:
            print(f"ERROR unknown command {line.strip()!r}", flush=True)
            continue
        print("OK", flush=True)
    server.shutdown()


if __name__ == "__main__":
    main()
