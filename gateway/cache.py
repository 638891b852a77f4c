"""Where the policy meets the data: applying the policy's decisions to the KV store, on a thread of its own.

The policy (gateway/policy) keeps the books and decides; the store (store/) only
stores. :class:`CacheManager` turns each decision into store operations, in order,
and counts what could not be applied (an entry a worker never wrote, or one damaged
and dropped by the store), so the books and the bytes can be compared.

Threading: one thread, the cache thread, owns the policy and the store. Moving an entry between tiers copies
hundreds of megabytes and syncs them to disk, and even a header probe may fault pages in: none of it may run on
the event loop. Code on the loop reaches the books and the bytes only through :meth:`CacheManager.run`, which
queues the work on the cache thread and awaits it; the work runs to the end even if its awaiter is cancelled, so
the books and the store never disagree half-way through a decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from gateway.policy import CachePolicy
from gateway.policy.decisions import Admit, Decision, Demote, Evict, Promote, Reject
from gateway.policy.entry import Tier, is_entry_key
from gateway.policy.errors import UnknownEntry
from store.dram import DramTier
from store.errors import StoreError
from store.tiered import TieredStore

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class Reconciled:
    """What one pass over the store changed in the books."""

    restored: int = 0  # entries the store held and the books did not (written by a worker, or before a restart)
    lost: int = 0  # entries the books held and the store did not (removed outside the gateway, or damaged)
    stray: int = 0  # entries the store held that the policy could not take (no room): removed from the store


@dataclass(slots=True)
class ApplyReport:
    applied: Counter = field(default_factory=Counter)
    missing: Counter = field(default_factory=Counter)  # the store had no valid copy to act on
    dropped: Counter = field(default_factory=Counter)  # entries a failed move took out of the books and the store
    seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # time applying, by kind
    longest_s: float = 0.0  # the longest single decision: what it would have held the event loop for


class CacheManager:
    """Applies decisions to a :class:`TieredStore`; without a store it only keeps the books.

    The methods below other than :meth:`run` and :meth:`close` are the cache thread's: call them through ``run``
    from the event loop (or directly where no loop is involved, as the policy tests do).
    """

    def __init__(self, policy: CachePolicy, store: TieredStore | None,
                 on_gone: Callable[[str], None] | None = None):
        self.policy = policy
        self.store = store
        self.report = ApplyReport()
        self.on_gone = on_gone  # called with each key an eviction leaves in no tier (the match index forgets it)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="revisit-cache")

    async def run(self, work: Callable[..., T], /, *args: object, **kwargs: object) -> T:
        """``work(*args, **kwargs)`` on the cache thread, in submission order; its result or its exception."""
        future = self._thread.submit(functools.partial(work, *args, **kwargs))
        # Shielded: a cancelled request stops waiting, but the work it queued still completes.
        return await asyncio.shield(asyncio.wrap_future(future))

    def close(self) -> None:
        """Finish the queued work, then close the store. Idempotent."""
        self._thread.shutdown(wait=True)
        if self.store is not None:
            self.store.close()

    def apply(self, decisions: list[Decision]) -> list[Decision]:
        if self.store is None:
            return decisions
        for decision in decisions:
            started = time.perf_counter()
            try:
                done = self._apply_one(decision)
            except StoreError as exc:
                log.warning("could not apply %s to the store: %s", decision, exc)
                done = False
            (self.report.applied if done else self.report.missing)[decision.kind] += 1
            # An Admit finds nothing to move while the worker has not written the entry yet: that is no failure.
            if not done and (isinstance(decision, Promote | Demote)
                             or isinstance(decision, Admit) and self.store.contains(decision.key)):
                self._drop_unmoved(decision)
            if isinstance(decision, Evict) and self.on_gone is not None and not self.store.contains(decision.key):
                self.on_gone(decision.key)
            took = time.perf_counter() - started
            self.report.seconds[decision.kind] += took
            self.report.longest_s = max(self.report.longest_s, took)
        return decisions

    def _drop_unmoved(self, decision: Promote | Demote | Admit) -> None:
        """An entry the books placed in a tier the bytes could not reach (that tier full, its disk full, the
        copy damaged) goes from the books and the store: kept, it would be counted in one tier and held in
        another, outside every capacity. A cache may lose an entry; it may not lose count of one."""
        store = self.store
        assert store is not None
        key = decision.key
        if not self._unbook(key):  # its Evict decisions name the tier it never reached: not applied
            return
        try:
            store.remove(key, force=True)
        except StoreError as exc:
            log.warning("could not remove %s after a failed %s: %s", key, decision.kind, exc)
        self.report.dropped[decision.kind] += 1
        log.warning("dropped %s: %s could not be applied", key, decision)
        if self.on_gone is not None and not store.contains(key):
            self.on_gone(key)

    def _apply_one(self, decision: Decision) -> bool:
        store = self.store
        assert store is not None
        match decision:
            case Promote(key=key, source=source, target=target) | Demote(key=key, source=source, target=target):
                return store.move(key, src=source, dst=target)
            case Evict(key=key, tier=tier, reason=reason):
                # The policy never evicts a pinned entry for capacity; an operator's remove may force.
                return store.tier(tier).remove(key, force=reason != "capacity")
            case Admit(key=key, tier=tier):
                # Workers write new entries to the fastest tier; an entry admitted lower moves there.
                holding = store.tiers_holding(key)
                if tier in holding:
                    return True
                return bool(holding) and store.move(key, src=holding[0], dst=tier)
            case _:
                return True  # Reject and Reserve move no data

    # The operations the admin API and the request path call: policy first, then data.
    def insert(self, key: str, size_bytes: int, *, family: str | None = None) -> list[Decision]:
        return self.apply(self.policy.insert(key, size_bytes, family=family))

    def record_exact_hit(self, key: str) -> list[Decision]:
        """An exact hit on a booked entry (none when the entry left the books since it was looked up: another
        gateway sharing them evicted it meanwhile)."""
        try:
            return self.apply(self.policy.record_exact_hit(key))
        except UnknownEntry:
            return []

    def record_approximate_hit(self, key: str) -> None:
        with contextlib.suppress(UnknownEntry):
            self.policy.record_approximate_hit(key)  # a sparse read of the alias moves nothing

    def remove(self, key: str, *, force: bool = False) -> list[Decision]:
        return self.apply(self.policy.remove(key, force=force))

    def drop(self, key: str) -> None:
        """The store lost the entry (damaged, or removed outside the gateway): out of the books, if still there
        (and so out of the match index)."""
        with contextlib.suppress(UnknownEntry):
            self.apply(self.policy.remove(key, force=True))

    def _unbook(self, key: str) -> bool:
        """Remove from the books without touching the store; False when the books did not hold it (or no longer:
        shared books may have let it go through another gateway)."""
        try:
            self.policy.remove(key, force=True)
        except UnknownEntry:
            return False
        return True

    def flush(self, *, force: bool = False) -> list[Decision]:
        """Every entry out of the books and the store (pinned ones only with ``force``), those the books had not
        yet taken in included."""
        self.reconcile()
        return self.apply(self.policy.flush(force=force))

    def reconcile(self) -> Reconciled:
        """Make the books hold what the store holds, in one pass (the gateway does it in chunks: Services)."""
        if self.store is None:
            return Reconciled()
        keys = list(self.store.keys())
        done = self.take_in(self.oldest_first(keys))
        done.lost = self.drop_lost(set(keys))
        return done

    def oldest_first(self, keys: list[str]) -> list[str]:
        """``keys`` in the order to book them after a restart, least recently used first, so that the books' LRU
        order resumes about where it was: entries in the slower tiers first (they were demoted there), then the
        DRAM tier's by when each was written there (a worker's put or a promotion). The store keeps no finer
        record of use, so within LMDB the order is the store's. Only entries not yet booked are looked at (take_in
        skips the others), so the periodic pass stats no more files than it books."""
        store = self.store
        if store is None:
            return keys
        dram = next((t for t in store.tiers if isinstance(t, DramTier)), None)
        written = {key: dram.written_at(key) for key in keys if key not in self.policy} if dram is not None else {}
        return sorted(keys, key=lambda k: (written.get(k) is not None, written.get(k) or 0.0))

    def take_in(self, keys: list[str]) -> Reconciled:
        """Book the entries the store holds under these keys and the books do not, where they are
        (policy.restore, which may evict others to fit them)."""
        done = Reconciled()
        store = self.store
        if store is None:
            return done
        for key in keys:
            if key in self.policy or not is_entry_key(key):
                continue
            holding = store.tiers_holding(key)
            size = store.size_of(key)
            if not holding or size is None:
                continue  # removed since it was listed
            decisions = self.apply(self.policy.restore(key, size, Tier(holding[0]), pinned=store.is_pinned(key)))
            if any(isinstance(d, Reject) and d.key == key for d in decisions):
                store.remove(key, force=True)  # no room for it anywhere: do not keep bytes the books do not track
                done.stray += 1
            else:
                done.restored += 1
        if done.restored or done.stray:
            log.info("books took in %d entries from the store (%d removed for want of room)", done.restored,
                     done.stray)
        return done

    def drop_lost(self, listed: set[str]) -> int:
        """Take out of the books the entries the store no longer holds (``listed``: the store's keys as listed
        before; an entry booked since then is checked on its own). Returns how many."""
        store = self.store
        if store is None:
            return 0
        lost = [e.key for e in self.policy.entries() if e.key not in listed and not store.contains(e.key)]
        for key in lost:
            self.drop(key)
        if lost:
            log.warning("%d entries left the store outside the gateway; taken out of the books", len(lost))
        return len(lost)

    def set_pinned(self, key: str, pinned: bool):
        """Pin or unpin in the books and, where the store holds the entry, in the store too."""
        entry = self.policy.pin(key) if pinned else self.policy.unpin(key)
        if self.store is not None and self.store.contains(key):
            self.store.pin(key) if pinned else self.store.unpin(key)
        return entry
