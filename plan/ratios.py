"""Per-layer recompute ratios: how many of an image's first tokens each decoder layer recomputes."""

from __future__ import annotations

import math
from collections.abc import Sequence

from plan.errors import PlanError

DEFAULT_RECOMPUTE_RATIO = 0.1  # uniform ratio for moved images when no profile is found


def recompute_count(ratio: float, tokens: int) -> int:
    """How many of an image's first tokens a layer with this ratio recomputes: floor(ratio * tokens)."""
    return min(tokens, math.floor(ratio * tokens + 1e-9))


def check_ratios(ratios: Sequence[float], layers: int | None = None) -> tuple[float, ...]:
    """Per-layer recompute ratios: in [0, 1], non-increasing with depth (a token recomputed at a layer must have
    been computed at every layer before it). Raises PlanError."""
    values = tuple(float(r) for r in ratios)
    if layers is not None and values and len(values) != layers:
        raise PlanError(f"need one ratio per layer ({layers}), got {len(values)}")
    if any(not 0.0 <= r <= 1.0 for r in values):
        raise PlanError(f"ratios must be in [0, 1], got {list(values)}")
    if any(b > a for a, b in zip(values, values[1:], strict=False)):
        raise PlanError(f"ratios must be non-increasing with depth, got {list(values)}")
    return values
