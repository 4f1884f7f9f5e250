"""The scheduler and reconciler: the service's one writer of job progress and cluster state.

`loop.Scheduler` runs `tick()` in one thread every `settings.scheduler_interval_s` (sooner when the
API calls `wake()`). A tick:

1. polls every attached job controller (through `workers.client`) and writes what it reports into
   the store in one short transaction per job (`ingest`): the controller's events (append-only, in
   order, each once: the job row keeps the last controller seq stored), progress, the placement
   read back from the rank actors, checkpoint rows, node faults, and the job's state, moved only
   along legal edges; a terminal controller is collected and ended;
2. syncs the nodes table with the live cluster and reads the health ledger back (`cluster`);
3. admits pending jobs, re-planning those planned for another GPU type (`admission`);
4. starts queued jobs in the order `fairshare.decide` gives (tenants' GPU quotas and borrowing, the
   tenant furthest below its weighted share first, then priority, then age; backfill that does not
   delay the head of the line) when their layout fits the free capacity; a job that waits stays
   queued with the reason as an event (once per distinct reason: "quota: 8 of 8 GPUs in use");
5. updates the Prometheus metrics (`observer`);
6. starts, in the background, the calibration of each node type without a hardware profile
   (`autocalibrate`, LATTICE_AUTO_CALIBRATE).

Cancel is the API's `transition(... cancelled)` followed by `cancel(job_id)`: the next tick asks
the controller to tear down its ranks and placement group. `start()` reconciles first
(`reconcile`): an active job whose detached controller is alive is re-attached; one whose
controller is gone is recovered by a new controller that resumes from its last checkpoint.

The package's modules import no Ray: the loop talks to controllers through `workers.client`.
"""
