"""What the policy knows about one cached image entry."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from store.config import Tier

KEY_PATTERN = re.compile(r"[0-9a-f]{64}")


class Region(enum.StrEnum):
    """Where inside its tier an entry lives; only the DRAM tier has a reserved (preset) share."""

    MAIN = "main"
    PRESET = "preset"


def is_entry_key(key: str) -> bool:
    """True for the gateway's exact image keys: 64 lowercase hex digits."""
    return isinstance(key, str) and KEY_PATTERN.fullmatch(key) is not None


@dataclass(slots=True, kw_only=True)
class CacheEntry:
    """Bookkeeping for one entry; owned and mutated only by :class:`CachePolicy`.

    ``last_access`` is the policy's logical clock at the entry's last insert or exact
    hit (approximate reads leave it alone); ``protection_budget`` is how many more times
    eviction may pass over the entry.
    """

    key: str
    size_bytes: int
    tier: Tier
    region: Region = Region.MAIN
    family: str | None = None
    exact_hits: int = 0
    approximate_hits: int = 0
    protection_budget: int = 0
    prior_weight: float = 0.0
    pinned: bool = False
    last_access: int = 0

    @property
    def approximate_only(self) -> bool:
        return self.exact_hits == 0

    def as_dict(self) -> dict:
        return {
            "key": self.key,
            "size_bytes": self.size_bytes,
            "tier": self.tier.value,
            "region": self.region.value,
            "family": self.family,
            "exact_hits": self.exact_hits,
            "approximate_hits": self.approximate_hits,
            "protection_budget": self.protection_budget,
            "prior_weight": self.prior_weight,
            "pinned": self.pinned,
            "last_access": self.last_access,
        }
