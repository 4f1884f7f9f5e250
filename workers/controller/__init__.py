"""The job controller, one per job, after Ray Train v2's `controller/`; each module owns one thing:

- `state`: the states, `Transition`, the job state each one shows;
- `options`: `ControllerOptions`;
- `attempt`: what belongs to one start of the ranks (`Attempt`);
- `records`: the job record, the recovery under way, placement retries, clocks, fault books;
- `eventlog`: the numbered event log and the inbox of events ranks deliver directly;
- `detection`: pure detection of deaths, hangs, stragglers and SDC, returning a `Failure`;
- `attribution`: the node ledger, the referee, the nodes a restart avoids, fast path or full restart;
- `injection`: fault injection bookkeeping and the controller-side faults;
- `scrub`: checkpoint verification against manifests;
- `ingest`: the ranks' reports of one poll;
- `machine`: the state machine (`step()` and its handlers);
- `actor`: the detached Ray actor and the functions that start, find and end it.

This package re-exports what the service uses.
"""

from workers.controller.actor import (
    ControllerExists,
    JobController,
    get_controller,
    kill_controller,
    start_controller,
)
from workers.controller.machine import ControllerStateMachine
from workers.controller.options import ControllerOptions
from workers.controller.state import JOB_STATE, ControllerState, Transition
from workers.names import NAMESPACE, controller_name

__all__ = [
    "JOB_STATE", "NAMESPACE", "ControllerExists", "ControllerOptions", "ControllerState",
    "ControllerStateMachine", "JobController", "Transition", "controller_name", "get_controller",
    "kill_controller", "start_controller",
]
