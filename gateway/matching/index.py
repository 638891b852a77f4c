"""The approximate-match index: which cached images a new image might be a near-duplicate of.

Per cache namespace (so a lookup never sees another tenant's images), two ways in:

    coarse   per token grid, every entry's 2 x 2 regional descriptors (gateway.matching.features). An entry passes
             when every region's cosine with the query's is above ``coarse_threshold``; the best ``candidates`` by
             mean regional cosine are kept. Up to ``scan_limit`` entries of one grid this is a matrix product over
             all of them; past it, an HNSW graph (usearch) finds the best 64 first
    sketch   every entry's ``SKETCH`` smallest token digests among its non-blank tokens. A query that shares several
             of them with an entry is a candidate whatever its grid: a page scrolled by whole tokens, a crop along
             token boundaries, keep most token digests where the coarse descriptors may not say so

The index holds only these small records in memory; the per-token features of a candidate are read from the
feature store when the fine stage compares them (gateway.matching.matcher). Threading: the cache thread's, like
the policy (no locking).
"""

from __future__ import annotations

import struct
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from gateway.matching.features import TokenFeatures

SKETCH = 32  # digests per entry in the sketch
SKETCH_VOTES = 3  # shared digests that make an entry a candidate (all of a shorter sketch)
_TAIL = 4096  # sketch postings kept unsorted before a merge
_RECORD = struct.Struct("<BHHHHHHd")  # version, namespace and scope lengths, grid, dim, sketch length, added_at
# Version 2: the regional descriptors are of the token layouts (features.token_layout); a version 1 record's, of the
# extractor's vectors, is outdated: its image is indexed again from its token features (Matcher.persisted).
_RECORD_VERSION = 2


class OutdatedRecord(ValueError):
    """An index record of an earlier version (``record``: what it says, its regional descriptors aside), whose image
    can be indexed again from its token features."""

    def __init__(self, record: IndexRecord) -> None:
        super().__init__("index record of an earlier version")
        self.record = record


