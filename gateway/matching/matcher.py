"""Approximate matching, coarse to fine: from a new image's features to the cached images it nearly duplicates.

``Matcher.lookup`` asks the index (gateway.matching.index) for a handful of candidates of the caller's namespace,
reads each one's per-token features from the feature store (a small in-memory LRU in front), aligns it with the
new image (gateway.matching.align: a whole-token shift from the digests, then a change map) and keeps those whose
similarity reaches ``match_threshold``, those the planner's guard would plan first, then best first; when none in
place is within the guard, content moved by part of a token is looked for (gateway.matching.moved). A lookup whose
candidates all fall short is a near miss.

``Matcher.add`` indexes a new image and persists its features beside the store, so ``Matcher.rebuild`` can restore
the index after a restart from the records whose KV entry the store still holds. With books shared by several
gateways (gateway/books) the features live in the books' server, ``on_indexed`` and ``on_forgotten`` tell the
other replicas, and they ``learn`` and ``forget`` what this one announced.

Threading: the cache thread's (called from the planner and from CacheManager's removals), like the policy.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gateway.config import MatchSettings
from gateway.matching.align import Alignment, align, find_shift, moved_by
from gateway.matching.features import TokenFeatures
from gateway.matching.index import IndexRecord, MatchIndex, OutdatedRecord
from gateway.matching.moved import MovedImage
from store import StoreError

log = logging.getLogger(__name__)


class FeatureRecords(Protocol):
    """Where features persist: store.FeatureStore beside one gateway's store, or gateway.books.SharedFeatureStore."""

    def put(self, key: str, index_record: bytes, tokens: bytes) -> None: ...
    def tokens(self, key: str) -> bytes | None: ...
    def index_record(self, key: str) -> bytes | None: ...
    def remove(self, key: str) -> bool: ...
    def index_records(self) -> Iterator[tuple[str, bytes]]: ...
    def close(self) -> None: ...


@dataclass(frozen=True, eq=False)
class Match:
    alias: str
    alignment: Alignment
    alias_features: TokenFeatures


@dataclass(frozen=True, eq=False)
class Lookup:
    matches: tuple[Match, ...]  # at or above the match threshold, best first
    candidates: int  # compared in full
    best_similarity: float | None  # the best fine score among the candidates (None: there were none)
    query: IndexRecord  # the new image's own record, which add() takes if the image is then indexed

    @property
    def near_miss(self) -> bool:
        return not self.matches and self.candidates > 0


