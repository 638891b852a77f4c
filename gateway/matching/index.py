"""The approximate-match index: which cached images a new image might be a near-duplicate of.

Per cache namespace (so a lookup never sees another tenant's images), two ways in:

    coarse   per token grid, every entry's 2 x 2 regional descriptors (gateway.matching.features). An entry passes
             when every region's cosine with the query's is above ``coarse_threshold``; the best ``candidates`` by
             mean regional cosine are kept. Below ``scan_limit`` entries of one grid this is a matrix product over
             all of them; above, an HNSW graph (usearch) finds the best few hundred first
    sketch   every entry's ``SKETCH`` smallest token digests among its non-blank tokens. A query that shares several
             of them with an entry is a candidate whatever its grid: a page scrolled by whole tokens, a crop along
             token boundaries, keep most token digests where the coarse descriptors may not say so

The index holds only these small records in memory; the per-token features of a candidate are read from the
feature store when the fine stage compares them (gateway.matching.matcher). Threading: the cache thread's, like
the policy (no locking).
"""

from __future__ import annotations

import json
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
_HEAD = struct.Struct("<I")


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
        meta = json.dumps({"namespace": self.namespace, "scope": self.scope, "grid": list(self.grid),
                           "dim": int(self.regional.shape[1]), "sketch": [str(d) for d in self.sketch],
                           "added_at": self.added_at}, separators=(",", ":")).encode()
        return _HEAD.pack(len(meta)) + meta + self.regional.astype("<f4").tobytes()

    @classmethod
    def from_bytes(cls, key: str, data: bytes) -> IndexRecord:
        """Raises ValueError for a damaged record."""
        try:
            (length,) = _HEAD.unpack_from(data)
            meta = json.loads(data[_HEAD.size:_HEAD.size + length])
            dim = int(meta["dim"])
            regional = np.frombuffer(data, "<f4", 4 * dim, _HEAD.size + length).reshape(4, dim).astype(np.float32)
            return cls(key=key, namespace=str(meta["namespace"]), scope=str(meta["scope"]),
                       grid=(int(meta["grid"][0]), int(meta["grid"][1])), regional=regional,
                       sketch=tuple(int(d) for d in meta["sketch"]), added_at=float(meta["added_at"]))
        except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"damaged index record: {exc}") from None


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

        self._graph = Index(ndim=4 * self.dim, metric="ip", dtype="f16", connectivity=16, expansion_add=128,
                            expansion_search=128)
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
    Python set per digest), with a short unsorted tail of recent additions merged in when it grows. Removed entries
    leave postings behind until the next merge drops them."""

    def __init__(self) -> None:
        self._digests = np.zeros(0, np.uint64)  # sorted
        self._ids = np.zeros(0, np.int64)
        self._tail: list[tuple[int, int]] = []
        self._keys: dict[int, str] = {}  # live entry id -> key
        self._next_id = 0

    def add(self, key: str, sketch: tuple[int, ...]) -> int:
        ident = self._next_id
        self._next_id += 1
        self._keys[ident] = key
        self._tail += [(digest, ident) for digest in sketch]
        if len(self._tail) > _TAIL:
            self._merge()
        return ident

    def remove(self, ident: int) -> None:
        self._keys.pop(ident, None)

    def __len__(self) -> int:
        return len(self._keys)

    def votes(self, sketch: tuple[int, ...]) -> Counter[str]:
        """How many of the sketch's digests each live entry shares."""
        query = np.asarray(sketch, np.uint64)
        lo, hi = np.searchsorted(self._digests, query, "left"), np.searchsorted(self._digests, query, "right")
        hits = [self._ids[a:b] for a, b in zip(lo.tolist(), hi.tolist(), strict=True) if b > a]
        wanted = set(sketch)
        hits.append(np.asarray([ident for digest, ident in self._tail if digest in wanted], np.int64))
        ids = np.concatenate(hits) if hits else np.zeros(0, np.int64)
        return Counter(self._keys[i] for i in ids.tolist() if i in self._keys)

    def nbytes(self) -> int:
        return self._digests.nbytes + self._ids.nbytes + 16 * len(self._tail)

    def _merge(self) -> None:
        tail = np.asarray(self._tail, np.uint64).reshape(-1, 2)
        digests = np.concatenate([self._digests, tail[:, 0]])
        ids = np.concatenate([self._ids, tail[:, 1].astype(np.int64)])
        live = np.isin(ids, np.fromiter(self._keys, np.int64, len(self._keys)))
        order = np.argsort(digests[live], kind="stable")
        self._digests, self._ids, self._tail = digests[live][order], ids[live][order], []


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