@dataclass(frozen=True, eq=False)
class IndexRecord:
    """What the index keeps of one entry, and what the feature store's index database holds for it."""

    key: str
    namespace: str
    scope: str  # the model, processor settings and extractor the features belong to
    grid: tuple[int, int]
    regional: np.ndarray  # (4, dim) float32, unit rows
    sketch: tuple[int, ...]
    added_at: float  # unix time

    @classmethod
    def of(cls, key: str, namespace: str, scope: str, features: TokenFeatures, *, blank_entropy: float) -> \
            IndexRecord:
        informative = features.digests[features.entropy.astype(np.float32) > blank_entropy]
        sketch = tuple(int(d) for d in np.unique(informative)[:SKETCH])
        return cls(key=key, namespace=namespace, scope=scope, grid=features.grid, regional=features.regional(),
                   sketch=sketch, added_at=time.time())

    def to_bytes(self) -> bytes:
        namespace, scope = self.namespace.encode(), self.scope.encode()
        head = _RECORD.pack(_RECORD_VERSION, len(namespace), len(scope), self.grid[0], self.grid[1],
                            self.regional.shape[1], len(self.sketch), self.added_at)
        return b"".join((head, namespace, scope, np.asarray(self.sketch, "<u8").tobytes(),
                         self.regional.astype("<f4").tobytes()))

    @classmethod
    def from_bytes(cls, key: str, data: bytes) -> IndexRecord:
        """Raises ValueError for a damaged record, OutdatedRecord (a ValueError) for one of an earlier version."""
        try:
            version, ns_len, scope_len, rows, cols, dim, sketch_len, added_at = _RECORD.unpack_from(data)
            if version not in (1, _RECORD_VERSION):
                raise ValueError(f"version {version}")
            at = _RECORD.size
            namespace = data[at:at + ns_len].decode()
            scope = data[at + ns_len:at + ns_len + scope_len].decode()
            at += ns_len + scope_len
            if len(data) != at + 8 * sketch_len + 16 * dim or min(rows, cols, dim) < 1:
                raise ValueError("wrong length")
            sketch = tuple(np.frombuffer(data, "<u8", sketch_len, at).tolist())
            regional = np.frombuffer(data, "<f4", 4 * dim, at + 8 * sketch_len).reshape(4, dim).astype(np.float32)
        except (struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"damaged index record: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"damaged index record: {exc}") from None
        record = cls(key=key, namespace=namespace, scope=scope, grid=(rows, cols), regional=regional, sketch=sketch,
                     added_at=added_at)
        if version != _RECORD_VERSION:
            raise OutdatedRecord(record)
        return record


class CoarseTable:
    """The regional descriptors of one (namespace, grid): an exact scan while small, an HNSW graph when large."""

    def __init__(self, dim: int, *, scan_limit: int) -> None:
        self.dim = dim
        self.scan_limit = scan_limit
        self._keys: list[str] = []
        self._rows: dict[str, int] = {}
        self._matrix = np.zeros((0, 4 * dim), np.float32)  # (entries, 4 * dim), one row per entry
        self._graph: Any = None  # a usearch Index once past scan_limit
        self._ids: dict[str, int] = {}
        self._by_id: dict[int, str] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._by_id) if self._graph is not None else len(self._keys)

    @property
    def uses_graph(self) -> bool:
        return self._graph is not None

    def graph_bytes(self) -> int:
        """What the HNSW graph holds in native memory (0 while scanning)."""
        return int(self._graph.memory_usage) if self._graph is not None else 0

    def add(self, key: str, regional: np.ndarray) -> None:
        row = (regional.astype(np.float32) / 2).reshape(-1)  # four unit halves: a unit row, inner = mean cosine
        self.remove(key)
        if self._graph is not None:
            self._add_to_graph([key], row[None])
            return
        n = len(self._keys)
        if n == self._matrix.shape[0]:  # grow geometrically
            grown = np.zeros((max(256, 2 * n), 4 * self.dim), np.float32)
            grown[:n] = self._matrix
            self._matrix = grown
        self._matrix[n] = row
        self._rows[key] = n
        self._keys.append(key)
        if len(self._keys) > self.scan_limit:
            self._switch_to_graph()

    def add_many(self, keys: list[str], regionals: np.ndarray) -> None:
        """add() for many new keys at once (the graph takes them in one parallel batch)."""
        for key in keys:
            self.remove(key)
        if self._graph is None and len(self._keys) + len(keys) > self.scan_limit:
            self._switch_to_graph()
        if self._graph is not None:
            self._add_to_graph(keys, (regionals.astype(np.float32) / 2).reshape(len(keys), -1))
            return
        for key, regional in zip(keys, regionals, strict=True):
            self.add(key, regional)

    def remove(self, key: str) -> bool:
        if self._graph is not None:
            ident = self._ids.pop(key, None)
            if ident is None:
                return False
            del self._by_id[ident]
            self._graph.remove(ident)
            return True
        row = self._rows.pop(key, None)
        if row is None:
            return False
        last = len(self._keys) - 1
        if row != last:  # move the last entry into the hole
            moved = self._keys[last]
            self._keys[row] = moved
            self._rows[moved] = row
            self._matrix[row] = self._matrix[last]
        self._keys.pop()
        return True

    def search(self, regional: np.ndarray, *, threshold: float, count: int) -> list[tuple[str, float]]:
        """The best ``count`` entries whose every regional cosine exceeds threshold, by mean cosine, best first."""
        query = (regional.astype(np.float32) / 2).reshape(-1)
        if self._graph is not None:
            matches = self._graph.search(query, max(64, 8 * count))
            idents = [int(i) for i in matches.keys if int(i) in self._by_id]
            if not idents:
                return []
            keys = [self._by_id[i] for i in idents]
            rows = np.asarray(self._graph.get(np.asarray(idents, np.uint64)), np.float32).reshape(len(idents), -1)
        else:
            n = len(self._keys)
            if n == 0:
                return []
            scores = self._matrix[:n] @ query
            best = np.argsort(-scores)[: max(64, 8 * count)]
            keys = [self._keys[i] for i in best]
            rows = self._matrix[best]
        per_region = 4 * np.einsum("krd,rd->kr", rows.reshape(len(keys), 4, self.dim), query.reshape(4, self.dim))
        passed = [(key, float(cos.mean())) for key, cos in zip(keys, per_region, strict=True)
                  if (cos > threshold).all()]
        passed.sort(key=lambda item: -item[1])
        return passed[:count]

    def _switch_to_graph(self) -> None:
        from usearch.index import Index

        # expansion_search 256: the nearest of 100k random descriptors found 99% of the time (96% at 128)
        self._graph = Index(ndim=4 * self.dim, metric="ip", dtype="f16", connectivity=16, expansion_add=64,
                            expansion_search=256)
        keys, rows = list(self._keys), self._matrix[: len(self._keys)]
        self._keys, self._rows, self._matrix = [], {}, np.zeros((0, 4 * self.dim), np.float32)
        self._add_to_graph(keys, rows)

    def _add_to_graph(self, keys: list[str], rows: np.ndarray) -> None:
        assert self._graph is not None
        idents = np.arange(self._next_id, self._next_id + len(keys), dtype=np.uint64)
        self._next_id += len(keys)
        for key, ident in zip(keys, idents.tolist(), strict=True):
            self._ids[key] = ident
            self._by_id[ident] = key
        self._graph.add(idents, rows)