class Matcher:
    def __init__(self, settings: MatchSettings, *, scope: str, features: FeatureRecords | None) -> None:
        self.settings = settings
        self.scope = scope
        self.features = features
        self.on_indexed: Callable[[str], None] | None = None  # told of each image this matcher indexes
        self.on_forgotten: Callable[[str], None] | None = None  # told of each image it forgets
        self.index = MatchIndex(coarse_threshold=settings.coarse_threshold, candidates=settings.candidates,
                                scan_limit=settings.scan_limit)
        self._cache: OrderedDict[str, TokenFeatures] = OrderedDict()
        self._cache_bytes = 0
        self.damaged_records = 0

    def record(self, key: str, namespace: str, features: TokenFeatures) -> IndexRecord:
        return IndexRecord.of(key, namespace, self.scope, features, blank_entropy=self.settings.blank_entropy)

    def add(self, key: str, namespace: str, features: TokenFeatures, record: IndexRecord | None = None) -> None:
        """Index an image (and persist its features) under its exact key; ``record``: its index record when a
        lookup made it already (``Lookup.query``)."""
        if record is None or (record.key, record.namespace) != (key, namespace):
            record = self.record(key, namespace, features)
        if self.features is not None:
            try:
                self.features.put(key, record.to_bytes(), features.to_bytes())
            except StoreError as exc:  # the index still works for this process's lifetime
                log.warning("could not persist the features of %s: %s", key[:16], exc)
        self.index.add(record)
        self._remember(key, features)
        if self.on_indexed is not None:
            self.on_indexed(key)

    def remove(self, key: str) -> None:
        """Forget an image: its entry left the store."""
        self.forget(key)
        if self.features is not None:
            try:
                self.features.remove(key)
            except StoreError as exc:
                log.warning("could not drop the features of %s: %s", key[:16], exc)
        if self.on_forgotten is not None:
            self.on_forgotten(key)

    def forget(self, key: str) -> None:
        """Take an image out of this matcher's index (its features stay where they persist)."""
        self.index.remove(key)
        cached = self._cache.pop(key, None)
        if cached is not None:
            self._cache_bytes -= cached.nbytes

    def learn(self, key: str) -> None:
        """Index an image another gateway indexed, from its persisted record (skipped when gone since, or when
        this matcher has it already)."""
        if self.features is None or key in self.index:
            return
        try:
            data = self.features.index_record(key)
            record = self._read_record(key, data) if data is not None else None
        except (StoreError, ValueError) as exc:
            log.warning("could not learn the features of %s: %s", key[:16], exc)
            return
        if record is not None and record.scope == self.scope:
            self.index.add(record)

    def lookup(self, namespace: str, key: str, features: TokenFeatures, moved: MovedImage | None = None) -> Lookup:
        """The indexed images of ``namespace`` the new image nearly duplicates, those the planner's guard would plan
        (no more than ``max_changed_share`` of the tokens changed) first, then by similarity; ``moved``: the new
        image, for candidates its content moved against by part of a token.

        Every candidate is aligned in place first (a whole-token shift at most); only when none of them matches
        within the guard is the content looked for moved by part of a token (moved_alignment), candidate by
        candidate in the coarse stage's order, up to the first that does: each such search costs a phase
        correlation at least, and the coarse stage offers look-alike pages that a move of a pixel leaves as alike
        as the page itself. (A photo moved by a pixel may still match in place, with most of its tokens changed.)"""
        settings = self.settings
        query = self.record(key, namespace, features)
        candidates = self.index.lookup(namespace, query)
        matches, best, compared = [], None, []
        for alias in candidates:
            alias_features = self._tokens(alias)
            if alias_features is None:
                continue
            alignment = in_place(features, alias_features, settings)
            compared.append((alias, alias_features))
            best = alignment.similarity if best is None else max(best, alignment.similarity)
            if alignment.similarity >= settings.match_threshold:
                matches.append(Match(alias=alias, alignment=alignment, alias_features=alias_features))
        if moved is not None and not any(self.within_guard(m) for m in matches):
            for alias, alias_features in compared:
                again = moved_alignment(features, alias_features, settings, moved)
                if again is None:
                    continue
                best = again.similarity if best is None else max(best, again.similarity)
                if again.similarity >= settings.match_threshold:
                    matches.append(Match(alias=alias, alignment=again, alias_features=alias_features))
                    if self.within_guard(matches[-1]):
                        break
        matches.sort(key=lambda m: (not self.within_guard(m), -m.alignment.similarity))
        return Lookup(matches=tuple(matches), candidates=len(compared), best_similarity=best, query=query)

    def within_guard(self, match: Match) -> bool:
        """Whether the planner's guard would plan the match: no more than max_changed_share of its tokens changed."""
        return _planned(match.alignment, self.settings)

    def is_pending(self, key: str) -> bool:
        """Whether key was indexed recently enough that its entry may still be on its way into the store."""
        record = self.index.get(key)
        return record is not None and time.time() - record.added_at < self.settings.pending_grace_s

    def rebuild(self, stored: Callable[[str], bool]) -> int:
        """Index every persisted record of this scope whose KV entry is stored (or may still be on its way);
        drop the records whose entry is gone. Returns the number indexed. (The gateway does the same in chunks,
        see Services.start, so that requests are planned while a large index is rebuilt.)"""
        records = self.persisted(stored)
        self.index.add_many(records)
        return len(records)

    def persisted(self, stored: Callable[[str], bool]) -> list[IndexRecord]:
        """The persisted records of this scope worth indexing (see rebuild); damaged and orphaned ones are
        dropped from the feature store on the way."""
        if self.features is None:
            return []
        now, records = time.time(), []
        for key, data in self.features.index_records():
            try:
                record = self._read_record(key, data)
            except (StoreError, ValueError):
                self.damaged_records += 1
                self.features.remove(key)
                continue
            if record.scope != self.scope:
                continue  # another model or extractor's: not ours to judge
            if not stored(key) and now - record.added_at >= self.settings.pending_grace_s:
                self.features.remove(key)
                continue
            records.append(record)
        return records

    def _read_record(self, key: str, data: bytes) -> IndexRecord:
        """A persisted index record; one of an earlier version is made again from the image's token features (and
        persisted so). Raises ValueError for a damaged record, StoreError when the store cannot be read."""
        try:
            return IndexRecord.from_bytes(key, data)
        except OutdatedRecord as outdated:
            old = outdated.record
            if old.scope != self.scope or self.features is None:
                return old  # another model or extractor's: not ours to judge, nor to rewrite
            tokens = self.features.tokens(key)
            if tokens is None:
                raise ValueError("an outdated index record without token features") from None
            record = dataclasses.replace(self.record(key, old.namespace, TokenFeatures.from_bytes(tokens)),
                                         added_at=old.added_at)
            self.features.put(key, record.to_bytes(), tokens)
            return record

    def restore(self, records: list[IndexRecord]) -> None:
        """Index persisted records, leaving alone any key indexed since (its record is newer)."""
        self.index.add_many([r for r in records if r.key not in self.index])

    def _tokens(self, key: str) -> TokenFeatures | None:
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        if self.features is None:
            return None
        data = self.features.tokens(key)
        if data is None:
            self.index.remove(key)
            return None
        try:
            features = TokenFeatures.from_bytes(data)
        except ValueError:
            self.damaged_records += 1
            self.remove(key)
            return None
        self._remember(key, features)
        return features

    def _remember(self, key: str, features: TokenFeatures) -> None:
        previous = self._cache.pop(key, None)
        if previous is not None:
            self._cache_bytes -= previous.nbytes
        if features.nbytes > self.settings.feature_cache_bytes:
            return
        self._cache[key] = features
        self._cache_bytes += features.nbytes
        while self._cache_bytes > self.settings.feature_cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= evicted.nbytes


