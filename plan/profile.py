"""The recompute profile: per-layer ratios for position-independent reuse, found offline (offline.profiler)
and loaded by the gateway's planner."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from plan.errors import PlanError
from plan.ratios import check_ratios

PROFILE_VERSION = 1
PROFILE_KIND = "revisit.recompute_profile"
PROFILE_FILE = "recompute_profile.json"  # where the profiler writes by default, in the model's folder


@dataclass(frozen=True, kw_only=True)
class RecomputeProfile:
    """Per-layer recompute ratios for position-independent reuse, found offline (offline.profiler)."""

    model: str  # the model directory's name (arch, size and recipe digest)
    layers: int
    budget: float  # the mean ratio the search was allowed
    ratios: tuple[float, ...]
    metric: str = ""
    calibration: Mapping[str, Any] = field(default_factory=dict)  # what it was measured on, and the errors seen
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if len(self.ratios) != self.layers:
            raise PlanError(f"need one ratio per layer ({self.layers}), got {len(self.ratios)}")
        object.__setattr__(self, "ratios", check_ratios(self.ratios, self.layers))
        if not 0.0 <= self.budget <= 1.0:
            raise PlanError(f"budget must be in [0, 1], got {self.budget}")
        if sum(self.ratios) > self.budget * self.layers + 1e-9:
            raise PlanError(f"ratios average {sum(self.ratios) / self.layers:.4f}, over the budget {self.budget}")

    @property
    def mean_ratio(self) -> float:
        return sum(self.ratios) / self.layers

    def to_json(self) -> str:
        data = {"kind": PROFILE_KIND, **asdict(self), "ratios": list(self.ratios),
                "calibration": dict(self.calibration)}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def save(self, path: Path | str) -> None:
        target = Path(path)
        temp = target.with_name(target.name + ".tmp")
        temp.write_text(self.to_json())
        temp.replace(target)

    @classmethod
    def load(cls, path: Path | str) -> RecomputeProfile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise PlanError(f"cannot read recompute profile {path}: {exc}") from None
        if not isinstance(data, dict) or data.pop("kind", None) != PROFILE_KIND:
            raise PlanError(f"{path} is not a recompute profile")
        if data.get("version") != PROFILE_VERSION:
            raise PlanError(f"{path}: profile version {data.get('version')!r} is not {PROFILE_VERSION}")
        try:
            return cls(**{**data, "ratios": tuple(data["ratios"])})
        except (KeyError, TypeError) as exc:
            raise PlanError(f"{path}: bad profile: {exc}") from None
