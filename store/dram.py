"""L2: DRAM shared by the processes of one host: one file per entry in a shared-memory directory, read via mmap.

Directory layout (default /dev/shm/revisit-store-<name>):
    <key>.kv                          a complete entry (entry.py layout)
    <key>.pin                         empty; present while the entry is pinned
    .tmp.<pid>.<key>.<random>         a put in progress; renamed onto <key>.kv when complete

The directory is this user's alone (0700, files 0600): the entries are every tenant's KV, and its default path is
predictable in a folder every local user may write to. An existing directory is used only if it is a real directory
(not a symbolic link) owned by this effective uid that neither group nor others may write to; one of an earlier
version, readable by others, is tightened (settings/folders.py). Every process of the store (gateway, workers) runs
as the same user.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from settings.folders import FILE_MODE, private_folder
from store.base import BufferTier, EntryLike, StoreStats, entry_bytes, opened, validate_key
from store.errors import EntryPinnedError, StoreClosedError, StoreError, StoreFullError
from store.seal import PUBLIC, EntrySeal
from store.views import release_view

ENTRY_SUFFIX = ".kv"
PIN_SUFFIX = ".pin"
TEMP_PREFIX = ".tmp."
STALE_TEMP_AGE_S = 3600.0
_CUDA_HOST_REGISTER_PORTABLE = 0x01
_CUDA_HOST_REGISTER_READ_ONLY = 0x08


class DramTier(BufferTier):
    """Entries as files in a tmpfs directory (one host); every reader maps them, nobody copies on read.

    Buffers returned by get/get_sparse are views of a read-only shared mapping of the file. They stay valid until
    the handle is closed, even if another process removes or replaces the entry meanwhile (remove unlinks, put
    renames a new file over the name; a mapped file is never modified in place by the store; something outside the
    store that truncates a mapped file makes readers of the lost pages fault with SIGBUS).

    Mapping cache: mapping a file costs a page-table entry per 4 KiB page (about 17 ms for 160 MB, three times the
    checksum pass), so each process keeps the mappings it made, up to mapping_cache_bytes, least recently used
    going first, and later reads of the same file reuse them (every read still verifies the bytes). A cached
    mapping belongs to one file (device, inode, size): a put that replaced the entry is seen by the next read, which
    maps the new file. A mapping of a removed or replaced file keeps that file's memory allocated, so stale
    mappings are dropped by this process's own put/remove at once and by a sweep (a stat per cached entry) at most
    every sweep_interval_s while the tier is being read. mapping_cache_bytes=0 maps and unmaps on every read.

    Page-locking: when CUDA is available and pin_host_memory is set, each mapping is registered with
    cudaHostRegister (read-only, portable) once, for the life of the mapping, so host-to-device copies from it are
    DMA without staging; on CPU-only hosts nothing is registered. When the driver refuses, the mapping is served
    unlocked and host_register_failures counts it (page_locks tells whether it is attempted).

    Capacity: stats() reports bytes in the directory; if capacity_bytes > 0, put() raises StoreFullError past it
    (checked, not reserved: concurrent writers in several processes may overshoot). The store never evicts.
    """

    name = "dram"

    def __init__(self, path: Path, *, capacity_bytes: int = 0, pin_host_memory: bool = True,
                 mapping_cache_bytes: int = 8 << 30, sweep_interval_s: float = 1.0, seal: EntrySeal = PUBLIC) -> None:
        self.path = Path(path)
        self.seal = seal
        self.capacity_bytes = capacity_bytes
        _private_store_folder(self.path)
        self._lock = threading.Lock()
        self._damaged = 0
        self.host_register_failures = 0
        self._closed = False
        self._cudart = _cudart() if pin_host_memory else None
        self._mappings = _MappingCache(mapping_cache_bytes, sweep_interval_s, self._entry_path, self._unregister)
        self.removed_stale_temps = self._remove_stale_temps()

    @property
    def page_locks(self) -> bool:
        """Whether mappings handed out are registered with cudaHostRegister (CUDA present and asked for)."""
        return self._cudart is not None

    def _entry(self, key: str) -> Path:
        self._check_open()
        return self._entry_path(validate_key(key))

    def _entry_path(self, key: str) -> Path:
        return self.path / (key + ENTRY_SUFFIX)

    def _pin(self, key: str) -> Path:
        return self.path / (key + PIN_SUFFIX)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.path} is closed")

    def _remove_stale_temps(self) -> int:
        """Delete temp files of writers that died mid-put (their pid is gone) or that are very old."""
        removed = 0
        for child in self.path.iterdir():
            if not child.name.startswith(TEMP_PREFIX):
                continue
            pid_text = child.name[len(TEMP_PREFIX) :].split(".", 1)[0]
            try:
                age = time.time() - child.stat().st_mtime
                if not _pid_alive(int(pid_text)) or age > STALE_TEMP_AGE_S:
                    child.unlink()
                    removed += 1
            except (FileNotFoundError, ValueError):
                continue
        return removed

    def contains(self, key: str) -> bool:
        return self._entry(key).exists()

    def put(self, key: str, entry: EntryLike) -> int:
        target = self._entry(key)
        data = entry_bytes(entry, key, self.seal)
        if self.capacity_bytes:
            replaced = self.size_of(key) or 0
            if self.stats().bytes - replaced + data.nbytes > self.capacity_bytes:
                raise StoreFullError(f"{self.path}: {data.nbytes} bytes would exceed {self.capacity_bytes}")
        temp = self.path / f"{TEMP_PREFIX}{os.getpid()}.{key}.{secrets.token_hex(4)}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            with open(fd, "wb", closefd=True) as f:
                f.write(data)
            os.replace(temp, target)
            self._mappings.forget(key)
        except BaseException as exc:
            temp.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFullError(f"{self.path}: {exc}") from exc
            if isinstance(exc, OSError):
                raise StoreError(f"{self.path}: {exc}") from exc
            raise
        return data.nbytes

    def _map(self, key: str) -> tuple[memoryview, Callable[[], None]] | None:
        path = self._entry(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._mappings.forget(key)
            return None
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                self._count_damaged()
                return None
            return self._mappings.acquire(key, (st.st_dev, st.st_ino, st.st_size), lambda: self._new_mapping(fd))
        finally:
            os.close(fd)

    def _new_mapping(self, fd: int) -> _Mapping:
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        return _Mapping(mapping, self._register(mapping, size))

    def _register(self, mapping: mmap.mmap, size: int) -> int | None:
        if self._cudart is None:
            return None
        address = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
        flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_READ_ONLY
        status = self._cudart.cudaHostRegister(address, size, flags)
        if int(getattr(status, "value", status)) == 0:
            return address
        with self._lock:
            self.host_register_failures += 1
        return None

    def _unregister(self, address: int) -> None:
        assert self._cudart is not None  # only registered mappings are unregistered
        self._cudart.cudaHostUnregister(address)

    def _read(self, key, opener):
        mapped = self._map(key)
        if mapped is None:
            return None
        view, release = mapped
        return opened(lambda: opener(view, release), release, self._count_damaged)

    def _count_damaged(self) -> None:
        with self._lock:
            self._damaged += 1

    def remove(self, key: str, *, force: bool = False) -> bool:
        target = self._entry(key)
        if not force and self._pin(key).exists() and target.exists():
            raise EntryPinnedError(f"{key} is pinned")
        try:
            target.unlink()
        except FileNotFoundError:
            return False
        finally:
            self._pin(key).unlink(missing_ok=True)
            self._mappings.forget(key)
        return True

    def pin(self, key: str) -> bool:
        if not self._entry(key).exists():
            return False
        self._pin(key).touch(mode=FILE_MODE)
        return True

    def unpin(self, key: str) -> bool:
        self._entry(key)
        try:
            self._pin(key).unlink()
        except FileNotFoundError:
            return False
        return self.contains(key)

    def is_pinned(self, key: str) -> bool:
        return self._entry(key).exists() and self._pin(key).exists()

    def keys(self) -> Iterator[str]:
        self._check_open()
        for child in self.path.iterdir():
            if child.name.endswith(ENTRY_SUFFIX) and not child.name.startswith("."):
                yield child.name[: -len(ENTRY_SUFFIX)]

    def size_of(self, key: str) -> int | None:
        try:
            return self._entry(key).stat().st_size
        except FileNotFoundError:
            return None

    def written_at(self, key: str) -> float | None:
        """When the entry's file was last written here (a worker's put, or a move up from a slower tier: its
        last use, in effect); None when absent. What a restarted gateway orders its books by."""
        try:
            return self._entry(key).stat().st_mtime
        except FileNotFoundError:
            return None

    def stats(self) -> StoreStats:
        self._check_open()
        entries = total = pinned = 0
        names = {child.name for child in self.path.iterdir()}
        for name in names:
            if name.endswith(ENTRY_SUFFIX) and not name.startswith("."):
                try:
                    total += (self.path / name).stat().st_size
                except FileNotFoundError:
                    continue
                entries += 1
                pinned += name[: -len(ENTRY_SUFFIX)] + PIN_SUFFIX in names
        return StoreStats(entries=entries, bytes=total, capacity_bytes=self.capacity_bytes, pinned=pinned,
                          damaged_reads=self._damaged)

    def close(self) -> None:
        """Later calls raise StoreClosedError; cached mappings go once no handle uses them."""
        self._closed = True
        self._mappings.clear()

    @property
    def mapping_cache_stats(self) -> dict[str, int]:
        """This process's cached mappings: entries, bytes, and reads served from the cache (hits) or not (misses)."""
        return self._mappings.stats()