def compare(features: TokenFeatures, alias_features: TokenFeatures, settings: MatchSettings,
            moved: MovedImage | None = None) -> Alignment:
    """The fine stage for one candidate, as Matcher.lookup runs it: aligned in place, and where that is no match
    within the guard and the new image is given as ``moved``, moved back by part of a token if its content moved
    so; of the two, a match within the guard first, then the more similar."""
    alignment = in_place(features, alias_features, settings)
    if moved is None or _planned(alignment, settings):
        return alignment
    again = moved_alignment(features, alias_features, settings, moved)
    if again is None:
        return alignment
    return max(alignment, again, key=lambda a: (_planned(a, settings), a.similarity))


def within_guard(alignment: Alignment, settings: MatchSettings) -> bool:
    """The planner's guard (gateway/matching/plans.py): no more than max_changed_share of the tokens changed."""
    return alignment.changed_share <= settings.max_changed_share


def _planned(alignment: Alignment, settings: MatchSettings) -> bool:
    """Whether an alignment is a match the planner's guard would plan."""
    return alignment.similarity >= settings.match_threshold and within_guard(alignment, settings)


def _aligned(features: TokenFeatures, alias_features: TokenFeatures, shift: tuple[int, int],
             settings: MatchSettings, out_of_reach: np.ndarray | None = None) -> Alignment:
    return align(features, alias_features, shift=shift, patch_threshold=settings.patch_threshold,
                 max_shade_change=settings.max_shade_change, blank_entropy=settings.blank_entropy,
                 out_of_reach=out_of_reach)


def in_place(features: TokenFeatures, alias_features: TokenFeatures, settings: MatchSettings) -> Alignment:
    """The whole-token shift that best lines the alias up, then the alignment at it."""
    return _aligned(features, alias_features, find_shift(features, alias_features), settings)


def moved_alignment(features: TokenFeatures, alias_features: TokenFeatures, settings: MatchSettings,
                    moved: MovedImage) -> Alignment | None:
    """The alignment of the new image's content moved back by part of a token (gateway/matching/moved.py), when it
    moved so: as a whole, or else (no match within the guard that way) region by region; None when neither."""
    move = moved.find(features, alias_features)
    alignment = None
    if move is not None:
        alignment = moved_by(_aligned(moved.realigned(move.offset), alias_features, move.shift, settings), move.offset)
        if _planned(alignment, settings):
            return alignment
    regional = moved.find_regions(features, alias_features)
    if regional is None:
        return alignment
    out_of_reach = regional.out_of_reach_tokens(features.grid)
    if regional.moves:
        again = moved_by(_aligned(moved.realigned_regions(regional), alias_features, (0, 0), settings, out_of_reach),
                         regional.offset)
    else:  # only regions out of reach: the new image's own features, in place
        again = _aligned(features, alias_features, (0, 0), settings, out_of_reach)
    return again if alignment is None else max(alignment, again, key=lambda a: (_planned(a, settings), a.similarity))
