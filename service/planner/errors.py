"""The planner's one error type."""

from __future__ import annotations


class PlannerError(ValueError):
    """Input the planner cannot plan for; the message names the field and what is allowed.

    Raised for bad cluster / train specs, unknown GPU types or presets, layouts that cannot run on
    the given model and cluster (evaluate mode), and models that fit on no layout of the cluster
    (the message then names the smallest cluster that would fit).
    """
