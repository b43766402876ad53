"""The planner's user error."""

from __future__ import annotations


class PlanError(ValueError):
    """A planning request the user can fix (bad layout, unknown accelerator, nothing fits)."""
