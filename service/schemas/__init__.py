"""The API's data shapes, by resource: the job spec a user submits (`jobs`, with its `model`,
`training` and `faults` parts), the public views of jobs and events (`views`), tokens, and the
error and health documents (`problems`).

The model shape and the layout are validated by their owners (training.config.spec.ModelSpec,
training.config.layout.Layout); these modules only translate their errors into field errors.
"""

from service.schemas.faults import FaultKind, FaultSpec
from service.schemas.jobs import DEMO_SPEC, EXPLICIT_SPEC, JobSpec
from service.schemas.model import ModelConfig, ModelPreset
from service.schemas.problems import FieldError, Health, Problem, Readiness
from service.schemas.tokens import TokenCreate, TokenCreated
from service.schemas.training import (
    CheckpointPolicy,
    DataSpec,
    FaultTolerancePolicy,
    LayoutSpec,
    ResourcesSpec,
    TrainConfig,
)
from service.schemas.views import (
    EventPage,
    EventPublic,
    JobPage,
    JobPublic,
    JobStateName,
    Progress,
    RankPlacementPublic,
)

__all__ = [
    "CheckpointPolicy",
    "DEMO_SPEC",
    "DataSpec",
    "EXPLICIT_SPEC",
    "EventPage",
    "EventPublic",
    "FaultKind",
    "FaultSpec",
    "FaultTolerancePolicy",
    "FieldError",
    "Health",
    "JobPage",
    "JobPublic",
    "JobSpec",
    "JobStateName",
    "LayoutSpec",
    "ModelConfig",
    "ModelPreset",
    "Problem",
    "Progress",
    "RankPlacementPublic",
    "Readiness",
    "ResourcesSpec",
    "TokenCreate",
    "TokenCreated",
    "TrainConfig",
]