class SketchTable:
    """Every entry's sketch digests of one namespace as two arrays sorted by digest (16 bytes a posting, not a
    Python set per digest), with a short unsorted tail of recent additions merged in (one sorted insert, linear
    in the table) when it grows past _TAIL. Removed entries leave postings behind until they outnumber the live
    entries' and a compaction drops them."""

    def __init__(self) -> None:
        self._digests = np.zeros(0, np.uint64)  # sorted
        self._ids = np.zeros(0, np.int64)
        self._tail_digests: list[int] = []
        self._tail_ids: list[int] = []
        self._keys: dict[int, str] = {}  # live entry id -> key
        self._dead = 0
        self._next_id = 0

    def add(self, key: str, sketch: tuple[int, ...]) -> int:
        ident = self._next_id
        self._next_id += 1
        self._keys[ident] = key
        self._tail_digests += sketch
        self._tail_ids += [ident] * len(sketch)
        if len(self._tail_digests) > _TAIL:
            self._merge()
        return ident

    def remove(self, ident: int) -> None:
        if self._keys.pop(ident, None) is not None:
            self._dead += 1
            if self._dead > len(self._keys):
                self._compact()

    def __len__(self) -> int:
        return len(self._keys)

    def votes(self, sketch: tuple[int, ...]) -> Counter[str]:
        """How many of the sketch's digests each live entry shares."""
        self._merge()
        query = np.asarray(sketch, np.uint64)
        lo, hi = np.searchsorted(self._digests, query, "left"), np.searchsorted(self._digests, query, "right")
        ids = [self._ids[a:b] for a, b in zip(lo.tolist(), hi.tolist(), strict=True) if b > a]
        found = np.concatenate(ids).tolist() if ids else []
        return Counter(self._keys[i] for i in found if i in self._keys)

    def _merge(self) -> None:
        if not self._tail_digests:
            return
        digests = np.asarray(self._tail_digests, np.uint64)
        order = np.argsort(digests, kind="stable")
        digests, ids = digests[order], np.asarray(self._tail_ids, np.int64)[order]
        at = np.searchsorted(self._digests, digests)
        self._digests, self._ids = np.insert(self._digests, at, digests), np.insert(self._ids, at, ids)
        self._tail_digests, self._tail_ids = [], []

    def _compact(self) -> None:
        self._merge()
        live = np.isin(self._ids, np.fromiter(self._keys, np.int64, len(self._keys)))
        self._digests, self._ids, self._dead = self._digests[live], self._ids[live], 0


