"""Image features kept beside the KV entries, so that a restarted gateway can rebuild its matching index.

One LMDB environment with two databases, both keyed by the entry's key:

    index   the small record the gateway's index holds in memory for every entry (its namespace, grid and coarse
            descriptors); read in full when the index is rebuilt
    tokens  the per-token features of the entry (digests, descriptor vectors, entropy), read for the few
            candidates a lookup compares in full

Records are opaque bytes to the store (the gateway's ``gateway.matching`` defines them). A record whose KV entry
is gone is harmless: the gateway checks the KV store before it uses one, and removes records it finds orphaned.

Threading: every call takes one lock and copies what it reads, so no read transaction outlives a call and the map
can grow (doubling, up to max_map_size) whenever a write needs room. One process opens one FeatureStore per path
(an LMDB rule): the gateway's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import lmdb

from store.base import validate_key
from store.errors import StoreClosedError, StoreError
from store.lmdb_tier import FOLDER_MODE, grown_map_size, private_lmdb_folder

T = TypeVar("T")
INDEX_DB, TOKENS_DB = b"index", b"tokens"


class FeatureStore:
    def __init__(self, path: Path, *, map_size: int = 1 << 30, max_map_size: int = 1 << 40,
                 sync: bool = True) -> None:
        self.path = Path(path)
        self._max_map_size = max_map_size
        self._lock = threading.Lock()
        self._closed = False
        try:
            private_lmdb_folder(self.path)  # the features are close to a thumbnail of every image
            self._env = lmdb.open(str(self.path), map_size=map_size, max_dbs=2, sync=sync, subdir=True,
                                  mode=FOLDER_MODE)
            self._index = self._env.open_db(INDEX_DB)
            self._tokens = self._env.open_db(TOKENS_DB)
        except (OSError, lmdb.Error) as exc:
            raise StoreError(f"cannot open the feature store at {self.path}: {exc}") from exc

    def put(self, key: str, index_record: bytes, tokens: bytes) -> None:
        """Store both records of key in one transaction (replacing any earlier ones)."""
        key_b = validate_key(key).encode()

        def write(txn: lmdb.Transaction) -> None:
            txn.put(key_b, index_record, db=self._index)
            txn.put(key_b, tokens, db=self._tokens)

        self._write(write, needed=len(index_record) + len(tokens))

    def tokens(self, key: str) -> bytes | None:
        """The per-token record of key (a copy), or None."""
        key_b = validate_key(key).encode()
        return self._read(lambda txn: _copy(txn.get(key_b, db=self._tokens)))

    def index_record(self, key: str) -> bytes | None:
        key_b = validate_key(key).encode()
        return self._read(lambda txn: _copy(txn.get(key_b, db=self._index)))

    def remove(self, key: str) -> bool:
        """Drop both records of key; False when there were none."""
        key_b = validate_key(key).encode()

        def delete(txn: lmdb.Transaction) -> bool:
            return bool(txn.delete(key_b, db=self._tokens) | txn.delete(key_b, db=self._index))

        return bool(self._write(delete))

    def index_records(self) -> Iterator[tuple[str, bytes]]:
        """Every (key, index record), read in one snapshot (the records are small)."""
        def collect(txn: lmdb.Transaction) -> list[tuple[str, bytes]]:
            return [(bytes(k).decode(), bytes(v)) for k, v in txn.cursor(db=self._index)]

        return iter(self._read(collect))

    def __len__(self) -> int:
        return int(self._read(lambda txn: txn.stat(self._index)["entries"]))

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._env.close()

    def _read(self, use: Callable[[lmdb.Transaction], T]) -> T:
        with self._lock:
            self._check_open()
            try:
                with self._env.begin() as txn:
                    return use(txn)
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)  # another process grew it: adopt its size, then read again
                with self._env.begin() as txn:
                    return use(txn)

    def _write(self, change: Callable[[lmdb.Transaction], T], *, needed: int = 0) -> T:
        with self._lock:
            while True:
                self._check_open()
                try:
                    with self._env.begin(write=True) as txn:
                        return change(txn)
                except lmdb.MapFullError:
                    self._env.set_mapsize(grown_map_size(self._env.info()["map_size"], needed, factor=2.0,
                                                         maximum=self._max_map_size, path=self.path))
                except lmdb.MapResizedError:
                    self._env.set_mapsize(0)
                except lmdb.Error as exc:
                    raise StoreError(f"{self.path}: write failed: {exc}") from exc

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.path} is closed")

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy(value: bytes | memoryview | None) -> bytes | None:
    return None if value is None else bytes(value)
