"""POST /v1/jobs/{id}/faults: inject a fault into a running job (fault-tolerance testing and demos only).

Admin only, and only when the service runs with `LATTICE_FAULT_INJECTION=true`. The fault goes to
the job's controller (through workers.client), which arms it on the target rank; its
`fault_injected` event, then the detection, attribution, quarantine, restore and resume events,
appear in the job's event log as they happen.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, status
from pydantic import BaseModel, Field

from service.api.deps import AdminPrincipal, SessionDep, SettingsDep
from service.api.operations import visible_job
from service.api.problems import problem_responses
from service.api.responses import ModelResponseRoute
from service.api.routes.jobs import JobId
from service.errors import Conflict, LatticeError
from service.schemas import FaultSpec

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["faults"], route_class=ModelResponseRoute)

ACTIVE_STATES = ("starting", "running", "recovering")
FAULT_EXAMPLES = {
    "kill_rank": {"summary": "SIGKILL rank 1 after step 5",
                  "value": {"kind": "kill_rank", "rank": 1, "at_step": 5}},
    "bitflip": {
        "summary": "Flip an exponent bit of a weight on rank 1's replica",
        "value": {"kind": "bitflip", "rank": 1, "at_step": 4, "target": "param", "bit": 30},
    },
    "kill_node": {"summary": "Remove rank 0's node", "value": {"kind": "kill_node", "rank": 0, "at_step": 3}},
}


class FaultInjectionDisabled(Conflict):
    title = "Fault injection is disabled"


class ControllerUnavailable(LatticeError):
    status = 503
    title = "The job's controller is not reachable"


class FaultAccepted(BaseModel):
    job_id: str = Field(description="The job the fault was sent to.")
    fault: dict[str, Any] = Field(description="The fault as the controller armed it (defaults filled in).")


@router.post(
    "/{job_id}/faults",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=FaultAccepted,
    summary="Inject a fault (admin, testing only)",
    description="Arms a fault in a running job: kill_rank, kill_node, hang_rank, slow_rank, bitflip or "
    "corrupt_checkpoint, at step `at_step` (a step already passed fires at the next one; unset = the "
    "job's next step). Needs an admin "
    "token and LATTICE_FAULT_INJECTION=true.",
    responses=problem_responses(401, 403, 404, 409, 422, 503),
)
def inject_fault(
    job_id: JobId,
    fault: Annotated[FaultSpec, Body(openapi_examples=FAULT_EXAMPLES)],
    session: SessionDep,
    settings: SettingsDep,
    principal: AdminPrincipal,
) -> FaultAccepted:
    if not settings.fault_injection:
        raise FaultInjectionDisabled(
            "fault injection is off on this server; start it with LATTICE_FAULT_INJECTION=true (tests and "
            "demos only)"
        )
    job = visible_job(session, principal, job_id)
    if str(job.state) not in ACTIVE_STATES:
        raise Conflict(f"job {job_id} is {job.state}; faults can only be injected into a job that is "
                       f"{', '.join(ACTIVE_STATES)}")
    body = fault.model_dump(exclude_none=True)
    if fault.at_step is None:
        body["at_step"] = next_step(job.step)
    return FaultAccepted(job_id=job_id, fault=send_fault(job_id, body))


def next_step(current: int | None) -> int:
    """The step a fault without `at_step` fires after: the one the job runs next."""
    return (current or 0) + 1


def send_fault(job_id: str, fault: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """Validate the fault the way the controller will and hand it to the job's controller."""
    from workers.faults import FaultError, normalize_fault

    try:
        normalized = normalize_fault(fault)
    except FaultError as e:
        raise Conflict(str(e)) from e
    from workers.client import ControllerError, find_controller, is_connected

    controller = find_controller(job_id) if is_connected() else None
    if controller is None:
        raise ControllerUnavailable(f"job {job_id} has no live controller (it may be between attempts)")
    try:
        controller.inject_fault(normalized, timeout_s=timeout_s)
    except ControllerError as e:
        raise ControllerUnavailable(f"could not reach the controller of job {job_id}: {e}") from e
    log.warning("fault injected into job %s: %s", job_id, normalized)
    return normalized
