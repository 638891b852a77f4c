"""The gateway's cache policy: exact-priority LRU over two tiers with a preset victim cache.

Pure bookkeeping: no I/O, no clock, no randomness. Every mutating call applies its
decisions to the policy's own books and returns them, in order, for the caller to carry
out on the store. Being deterministic, the books of several gateways that apply the same
calls in the same order are the same (gateway/books replays them so).

Tiers. The books manage the store's first two tiers, an *upper* one (L2: DRAM, or the
shared mooncake tier across hosts) and an optional *lower* one (L3: LMDB, or mooncake);
``tiers`` names them, fastest first, as the store does.

Layout. The upper tier is split into a *main* region (``capacity - preset``) and a reserved
*preset* region (``preset_fraction`` of it); the lower tier is one region. Bytes in each
region never exceed its capacity after a call returns.

Exact-priority LRU (main region and the lower tier). Each exact hit sets the entry's protection
budget to ``min(exact_hits, max_protection_budget)``. To free space, eviction walks the
region from its LRU end: a pinned entry is never a candidate; an entry with budget left
loses one unit and moves to the MRU end; the first entry with no budget is the victim.
Approximate-only entries (no exact hit) never have a budget, so they leave first; an
exact entry that stops being hit leaves once its budget is spent.

Hits. An exact hit makes the entry most recently used and, from the lower tier, promotes it
to the upper one (when it fits there next to the pinned entries). An approximate (sparse)
read only counts: no recency change, no tier change, no promotion of the alias entry.

Preset victim cache. An entry's preset score is its prior weight (uploaded priors, see
:mod:`gateway.policy.priors`) plus ``preset_reuse_weight`` per hit of either type. A
victim of the main region whose score reaches ``preset_min_score`` stays in the upper tier's
preset region instead of being demoted, displacing preset entries of lower (score, last
access) if needed; displaced preset entries, and victims that do not qualify, are demoted
to the lower tier (or evicted when it cannot take them). An exact hit on a preset entry
keeps it there.

Not thread-safe: call it from one thread, the gateway's cache thread.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter, OrderedDict

from gateway.config import PolicySettings
from gateway.policy.decisions import Admit, Decision, Demote, Evict, Promote, Reject, Reserve
from gateway.policy.entry import CacheEntry, Region, Tier, is_entry_key
from gateway.policy.errors import EntryPinned, InvalidEntry, UnknownEntry
from gateway.policy.priors import PresetPriors
from gateway.policy.stats import PolicyStats, TierUsage

Slot = tuple[Tier, Region]
DEFAULT_TIERS = (Tier.DRAM, Tier.LMDB)
HIT_TYPES = ("exact", "approximate")
DECISION_KINDS = ("admit", "reject", "promote", "demote", "reserve", "evict")
EVICTION_REASONS = ("capacity", "removed", "flushed")


class CachePolicy:
    def __init__(self, settings: PolicySettings, priors: PresetPriors | None = None, *,
                 tiers: tuple[Tier, ...] | tuple[str, ...] = DEFAULT_TIERS):
        if not 1 <= len(tiers) <= 2 or len(set(tiers)) != len(tiers):
            raise InvalidEntry(f"the books manage one or two distinct tiers, fastest first; got {tiers!r}")
        self.settings = settings
        self.tiers = tuple(Tier(t) for t in tiers)
        self.upper = self.tiers[0]
        self.lower = self.tiers[1] if len(self.tiers) > 1 else None  # None: victims of the upper tier leave
        self.main: Slot = (self.upper, Region.MAIN)
        self.preset: Slot = (self.upper, Region.PRESET)
        self.low: Slot | None = (self.lower, Region.MAIN) if self.lower is not None else None
        self.slots: tuple[Slot, ...] = (self.main, self.preset) + ((self.low,) if self.low is not None else ())
        self._priors = priors or PresetPriors()
        self._entries: dict[str, CacheEntry] = {}
        # Eviction order per region, LRU first. Pinned entries are left out: they are
        # never candidates, and rejoin at the MRU end when unpinned.
        self._order: dict[Slot, OrderedDict[str, None]] = {slot: OrderedDict() for slot in self.slots}
        # Running totals per region, kept as entries come, go, move and are pinned, so that stats() (/metrics,
        # /admin/stats, on the cache thread) costs the same at any number of entries: bytes and entries held, and
        # the bytes and entries of the pinned ones.
        self._used: Counter[Slot] = Counter()
        self._pinned: Counter[Slot] = Counter()
        self._held: Counter[Slot] = Counter()
        self._pinned_held: Counter[Slot] = Counter()
        self._clock = 0
        self._counts: Counter[str] = Counter()

    # ---- queries -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str) -> CacheEntry:
        """A copy of the entry's metadata; raises :class:`UnknownEntry`."""
        return dataclasses.replace(self._entry(key))

    def entries(
        self, *, after: str | None = None, limit: int | None = None, tier: Tier | None = None
    ) -> list[CacheEntry]:
        """Copies of entries sorted by key, those with key > ``after`` only, at most ``limit``."""
        keys = sorted(self._entries)
        start = bisect.bisect_right(keys, after) if after is not None else 0
        found: list[CacheEntry] = []
        for key in keys[start:]:
            entry = self._entries[key]
            if tier is not None and entry.tier is not tier:
                continue
            if limit is not None and len(found) >= limit:
                break
            found.append(dataclasses.replace(entry))
        return found

    @property
    def priors(self) -> PresetPriors:
        return self._priors

    def capacity(self, slot: Slot | None) -> int:
        if slot is None:
            return 0
        if slot == self.main:
            return self.settings.main_capacity_bytes(self.upper)
        if slot == self.preset:
            return self.settings.preset_capacity_bytes(self.upper)
        return self.settings.capacity_bytes(slot[0])

    def preset_score(self, entry: CacheEntry) -> float:
        return entry.prior_weight + self.settings.preset_reuse_weight * (entry.exact_hits + entry.approximate_hits)

    def stats(self) -> PolicyStats:
        """The figures from the running totals: as cheap at a million entries as at none (no walk over them)."""

        def usage(*slots: Slot) -> TierUsage:
            return TierUsage(
                entries=sum(self._held[s] for s in slots),
                bytes=sum(self._used[s] for s in slots),
                capacity_bytes=sum(self.capacity(s) for s in slots),
                pinned_entries=sum(self._pinned_held[s] for s in slots),
                pinned_bytes=sum(self._pinned[s] for s in slots),
            )

        c = self._counts
        tiers = {self.upper.value: usage(self.main, self.preset)}
        if self.low is not None:
            tiers[self.low[0].value] = usage(self.low)
        return PolicyStats(
            tiers=tiers,
            preset=usage(self.preset),
            hits={h: {t.value: c[f"hit:{h}:{t.value}"] for t in self.tiers} for h in HIT_TYPES},
            decisions={kind: c[f"decision:{kind}"] for kind in DECISION_KINDS},
            evictions={t.value: {r: c[f"evict:{t.value}:{r}"] for r in EVICTION_REASONS} for t in self.tiers},
            protections_used=c["protections_used"],
        )

    # ---- requests ------------------------------------------------------------------

    def insert(self, key: str, size_bytes: int, *, family: str | None = None) -> list[Decision]:
        """Track a newly stored entry (after a miss). A key already tracked is left as is.

        The entry enters the upper tier's main region at the MRU end, or the lower tier when it cannot fit in the
        upper one next to its pinned entries, or is rejected when it cannot fit in either.
        """
        if not is_entry_key(key):
            raise InvalidEntry(f"{key!r} is not a 64-digit lowercase hex image key")
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 0:
            raise InvalidEntry(f"size_bytes must be an int >= 0, got {size_bytes!r}")
        if key in self._entries:
            return []
        entry = CacheEntry(
            key=key, size_bytes=size_bytes, tier=self.upper, family=family,
            prior_weight=self._priors.weight(key, family), last_access=self._tick(),
        )
        out: list[Decision] = []
        for slot in (self.main, self.low):
            if slot is not None and self._has_room(slot, size_bytes):
                self._entries[key] = entry
                self._place(entry, slot)
                self._emit(out, Admit(key=key, tier=slot[0]))
                self._fit(slot, out, keep=key)
                break
        else:
            self._emit(out, Reject(key=key, reason="larger than the free capacity of every tier"))
        return out

    def restore(self, key: str, size_bytes: int, tier: Tier, *, pinned: bool = False) -> list[Decision]:
        """Track an entry found in the store (at start, or written since the books last looked), where it is.

        Unlike :meth:`insert` it does not move the entry up: one found in the lower tier is booked there. It enters
        its tier's main region at the MRU end (a pinned one stays pinned), and the region is then fitted as after
        an insert; an entry that cannot fit next to the tier's pinned entries goes to the lower tier, or is
        rejected. A tier the books do not manage counts as the lower one.
        """
        if not is_entry_key(key):
            raise InvalidEntry(f"{key!r} is not a 64-digit lowercase hex image key")
        if key in self._entries:
            return []
        entry = CacheEntry(key=key, size_bytes=size_bytes, tier=tier, pinned=pinned,
                           prior_weight=self._priors.weight(key, None), last_access=self._tick())
        out: list[Decision] = []
        slots = (self.main, self.low) if tier is self.upper else (self.low,)
        for slot in slots:
            if slot is not None and self._has_room(slot, size_bytes):
                self._entries[key] = entry
                self._place(entry, slot)
                if slot[0] is not tier:
                    self._emit(out, Demote(key=key, source=tier, target=slot[0]))
                self._fit(slot, out, keep=key)
                break
        else:
            self._emit(out, Reject(key=key, reason="larger than the free capacity of every tier"))
        return out

    def record_exact_hit(self, key: str) -> list[Decision]:
        """An exact hit read the whole entry: refresh its budget, make it MRU, promote from the lower tier."""
        entry = self._entry(key)
        self._counts[f"hit:exact:{entry.tier.value}"] += 1
        entry.exact_hits += 1
        entry.protection_budget = min(entry.exact_hits, self.settings.max_protection_budget)
        entry.last_access = self._tick()
        out: list[Decision] = []
        slot = (entry.tier, entry.region)
        if slot == self.low and self._has_room(self.main, entry.size_bytes):
            self._unplace(entry)
            self._place(entry, self.main)
            self._emit(out, Promote(key=key, source=slot[0], target=self.upper))
            self._fit(self.main, out, keep=key)
        elif not entry.pinned:
            self._order[slot].move_to_end(key)
        return out

    def record_approximate_hit(self, key: str) -> None:
        """A sparse read of the alias entry: counted, but no recency or tier change."""
        entry = self._entry(key)
        self._counts[f"hit:approximate:{entry.tier.value}"] += 1
        entry.approximate_hits += 1

    # ---- operator actions ----------------------------------------------------------

    def pin(self, key: str) -> CacheEntry:
        """Keep the entry where it is: never evicted or demoted by the policy. Idempotent."""
        entry = self._entry(key)
        if not entry.pinned:
            slot = (entry.tier, entry.region)
            del self._order[slot][key]
            self._pinned[slot] += entry.size_bytes
            self._pinned_held[slot] += 1
            entry.pinned = True
        return dataclasses.replace(entry)

    def unpin(self, key: str) -> CacheEntry:
        """Make the entry evictable again, at the MRU end of its region. Idempotent."""
        entry = self._entry(key)
        if entry.pinned:
            slot = (entry.tier, entry.region)
            self._pinned[slot] -= entry.size_bytes
            self._pinned_held[slot] -= 1
            self._order[slot][key] = None
            entry.pinned = False
        return dataclasses.replace(entry)

    def remove(self, key: str, *, force: bool = False) -> list[Decision]:
        """Drop one entry; a pinned one only with ``force`` (else :class:`EntryPinned`)."""
        entry = self._entry(key)
        if entry.pinned and not force:
            raise EntryPinned(key)
        out: list[Decision] = []
        self._drop(entry, out, reason="removed")
        return out

    def flush(self, *, force: bool = False) -> list[Decision]:
        """Drop every entry, in key order; pinned ones stay unless ``force``."""
        out: list[Decision] = []
        for key in sorted(self._entries):
            entry = self._entries[key]
            if force or not entry.pinned:
                self._drop(entry, out, reason="flushed")
        return out

    def set_priors(self, priors: PresetPriors) -> None:
        """Replace the preset priors. Entries already in the preset region stay until displaced."""
        self._priors = priors
        for entry in self._entries.values():
            entry.prior_weight = priors.weight(entry.key, entry.family)

    # ---- the books as data (gateway/books: snapshots of shared books) -----------------

    def state(self) -> dict:
        """Everything the books hold, JSON-ready: entries, each region's eviction order, the clock, the counters and
        the priors. ``load_state`` of it gives books that decide exactly as these do."""
        return {
            "tiers": [t.value for t in self.tiers],
            "entries": [entry.as_dict() for entry in self._entries.values()],
            "order": [[slot[0].value, slot[1].value, list(self._order[slot])] for slot in self.slots],
            "clock": self._clock,
            "counts": dict(self._counts),
            "priors": self._priors.as_dict(),
        }

    def load_state(self, state: dict) -> None:
        """Replace the books with ``state`` (from :meth:`state` of books over the same tiers)."""
        if [t.value for t in self.tiers] != state["tiers"]:
            raise InvalidEntry(f"books over {state['tiers']} cannot be loaded into books over "
                               f"{[t.value for t in self.tiers]}")
        self._priors = PresetPriors(**state["priors"])
        self._entries = {}
        self._used, self._pinned, self._held, self._pinned_held = Counter(), Counter(), Counter(), Counter()
        self._order = {slot: OrderedDict() for slot in self.slots}
        for fields in state["entries"]:
            entry = CacheEntry(**{**fields, "tier": Tier(fields["tier"]), "region": Region(fields["region"])})
            slot = (entry.tier, entry.region)
            self._entries[entry.key] = entry
            self._used[slot] += entry.size_bytes
            self._held[slot] += 1
            if entry.pinned:
                self._pinned[slot] += entry.size_bytes
                self._pinned_held[slot] += 1
        for tier, region, keys in state["order"]:
            self._order[(Tier(tier), Region(region))] = OrderedDict.fromkeys(keys)
        self._clock = state["clock"]
        self._counts = Counter(state["counts"])

    # ---- internals -----------------------------------------------------------------

    def _entry(self, key: str) -> CacheEntry:
        try:
            return self._entries[key]
        except KeyError:
            raise UnknownEntry(key) from None

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _emit(self, out: list[Decision], decision: Decision) -> None:
        out.append(decision)
        self._counts[f"decision:{decision.kind}"] += 1
        if isinstance(decision, Evict):
            self._counts[f"evict:{decision.tier.value}:{decision.reason}"] += 1

    def _has_room(self, slot: Slot | None, size_bytes: int) -> bool:
        """Whether ``size_bytes`` fits in ``slot`` once every unpinned entry there has left."""
        return slot is not None and size_bytes <= self.capacity(slot) - self._pinned[slot]

    def _place(self, entry: CacheEntry, slot: Slot) -> None:
        entry.tier, entry.region = slot
        self._used[slot] += entry.size_bytes
        self._held[slot] += 1
        if entry.pinned:
            self._pinned[slot] += entry.size_bytes
            self._pinned_held[slot] += 1
        else:
            self._order[slot][entry.key] = None

    def _unplace(self, entry: CacheEntry) -> None:
        slot = (entry.tier, entry.region)
        self._used[slot] -= entry.size_bytes
        self._held[slot] -= 1
        if entry.pinned:
            self._pinned[slot] -= entry.size_bytes
            self._pinned_held[slot] -= 1
        else:
            del self._order[slot][entry.key]

    def _drop(self, entry: CacheEntry, out: list[Decision], *, reason: str) -> None:
        self._unplace(entry)
        del self._entries[entry.key]
        self._emit(out, Evict(key=entry.key, tier=entry.tier, reason=reason))

    def _fit(self, slot: Slot, out: list[Decision], *, keep: str) -> None:
        """Free space in ``slot`` (main or the lower tier) until it is within capacity; ``keep`` stays."""
        while self._used[slot] > self.capacity(slot):
            victim = self._next_victim(slot, keep)
            assert victim is not None, "callers check _has_room before placing"
            if slot == self.main and self._make_preset_room(victim, out):
                self._unplace(victim)
                self._place(victim, self.preset)
                self._emit(out, Reserve(key=victim.key))
            elif slot == self.main:
                self._demote(victim, out)
            else:
                self._drop(victim, out, reason="capacity")

    def _next_victim(self, slot: Slot, keep: str) -> CacheEntry | None:
        """Exact-priority LRU: spend budgets of protected entries until an unprotected one comes up."""
        order = self._order[slot]
        while len(order) > (1 if keep in order else 0):
            key = next(iter(order))
            entry = self._entries[key]
            if key != keep and entry.protection_budget == 0:
                return entry
            if key != keep:
                entry.protection_budget -= 1
                self._counts["protections_used"] += 1
            order.move_to_end(key)
        return None

    def _demote(self, entry: CacheEntry, out: list[Decision]) -> None:
        """An entry leaves the upper tier: to the lower one when it can fit there, else out of the cache."""
        if self.low is None or not self._has_room(self.low, entry.size_bytes):
            self._drop(entry, out, reason="capacity")
            return
        self._unplace(entry)
        self._place(entry, self.low)
        self._emit(out, Demote(key=entry.key, source=self.upper, target=self.low[0]))
        self._fit(self.low, out, keep=entry.key)

    def _make_preset_room(self, victim: CacheEntry, out: list[Decision]) -> bool:
        """Whether ``victim`` may stay in the preset region; demotes the preset entries it displaces."""
        score = self.preset_score(victim)
        if score < self.settings.preset_min_score or not self._has_room(self.preset, victim.size_bytes):
            return False
        need = self._used[self.preset] + victim.size_bytes - self.capacity(self.preset)
        displaced: list[CacheEntry] = []
        rank = (score, victim.last_access)
        candidates = sorted(
            (self._entries[k] for k in self._order[self.preset]), key=lambda e: (self.preset_score(e), e.last_access)
        )
        for candidate in candidates:
            if need <= 0:
                break
            if (self.preset_score(candidate), candidate.last_access) >= rank:
                return False
            displaced.append(candidate)
            need -= candidate.size_bytes
        if need > 0:
            return False
        for candidate in displaced:
            self._demote(candidate, out)
        return True
