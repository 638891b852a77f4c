"""The shared tier: entries as objects in a Mooncake Store cluster, readable by every host's workers and gateways.

Mooncake Store (the ``mooncake-transfer-engine`` package) keeps objects in memory segments that storage nodes
(``mooncake_client`` processes, one or more per host) lend to the cluster, with one ``mooncake_master`` holding
where each object lies. This tier is a client of that cluster: it lends no memory of its own (so a worker or a
gateway that dies takes no entry with it) and copies what it reads into memory of its own process.

Object names, under ``revisit/<store name>/`` so that several stores can share a cluster:

    kv/<key>     a complete entry (entry.py layout); written whole by ``upsert``, which Mooncake makes visible
                 only once complete (readers see the old object, the new one, or none)
    pin/<key>    one byte; present while the entry is pinned

Reads. ``get`` copies the whole entry into an anonymous mapping of this process (kept for later reads, see
_ReadBuffers) and verifies it like any tier.
``get_sparse`` reads only the header (two small ranged reads: the fixed prefix tells how long the header is), then
exactly the requested blocks (and the encoder output when asked) in one ranged read, into a mapping the size of the
entry whose other pages are never touched (so never allocated). A read of a head range reads the same whole blocks
(their checksums cover every head) and gathers only those heads. Every block read is verified against the header's
checksums, so an entry damaged in the cluster, or replaced between the reads, reads as absent.

Removal. Mooncake holds a short lease on an object after each read (so that its memory is not reused while a peer
copies it); ``remove`` overrides it (force), which is safe here because every read verifies what it copied: a read
racing a removal finds a checksum mismatch and reports the entry absent.

Listing and sizes. ``keys()`` and ``stats()`` ask the master's admin HTTP endpoint (``/get_all_keys``,
``/batch_query_keys``), which the client library does not offer; they are for the gateway's books and the operator,
not for the request path.

Failures. When the cluster fails a call (its master gone: the client library takes about 4 s to say so), the tier
raises StoreError, and so does every call for the next RETRY_AFTER_S without asking: the gateway plans requests as
plain SGLang meanwhile and workers compute what they would have read, instead of each waiting seconds.

Capacity. The cluster evicts objects on its own when its memory passes a high watermark: give it more memory than
the gateway's books allow this tier (``REVISIT_MOONCAKE_CAPACITY_BYTES``), and the books only ever see their own
evictions. An entry evicted by the cluster anyway reads as absent, and the books let it go at their next pass.
"""

from __future__ import annotations

import ctypes
import functools
import json
import mmap
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

import numpy as np

from store.base import EntryLike, KVStore, StoreStats, entry_bytes, opened, validate_key
from store.entry import PREFIX, ByteRange, parse_header
from store.errors import DamagedEntryError, EntryPinnedError, StoreClosedError, StoreError, StoreFullError
from store.seal import PUBLIC, EntrySeal
from store.views import EntryView, SparseRead, check_sparse_request, open_full, open_sparse

# Mooncake's error codes (mooncake-store's types.h) that this tier tells apart; any other negative result is a
# StoreError.
OBJECT_NOT_FOUND = -704
NO_AVAILABLE_HANDLE = -200  # no segment has room for the object
FIRST_READ = 64 << 10  # bytes read first by a sparse read: the prefix, and the whole header of most entries
ADMIN_TIMEOUT_S = 10.0
QUERY_BATCH = 256  # keys per /batch_query_keys call
T = TypeVar("T")
RETRY_AFTER_S = 5.0  # after the cluster failed a call, how long calls fail at once


def _address(buffer: Any) -> int:
    """The address of a buffer's first byte (read-only buffers included)."""
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


class _ReadBuffer:
    """An anonymous private mapping registered with the Mooncake client as a transfer target; pages no transfer
    writes are never allocated. ``view`` is its first ``size`` bytes, for the read in progress."""

    def __init__(self, client: Any, capacity: int) -> None:
        self._client = client
        self.capacity = capacity
        self.map = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.view = memoryview(self.map)[:0]
        if client.register_buffer(self.address, capacity) != 0:
            self.free()
            raise StoreError("the Mooncake client refused to register a read buffer")
        self._registered = True

    def free(self) -> None:
        if getattr(self, "_registered", False):
            self._registered = False
            self._client.unregister_buffer(self.address)
        self.view.release()
        try:
            self.map.close()
        except BufferError:  # an array made from a view handed out is still alive: the GC frees the mapping later
            pass


