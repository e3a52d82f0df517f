"""The planner's one error type: a request it cannot price, with a message that names the problem."""

from __future__ import annotations


class PlanError(ValueError):
    """Bad input to the planner (unknown GPU, EP not dividing the experts, …)."""
