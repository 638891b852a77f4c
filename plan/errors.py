"""The one exception of the plan package."""

from __future__ import annotations


class PlanError(ValueError):
    """A plan or profile that is malformed, of an unknown version, or inconsistent."""
