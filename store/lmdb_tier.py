"""L3: one LMDB environment on SSD. Values are whole entries; LMDB transactions make every put atomic."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import lmdb

from settings.folders import FOLDER_MODE, make_private_folder, tighten
from store.base import BufferTier, EntryLike, StoreStats, entry_bytes, opened, validate_key
from store.errors import EntryPinnedError, StoreClosedError, StoreError, StoreFullError
from store.seal import PUBLIC, EntrySeal

T = TypeVar("T")

ENTRIES_DB = b"entries"  # key (64 hex chars, ascii) -> entry bytes
PINS_DB = b"pins"  # key -> b"" while the entry is pinned
# lmdb.open(mode=FOLDER_MODE): the folder's mode; its data and lock files get it less the execute bits (0600)


def private_lmdb_folder(path: Path) -> None:
    """Make ``path`` the folder of an LMDB environment only this user can read: created 0700 (missing parents as the
    umask says; open the environment with ``mode=FOLDER_MODE`` so its files are 0600). An existing one of this user's
    that others may read (earlier versions made it 0755, its files 0644) is tightened likewise; a symbolic link is
    followed (a folder put on another disk), and one of another user's is left as its owner made it. Raises
    OSError."""
    if make_private_folder(path):
        return
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or not st.st_mode & 0o077:
        return  # not a folder (lmdb.open says so), another user's, or private already
    tighten(path, ("data.mdb", "lock.mdb"))


def grown_map_size(current: int, needed: int, *, factor: float, maximum: int, path: Path) -> int:
    """The map size to grow an LMDB environment to when a write of `needed` bytes found it full. Raises
    StoreFullError at the maximum."""
    if current >= maximum:
        raise StoreFullError(f"{path}: map is at its maximum {maximum}")
    return min(max(int(current * factor), current + 2 * needed), maximum)


class LmdbTier(BufferTier):
    """Entries in one LMDB environment; any number of processes may open it and read concurrently.

    Reads are zero-copy: a handle holds an LMDB read transaction and its views point into LMDB's map. They stay
    valid until the handle is closed, whatever other writers do meanwhile (MVCC snapshot). Keep handles short: an
    open read transaction keeps the pages it sees from being reused, and the map cannot grow in this process while
    any handle is open (growth remaps; a put needing it waits up to grow_wait_s, then raises StoreFullError).
    close() with handles still open defers closing the environment until the last one is closed.

    The map starts at map_size and grows by growth_factor on MapFullError, up to max_map_size; processes that find
    the map grown by another adopt the new size.

    Cold reads: the LMDB binding touches every page of a value before returning it (so no page fault happens with
    the GIL held), so any read of an entry, sparse or not, brings the whole entry into the page cache. The kernel's
    readahead is therefore left on: it turns those faults into large sequential reads (a 160 MB entry read cold in
    about 50 ms instead of 1.7 s with readahead off, measured by bench/store_reads.py). Sparse reads save bytes
    and time once the entry is cached; cold, they cost what a full read costs.
    """

    name = "lmdb"

    def __init__(self, path: Path, *, map_size: int = 1 << 30, max_map_size: int = 1 << 40,
                 growth_factor: float = 2.0, max_readers: int = 1024, grow_wait_s: float = 5.0,
                 sync: bool = True, seal: EntrySeal = PUBLIC) -> None:
        self.path = Path(path)
        self.seal = seal
        self._max_map_size = max_map_size
        self._growth_factor = growth_factor
        self._grow_wait_s = grow_wait_s
        try:
            private_lmdb_folder(self.path)
            self._env = lmdb.open(str(self.path), map_size=map_size, max_dbs=2, max_readers=max_readers,
                                  readahead=True, sync=sync, subdir=True, mode=FOLDER_MODE)
            self._entries = self._env.open_db(ENTRIES_DB)
            self._pins = self._env.open_db(PINS_DB)
        except (OSError, lmdb.Error) as exc:
            raise StoreError(f"cannot open LMDB at {self.path}: {exc}") from exc
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self._readers = 0
        self._growing = False
        self._closed = False
        self._damaged = 0

    @property
    def map_size(self) -> int:
        return self._env.info()["map_size"]

    # --- read transactions, counted so the map is never remapped under a live view ---

    def _begin_read(self) -> tuple[lmdb.Transaction, Callable[[], None]]:
        while True:
            with self._cond:
                if self._closed:
                    raise StoreClosedError(f"{self.path} is closed")
                while self._growing:
                    self._cond.wait()
                self._readers += 1
            try:
                txn = self._env.begin(buffers=True)
            except lmdb.MapResizedError:
                self._end_read()
                with self._write_lock:  # set_mapsize must not race this process's write transaction
                    self._resize(0)
                continue
            except BaseException:
                self._end_read()
                raise
            return txn, self._releaser(txn)

    def _releaser(self, txn: lmdb.Transaction) -> Callable[[], None]:
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                txn.abort()
                self._end_read()

        return release

    def _end_read(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()
            if self._closed and self._readers == 0:
                self._env.close()

    def _resize(self, new_size: int) -> None:
        """set_mapsize(new_size) (0: adopt the size another process set) once this process has no read open."""
        with self._cond:
            self._growing = True
            try:
                if not self._cond.wait_for(lambda: self._readers == 0, timeout=self._grow_wait_s):
                    raise StoreFullError(f"{self.path}: map must grow but {self._readers} read handles stay open")
                self._env.set_mapsize(new_size)
            finally:
                self._growing = False
                self._cond.notify_all()

    def _read_txn(self, use: Callable[[lmdb.Transaction], T]) -> T:
        txn, release = self._begin_read()
        try:
            return use(txn)
        finally:
            release()

    # --- KVStore ---

    def contains(self, key: str) -> bool:
        key_b = validate_key(key).encode()
        return bool(self._read_txn(lambda txn: txn.get(key_b, db=self._entries) is not None))

    def put(self, key: str, entry: EntryLike) -> int:
        key_b = validate_key(key).encode()
        data = entry_bytes(entry, key, self.seal)
        self._write(lambda txn: txn.put(key_b, data, db=self._entries), needed=data.nbytes)
        return data.nbytes

    def _write(self, change: Callable[[lmdb.Transaction], object], *, needed: int = 0) -> object:
        """Run change in one write transaction, growing or adopting a grown map and retrying as needed."""
        with self._write_lock:
            while True:
                self._check_open()
                try:
                    with self._env.begin(write=True) as txn:
                        return change(txn)
                except lmdb.MapFullError:
                    self._resize(self._grown_size(needed))
                except lmdb.MapResizedError:
                    self._resize(0)
                except lmdb.Error as exc:
                    raise StoreError(f"{self.path}: write failed: {exc}") from exc

    def _grown_size(self, needed: int) -> int:
        return grown_map_size(self.map_size, needed, factor=self._growth_factor, maximum=self._max_map_size,
                              path=self.path)

    def _read(self, key, opener):
        key_b = validate_key(key).encode()
        txn, release = self._begin_read()

        def read():
            value = txn.get(key_b, db=self._entries)
            if value is None:
                release()
                return None
            return opener(memoryview(value), release)

        return opened(read, release, self._count_damaged)

    def _count_damaged(self) -> None:
        with self._cond:
            self._damaged += 1

    def remove(self, key: str, *, force: bool = False) -> bool:
        key_b = validate_key(key).encode()

        def delete(txn: lmdb.Transaction) -> bool:
            if not force and txn.get(key_b, db=self._pins) is not None:
                raise EntryPinnedError(f"{key} is pinned")
            txn.delete(key_b, db=self._pins)
            return txn.delete(key_b, db=self._entries)

        return bool(self._write(delete))

    def pin(self, key: str) -> bool:
        key_b = validate_key(key).encode()

        def mark(txn: lmdb.Transaction) -> bool:
            return txn.get(key_b, db=self._entries) is not None and txn.put(key_b, b"", db=self._pins)

        return bool(self._write(mark))

    def unpin(self, key: str) -> bool:
        key_b = validate_key(key).encode()
        return bool(self._write(lambda txn: txn.delete(key_b, db=self._pins)))

    def is_pinned(self, key: str) -> bool:
        key_b = validate_key(key).encode()
        return bool(self._read_txn(lambda txn: txn.get(key_b, db=self._pins) is not None))

    def keys(self) -> Iterator[str]:
        def collect(txn: lmdb.Transaction) -> list[str]:
            return [bytes(k).decode() for k in txn.cursor(db=self._entries).iternext(values=False)]

        return iter(self._read_txn(collect))

    def size_of(self, key: str) -> int | None:
        key_b = validate_key(key).encode()

        def size(txn: lmdb.Transaction) -> int | None:
            value = txn.get(key_b, db=self._entries)
            return None if value is None else len(value)

        return self._read_txn(size)

    def stats(self) -> StoreStats:
        def count(txn: lmdb.Transaction) -> tuple[int, int, int]:
            sizes = [len(v) for v in txn.cursor(db=self._entries).iternext(keys=False)]
            return len(sizes), sum(sizes), txn.stat(self._pins)["entries"]

        entries, total, pinned = self._read_txn(count)
        return StoreStats(entries=entries, bytes=total, capacity_bytes=self._max_map_size, pinned=pinned,
                          damaged_reads=self._damaged)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.path} is closed")

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if self._readers == 0:
                self._env.close()
