"""The gateway's cache policy: which entries stay in which store tier.

The store only stores; :class:`CachePolicy` decides and returns typed decisions
(:mod:`gateway.policy.decisions`) for the caller to apply to the store.
"""

from gateway.policy.decisions import Admit, Decision, Demote, Evict, Promote, Reject, Reserve, decision_dict
from gateway.policy.entry import CacheEntry, Region, Tier, is_entry_key
from gateway.policy.errors import EntryPinned, InvalidEntry, InvalidPriors, PolicyError, UnknownEntry
from gateway.policy.policy import CachePolicy
from gateway.policy.priors import PresetPriors
from gateway.policy.stats import PolicyStats, TierUsage

__all__ = [
    "Admit", "CacheEntry", "CachePolicy", "Decision", "Demote", "EntryPinned", "Evict", "InvalidEntry",
    "InvalidPriors", "PolicyError", "PolicyStats", "PresetPriors", "Promote", "Region", "Reject", "Reserve",
    "Tier", "TierUsage", "UnknownEntry", "decision_dict", "is_entry_key",
]
