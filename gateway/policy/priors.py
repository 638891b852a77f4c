"""Offline workload priors for the preset victim cache.

Priors weight either single entries (by exact key) or *families*: a family is a free
label the gateway attaches to an entry when it is inserted (for example the application,
document template or video a request belongs to). An entry's prior weight is the larger
of its key's weight and its family's weight, 0 when neither is listed. Keys are hashes,
so key prefixes carry no meaning and are not a family.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gateway.policy.entry import is_entry_key
from gateway.policy.errors import InvalidPriors

MAX_PRIORS = 100_000
MAX_FAMILY_LENGTH = 128


def _frozen(mapping: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType(dict(sorted(mapping.items())))


@dataclass(frozen=True, slots=True, kw_only=True)
class PresetPriors:
    """Validated weights; immutable. Build with ``PresetPriors(keys=..., families=...)``."""

    keys: Mapping[str, float] = field(default_factory=dict)
    families: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) + len(self.families) > MAX_PRIORS:
            raise InvalidPriors(f"at most {MAX_PRIORS} priors (keys and families together) are accepted")
        for key, weight in self.keys.items():
            if not is_entry_key(key):
                raise InvalidPriors(f"prior key {key!r} is not a 64-digit lowercase hex image key", param="keys")
            _check_weight(weight, f"keys.{key}")
        for family, weight in self.families.items():
            if not isinstance(family, str) or not family or len(family) > MAX_FAMILY_LENGTH:
                raise InvalidPriors(
                    f"family names must be 1 to {MAX_FAMILY_LENGTH} characters, got {family!r}", param="families"
                )
            _check_weight(weight, f"families.{family}")
        object.__setattr__(self, "keys", _frozen(self.keys))
        object.__setattr__(self, "families", _frozen(self.families))

    def weight(self, key: str, family: str | None) -> float:
        """The prior weight of an entry with ``key`` and ``family`` (0.0 when unlisted)."""
        by_family = self.families.get(family, 0.0) if family is not None else 0.0
        return max(self.keys.get(key, 0.0), by_family)

    def as_dict(self) -> dict:
        return {"keys": dict(self.keys), "families": dict(self.families)}


def _check_weight(weight: object, param: str) -> None:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise InvalidPriors(f"{param}: weights must be finite numbers > 0, got {weight!r}", param=param)