class _Mapping:
    """One mmap of one entry file, shared by the read handles over it; closed when uncached and unused."""

    def __init__(self, mapping: mmap.mmap, address: int | None) -> None:
        self.mapping = mapping
        self.address = address  # the cudaHostRegister'ed address, or None
        self.ident: tuple[int, int, int] = (0, 0, 0)
        self.users = 0
        self.cached = False

    @property
    def nbytes(self) -> int:
        return len(self.mapping)


class _MappingCache:
    """Per-process LRU of mappings by key, bounded in mapped bytes; see DramTier's docstring."""

    def __init__(self, capacity_bytes: int, sweep_interval_s: float, path_of: Callable[[str], Path],
                 unregister: Callable[[int], None]) -> None:
        self._capacity = capacity_bytes
        self._sweep_interval_s = sweep_interval_s
        self._path_of = path_of
        self._unregister = unregister
        self._lock = threading.Lock()
        self._by_key: OrderedDict[str, _Mapping] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = 0
        self._last_sweep = time.monotonic()

    def acquire(self, key: str, ident: tuple[int, int, int],
                create: Callable[[], _Mapping]) -> tuple[memoryview, Callable[[], None]]:
        """A view over the mapping of the file ident names (reusing a cached one) and its release function."""
        self._maybe_sweep()
        with self._lock:
            held = self._by_key.get(key)
            if held is not None and held.ident == ident:
                self._by_key.move_to_end(key)
                self._hits += 1
                return self._lend(held)
        mapping = create()  # outside the lock: mapping and page-locking take milliseconds
        mapping.ident = ident
        with self._lock:
            self._misses += 1
            self._drop(key)
            if 0 < mapping.nbytes <= self._capacity:
                mapping.cached = True
                self._by_key[key] = mapping
                self._bytes += mapping.nbytes
                while self._bytes > self._capacity:
                    self._drop(next(iter(self._by_key)))
            return self._lend(mapping)

    def _lend(self, held: _Mapping) -> tuple[memoryview, Callable[[], None]]:
        held.users += 1
        view = memoryview(held.mapping)
        done = False

        def release() -> None:
            nonlocal done
            release_view(view)
            with self._lock:
                if done:
                    return
                done = True
                held.users -= 1
                closing = held.users == 0 and not held.cached
            if closing:
                self._close(held)

        return view, release

    def forget(self, key: str) -> None:
        """Drop the cached mapping of key (the file was replaced or removed by this process)."""
        with self._lock:
            self._drop(key)

    def clear(self) -> None:
        with self._lock:
            for key in list(self._by_key):
                self._drop(key)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._by_key), "bytes": self._bytes, "hits": self._hits, "misses": self._misses}

    def _drop(self, key: str) -> None:
        """Uncache key's mapping (lock held); close it now if no handle uses it."""
        held = self._by_key.pop(key, None)
        if held is None:
            return
        held.cached = False
        self._bytes -= held.nbytes
        if held.users == 0:
            self._close(held)

    def _close(self, held: _Mapping) -> None:
        if held.address is not None:
            self._unregister(held.address)
            held.address = None
        try:
            held.mapping.close()
        except BufferError:
            pass  # numpy arrays made from a handle are alive; the mapping goes when they do

    def _maybe_sweep(self) -> None:
        """Drop mappings whose file another process removed or replaced (their memory stays allocated while
        mapped), at most once per sweep interval."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_sweep < self._sweep_interval_s or not self._by_key:
                return
            self._last_sweep = now
            cached = {key: held.ident for key, held in self._by_key.items()}
        stale = []
        for key, ident in cached.items():
            try:
                st = os.stat(self._path_of(key))
                if (st.st_dev, st.st_ino, st.st_size) != ident:
                    stale.append(key)
            except FileNotFoundError:
                stale.append(key)
        with self._lock:
            for key in stale:
                held = self._by_key.get(key)
                if held is not None and held.ident == cached[key]:
                    self._drop(key)


def _private_store_folder(path: Path) -> None:
    """The tier's folder made or checked private (settings/folders.py); StoreError when it cannot be."""
    try:
        private_folder(path, what="the DRAM store's folder")
    except PermissionError as exc:
        raise StoreError(str(exc)) from None
    except OSError as exc:
        raise StoreError(f"cannot use {path} as the DRAM store's folder: {exc}") from exc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cudart():
    """torch's CUDA runtime bindings when a GPU is usable, else None (CPU-only hosts skip page-locking)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.cudart()