class Indexed(NamedTuple):
    """What the index remembers of an entry besides its descriptors and sketch (which its tables hold)."""

    namespace: str
    grid: tuple[int, int]
    added_at: float


class MatchIndex:
    """Every indexed entry, per namespace; see the module docstring."""

    def __init__(self, *, coarse_threshold: float, candidates: int, scan_limit: int) -> None:
        self.coarse_threshold = coarse_threshold
        self.candidates = candidates
        self.scan_limit = scan_limit
        self._records: dict[str, Indexed] = {}
        self._tables: dict[tuple[str, tuple[int, int]], CoarseTable] = {}
        self._sketches: dict[str, SketchTable] = {}
        self._sketch_ids: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def get(self, key: str) -> Indexed | None:
        return self._records.get(key)

    def add(self, record: IndexRecord) -> None:
        self.remove(record.key)
        self._records[record.key] = Indexed(record.namespace, record.grid, record.added_at)
        table = self._tables.get((record.namespace, record.grid))
        if table is None:
            table = self._tables[(record.namespace, record.grid)] = CoarseTable(record.regional.shape[1],
                                                                                 scan_limit=self.scan_limit)
        table.add(record.key, record.regional)
        self._sketch_ids[record.key] = self._sketches.setdefault(record.namespace, SketchTable()).add(
            record.key, record.sketch)

    def add_many(self, records: list[IndexRecord]) -> None:
        """add() for many records (rebuilding after a restart): each grid's descriptors in one batch."""
        by_table: dict[tuple[str, tuple[int, int]], list[IndexRecord]] = {}
        for record in records:
            self.remove(record.key)
            self._records[record.key] = Indexed(record.namespace, record.grid, record.added_at)
            by_table.setdefault((record.namespace, record.grid), []).append(record)
            self._sketch_ids[record.key] = self._sketches.setdefault(record.namespace, SketchTable()).add(
                record.key, record.sketch)
        for (namespace, grid), group in by_table.items():
            table = self._tables.get((namespace, grid))
            if table is None:
                table = self._tables[(namespace, grid)] = CoarseTable(group[0].regional.shape[1],
                                                                      scan_limit=self.scan_limit)
            table.add_many([r.key for r in group], np.stack([r.regional for r in group]))

    def remove(self, key: str) -> bool:
        record = self._records.pop(key, None)
        if record is None:
            return False
        table = self._tables[(record.namespace, record.grid)]
        table.remove(key)
        if not len(table):
            del self._tables[(record.namespace, record.grid)]
        sketches = self._sketches[record.namespace]
        sketches.remove(self._sketch_ids.pop(key))
        if not len(sketches):
            del self._sketches[record.namespace]
        return True

    def lookup(self, namespace: str, query: IndexRecord) -> list[str]:
        """Candidate keys for a query (an IndexRecord of the new image, not added), most promising first: the
        coarse stage's, then entries sharing at least SKETCH_VOTES sketch digests (or all of a shorter sketch)."""
        found: list[str] = []
        table = self._tables.get((namespace, query.grid))
        if table is not None:
            found = [key for key, _ in table.search(query.regional, threshold=self.coarse_threshold,
                                                    count=self.candidates)]
        sketches = self._sketches.get(namespace)
        if sketches and query.sketch:
            votes = sketches.votes(query.sketch)
            needed = min(SKETCH_VOTES, len(query.sketch))
            shared = [key for key, n in votes.most_common() if n >= needed and key not in found]
            found += shared[: self.candidates]
        return [key for key in found if key != query.key]


