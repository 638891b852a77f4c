"""The policy's decisions: what the store must do so that it matches the policy's books.

Every mutating policy call returns a list of these, in the order they must be applied,
and has already applied them to its own bookkeeping. Each decision is counted under its
``kind`` in :class:`~gateway.policy.stats.PolicyStats`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from gateway.policy.entry import Tier


@dataclass(frozen=True, slots=True, kw_only=True)
class Admit:
    """Write a new entry into ``tier``."""

    kind: ClassVar[str] = "admit"
    key: str
    tier: Tier


@dataclass(frozen=True, slots=True, kw_only=True)
class Reject:
    """Do not store the entry at all (larger than any tier can hold next to pinned entries)."""

    kind: ClassVar[str] = "reject"
    key: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Promote:
    """Copy an entry up from ``source`` to ``target`` and drop it from ``source``."""

    kind: ClassVar[str] = "promote"
    key: str
    source: Tier = Tier.LMDB
    target: Tier = Tier.DRAM


@dataclass(frozen=True, slots=True, kw_only=True)
class Demote:
    """Copy an entry down from ``source`` to ``target`` and drop it from ``source``."""

    kind: ClassVar[str] = "demote"
    key: str
    source: Tier = Tier.DRAM
    target: Tier = Tier.LMDB


@dataclass(frozen=True, slots=True, kw_only=True)
class Reserve:
    """Keep an DRAM victim in DRAM's reserved preset share; no data moves, the store keeps it in DRAM."""

    kind: ClassVar[str] = "reserve"
    key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Evict:
    """Delete an entry from ``tier``. ``reason``: "capacity", "removed" (admin) or "flushed"."""

    kind: ClassVar[str] = "evict"
    key: str
    tier: Tier
    reason: str = "capacity"


Decision = Admit | Reject | Promote | Demote | Reserve | Evict


def decision_dict(decision: Decision) -> dict:
    """A JSON-ready form, e.g. ``{"kind": "demote", "key": ..., "source": "dram", "target": "lmdb"}``."""
    body: dict = {"kind": decision.kind}
    for f in fields(decision):
        value = getattr(decision, f.name)
        body[f.name] = value.value if isinstance(value, Tier) else value
    return body