class _ReadBuffers:
    """Read buffers kept for later reads, up to ``limit_bytes`` idle (per process): a buffer a read has touched
    needs no page faults (nor the kernel's zeroing) the next time, which halves a whole read of a large entry
    (bench/scale_out.py). A later read overwrites exactly the bytes it then verifies and hands out, so what an
    earlier read left elsewhere in the buffer is never seen."""

    GRAIN = 1 << 20

    def __init__(self, client: Any, limit_bytes: int) -> None:
        self._client = client
        self.limit_bytes = limit_bytes
        self._idle: list[_ReadBuffer] = []
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.closed = False

    def take(self, size: int) -> _ReadBuffer:
        """A registered buffer of at least ``size`` bytes (reused when one of up to twice that size is idle)."""
        with self._lock:
            fits = [b for b in self._idle if size <= b.capacity <= 2 * size + self.GRAIN]
            if fits:
                buffer = min(fits, key=lambda b: b.capacity)
                self._idle.remove(buffer)
                self._idle_bytes -= buffer.capacity
                buffer.view = memoryview(buffer.map)[:size]
                return buffer
        buffer = _ReadBuffer(self._client, max(self.GRAIN, -(-size // self.GRAIN) * self.GRAIN))
        buffer.view = memoryview(buffer.map)[:size]
        return buffer

    def give(self, buffer: _ReadBuffer) -> None:
        """Back from a closed handle: kept for the next read, or freed."""
        try:
            buffer.view.release()
        except BufferError:  # still exported by the caller's arrays: never reuse it
            buffer.free()
            return
        with self._lock:
            if not self.closed and self._idle_bytes + buffer.capacity <= self.limit_bytes:
                self._idle.append(buffer)
                self._idle_bytes += buffer.capacity
                return
            if self.closed:
                buffer._registered = False  # the client is gone, and its registrations with it
        buffer.free()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle, self._idle_bytes = self._idle, [], 0
        for buffer in idle:
            buffer.free()


class MooncakeTier(KVStore):
    """Entries in a Mooncake Store cluster, shared by every process of every host that opens it.

    Thread-safe (the Mooncake client is). Handles own a private copy of what they read: they stay valid after the
    entry is removed or replaced in the cluster, and after close() of the tier.
    """

    name = "mooncake"

    def __init__(self, *, master: str, metadata_server: str, admin_url: str, store_name: str = "default",
                 local_hostname: str = "", protocol: str = "tcp", device_names: str = "",
                 local_buffer_bytes: int = 16 << 20, read_buffer_bytes: int = 1 << 30,
                 connect_timeout_s: float = 5.0, seal: EntrySeal = PUBLIC) -> None:
        self.master = master
        self.seal = seal
        self.admin_url = admin_url.rstrip("/")
        self.prefix = f"revisit/{store_name}/"
        self._lock = threading.Lock()
        self._damaged = 0
        self._closed = False
        _check_reachable(master, self.admin_url, connect_timeout_s)
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:  # the package, or a system library it links (libibverbs)
            raise StoreError(f"the mooncake tier needs the mooncake-transfer-engine package: {exc}") from exc
        self._down_until = 0.0  # after a failure, calls fail at once until then (see _failed)
        self._client = MooncakeDistributedStore()
        # No global segment: this process lends no memory to the cluster; storage nodes do.
        status = self._client.setup(local_hostname or _local_address(master), metadata_server, 0,
                                    local_buffer_bytes, protocol, device_names, master)
        if status != 0:
            raise StoreError(f"cannot join the Mooncake cluster at {master} (metadata {metadata_server}): {status}")
        self._replicas = ReplicateConfig()
        self._buffers = _ReadBuffers(self._client, read_buffer_bytes)

    # --- names ---

    def _entry_name(self, key: str) -> str:
        self._check_open()
        name = self.prefix + "kv/" + validate_key(key)
        if time.monotonic() < self._down_until:
            raise StoreError(f"the Mooncake cluster at {self.master} did not answer lately; next try in "
                             f"{self._down_until - time.monotonic():.1f} s")
        return name

    def _failed(self, message: str) -> NoReturn:
        """A call the cluster failed (its master gone, say: the client takes seconds to say so). Later calls fail
        at once for RETRY_AFTER_S, so that no request waits on a cluster that is away; then one tries again."""
        self._down_until = time.monotonic() + RETRY_AFTER_S
        raise StoreError(message)

    def _pin_name(self, key: str) -> str:
        return self.prefix + "pin/" + key

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the mooncake tier ({self.master}) is closed")

    # --- KVStore ---

    def contains(self, key: str) -> bool:
        status = self._client.is_exist(self._entry_name(key))
        if status < 0:
            self._failed(f"Mooncake could not tell whether {key} is stored: {status}")
        return status == 1

    def put(self, key: str, entry: EntryLike) -> int:
        name = self._entry_name(key)
        data = entry_bytes(entry, key, self.seal)
        status = self._client.upsert_from(name, _address(data), data.nbytes, self._replicas)
        if status == NO_AVAILABLE_HANDLE:
            raise StoreFullError(f"the Mooncake cluster has no room for {data.nbytes} bytes")
        if status != 0:
            self._failed(f"Mooncake upsert of {key} failed: {status}")
        return data.nbytes

    def get(self, key: str) -> EntryView | None:
        def whole(name: str, buffer: _ReadBuffer, size: int) -> bool:
            return bool(self._client.get_into(name, buffer.address, size) == size)  # else gone, or replaced

        return self._read(key, whole, lambda view, release: open_full(self.name, view, release, key=key,
                                                                     seal=self.seal))

    def get_sparse(self, key: str, token_indices: Sequence[int], layer_range: tuple[int, int], *,
                   with_encoder: bool = False, heads: tuple[int, int] | None = None) -> SparseRead | None:
        def blocks(name: str, buffer: _ReadBuffer, size: int) -> bool:
            if size < PREFIX.size or not self._read_ranges(name, buffer, [ByteRange(0, min(size, FIRST_READ))]):
                raise DamagedEntryError("shorter than the prefix, or gone")
            header_nbytes = PREFIX.unpack_from(buffer.view, 0)[4]
            if not PREFIX.size <= header_nbytes <= size:
                raise DamagedEntryError(f"header length {header_nbytes} outside the entry ({size})")
            if header_nbytes > FIRST_READ and not self._read_ranges(name, buffer,
                                                                    [ByteRange(FIRST_READ, header_nbytes)]):
                raise DamagedEntryError("gone while its header was read")
            header = parse_header(buffer.view).header
            tokens, layer_start, layer_stop = check_sparse_request(header, token_indices, layer_range, heads)
            ranges = [header.encoder_range] if with_encoder and header.encoder_nbytes else []
            ranges += [header.token_layers_range(token, layer_start, layer_stop) for token in tokens]
            if not self._read_ranges(name, buffer, _coalesce(ranges)):
                raise DamagedEntryError("gone while its blocks were read")
            return True

        return self._read(key, blocks, lambda view, release: open_sparse(
            self.name, view, token_indices, layer_range, release, key=key, seal=self.seal, with_encoder=with_encoder,
            heads=heads))

    def _read(self, key: str, fill: Callable[[str, _ReadBuffer, int], bool],
              opener: Callable[[memoryview, Callable[[], None]], T]) -> T | None:
        """Copy what ``fill`` reads of the entry into a read buffer (False: the entry is gone), then ``opener``
        verifies it; None when absent or damaged."""
        name = self._entry_name(key)
        size = self._client.get_size(name)
        if size < 0:
            self._check_absent(size, key)
            return None
        buffer = self._buffers.take(size)
        release = functools.partial(self._buffers.give, buffer)

        def read() -> T | None:
            if not fill(name, buffer, size):
                release()
                return None
            return opener(buffer.view, release)

        return opened(read, release, self._count_damaged)

    def _read_ranges(self, name: str, buffer: _ReadBuffer, ranges: list[ByteRange]) -> bool:
        """Copy byte ranges of the object into the same offsets of buffer, in one request. False when the object
        is gone or smaller than a range (replaced); StoreError on any other failure."""
        if not ranges:
            return True
        offsets = [r.start for r in ranges]
        sizes = [r.nbytes for r in ranges]
        result = self._client.get_into_ranges([buffer.address], [[name] * len(ranges)], [[[o] for o in offsets]],
                                              [[[o] for o in offsets]], [[[n] for n in sizes]])
        copied = [part[0] for part in result[0]]
        if all(c == n for c, n in zip(copied, sizes, strict=True)):
            return True
        failures = {c for c in copied if c < 0}
        if failures - {OBJECT_NOT_FOUND} and not any(c >= 0 for c in copied):
            self._failed(f"Mooncake ranged read of {name} failed: {sorted(failures)}")
        return False

    def _check_absent(self, status: int, key: str) -> None:
        """A negative status from a lookup: the entry is absent (OBJECT_NOT_FOUND) or the cluster failed."""
        if status != OBJECT_NOT_FOUND:
            self._failed(f"Mooncake could not look up {key}: {status}")

    def _count_damaged(self) -> None:
        with self._lock:
            self._damaged += 1

    def remove(self, key: str, *, force: bool = False) -> bool:
        name = self._entry_name(key)
        if not force and self.is_pinned(key):
            raise EntryPinnedError(f"{key} is pinned")
        status = self._client.remove(name, True)  # over a reader's lease: reads verify what they copied
        self._client.remove(self._pin_name(key), True)
        if status == OBJECT_NOT_FOUND:
            return False
        if status != 0:
            self._failed(f"Mooncake remove of {key} failed: {status}")
        return True

    def pin(self, key: str) -> bool:
        if not self.contains(key):
            return False
        marker = b"\x01"
        status = self._client.upsert_from(self._pin_name(key), _address(marker), 1, self._replicas)
        if status != 0:
            self._failed(f"Mooncake could not pin {key}: {status}")
        return True

    def unpin(self, key: str) -> bool:
        self._entry_name(key)
        status = self._client.remove(self._pin_name(key), True)
        return status == 0 and self.contains(key)

    def is_pinned(self, key: str) -> bool:
        return self.contains(key) and self._client.is_exist(self._pin_name(key)) == 1

    def keys(self) -> Iterator[str]:
        self._check_open()
        entries = self.prefix + "kv/"
        for name in self._admin("/get_all_keys").splitlines():
            if name.startswith(entries):
                yield name[len(entries):]

    def size_of(self, key: str) -> int | None:
        size = self._client.get_size(self._entry_name(key))
        if size < 0:
            self._check_absent(size, key)
            return None
        return size

    def stats(self) -> StoreStats:
        """Entries, bytes and pins of this store in the cluster (from the master's admin endpoint);
        capacity_bytes is the memory the cluster's segments lend (shared with anything else stored there)."""
        self._check_open()
        names = [n for n in self._admin("/get_all_keys").splitlines() if n.startswith(self.prefix)]
        entries = [n for n in names if n.startswith(self.prefix + "kv/")]
        pins = {n[len(self.prefix + "pin/"):] for n in names if n.startswith(self.prefix + "pin/")}
        total = 0
        for at in range(0, len(entries), QUERY_BATCH):
            batch = entries[at:at + QUERY_BATCH]
            found = json.loads(self._admin("/batch_query_keys?keys=" + urllib.parse.quote(",".join(batch))))
            for value in (found.get("data") or {}).values():
                replicas = (value.get("values") or []) if value.get("ok") else []
                total += replicas[0].get("size_", 0) if replicas else 0
        pinned = sum(n[len(self.prefix + "kv/"):] in pins for n in entries)
        return StoreStats(entries=len(entries), bytes=total, capacity_bytes=self._capacity(), pinned=pinned,
                          damaged_reads=self._damaged)

    def _capacity(self) -> int:
        for line in self._admin("/metrics").splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return int(float(line.split()[1]))
        return 0

    def _admin(self, path: str) -> str:
        try:
            with urllib.request.urlopen(self.admin_url + path, timeout=ADMIN_TIMEOUT_S) as response:
                return response.read().decode()
        except (OSError, urllib.error.URLError) as exc:
            self._failed(f"the Mooncake master's admin endpoint {self.admin_url} did not answer: {exc}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._buffers.close()
        self._client.close()


def _coalesce(ranges: list[ByteRange]) -> list[ByteRange]:
    """Sorted ranges with those that touch or overlap merged."""
    merged: list[ByteRange] = []
    for r in sorted(ranges):
        if merged and r.start <= merged[-1].stop:
            merged[-1] = ByteRange(merged[-1].start, max(merged[-1].stop, r.stop))
        else:
            merged.append(r)
    return merged


def _check_reachable(master: str, admin_url: str, timeout_s: float) -> None:
    """Fail fast: the client library retries an unreachable master for ever instead of failing its setup."""
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise StoreError(f"the Mooncake master {master} is not reachable: {exc}") from exc
    try:
        with urllib.request.urlopen(admin_url + "/health", timeout=timeout_s) as response:
            response.read()
    except (OSError, urllib.error.URLError) as exc:
        raise StoreError(f"the Mooncake master's admin endpoint {admin_url} is not reachable: {exc}") from exc


def _local_address(master: str) -> str:
    """This host's address on the route to the master (what peers would reach it by)."""
    host = master.rpartition(":")[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
