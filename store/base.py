"""KVStore: the one interface every tier and the tiered composition implement. No policy lives here."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from store.entry import Entry, parse_header, seal_entry
from store.errors import DamagedEntryError, EntryFormatError, InvalidKeyError
from store.seal import PUBLIC, EntrySeal
from store.views import EntryView, SparseRead, open_full, open_sparse

_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
T = TypeVar("T")


def validate_key(key: str) -> str:
    """Keys are the gateway's exact key: 64 lowercase hex characters. Raises InvalidKeyError."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise InvalidKeyError(f"key must be 64 lowercase hex characters, got {key!r:.80}")
    return key


@dataclass(frozen=True, kw_only=True)
class StoreStats:
    """A tier's contents now (shared across processes) and this process's read counters."""

    entries: int
    bytes: int  # sum of stored entry sizes
    capacity_bytes: int  # 0: unlimited / not tracked
    pinned: int
    damaged_reads: int  # reads in this process that found a damaged entry and reported it absent


EntryLike = Entry | bytes | bytearray | memoryview


class KVStore(ABC):
    """Stores verified, patch-first entries by key. Thread-safe; several processes may open the same store.

    Reads verify what they read (checksums); a damaged or truncated entry reads as absent (None) and is counted in
    stats().damaged_reads. Returned handles are context managers: their buffers stay valid until the handle is
    closed (see each tier for what happens when another process removes or replaces the entry meanwhile).
    """

    name: str
    # Under which deployment secret entries are sealed and checked (store/seal.py); build entries with it.
    seal: EntrySeal = PUBLIC

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether an entry is stored under key. Cheap; does not verify it (get() may still return None)."""

    @abstractmethod
    def put(self, key: str, entry: EntryLike) -> int:
        """Store an entry atomically (readers see the old entry, the new one, or none; never a partial one).

        Replaces an existing entry under key and keeps its pin. An Entry (built under this store's seal) is sealed
        for key; raw bytes must be an entry sealed for key already (a copy from another tier), EntryFormatError
        otherwise. Returns the stored size in bytes. Raises StoreFullError.
        """

    @abstractmethod
    def get(self, key: str) -> EntryView | None:
        """The whole entry, verified, as a zero-copy handle; None when absent or damaged. Close the handle."""

    @abstractmethod
    def get_sparse(self, key: str, token_indices: Sequence[int], layer_range: tuple[int, int], *,
                   with_encoder: bool = False, heads: tuple[int, int] | None = None) -> SparseRead | None:
        """Layers [start, stop) of the given tokens (strictly increasing indices), reading and verifying only those
        byte ranges plus the header, and the encoder output when with_encoder. None when absent or when the header
        or any read block is damaged. An empty token list reads and verifies only the header (positions, shapes).

        heads: a half-open range [h0, h1) of KV heads, what a tensor-parallel rank holds (store.heads.rank_heads);
        None, every head. The blocks read and verified are the same either way (a block's checksum covers all its
        heads, so a damaged head outside the range still makes the read None); the handle's shape, gather and
        gather_into hold only those heads: (tokens, layers, 2, h1 - h0, head_dim).

        Never moves the entry. Raises InvalidReadError for tokens, layers or heads the entry does not have (a head
        range empty, reversed or past kv_heads). Close the handle.
        """

    @abstractmethod
    def remove(self, key: str, *, force: bool = False) -> bool:
        """Delete the entry and its pin. False if absent. Raises EntryPinnedError if pinned and not force.

        Handles already returned for this key stay valid.
        """

    @abstractmethod
    def pin(self, key: str) -> bool:
        """Mark the entry pinned (a flag, not a count) so remove() refuses it. False if absent."""

    @abstractmethod
    def unpin(self, key: str) -> bool:
        """Clear the pin flag. False if the entry was absent or not pinned."""

    @abstractmethod
    def is_pinned(self, key: str) -> bool:
        """Whether the entry is stored and pinned."""

    @abstractmethod
    def keys(self) -> Iterator[str]:
        """Stored keys, in no particular order (a snapshot: concurrent changes may or may not show)."""

    @abstractmethod
    def size_of(self, key: str) -> int | None:
        """Stored size in bytes, or None when absent."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """Entries, bytes and pins now; damaged reads seen by this process."""

    @abstractmethod
    def close(self) -> None:
        """Release the tier's resources; later calls raise StoreClosedError. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BufferTier(KVStore):
    """A tier whose reads hand out a verified view over one stored buffer (DRAM, LMDB).

    Subclasses implement ``_read(key, opener)``: find the entry's buffer, call
    ``opener(view, release)`` with it and a function that releases it, and return the
    result, or None when the key is absent or the entry damaged.
    """

    def get(self, key: str) -> EntryView | None:
        return self._read(key, lambda view, release: open_full(self.name, view, release, key=key, seal=self.seal))

    def get_sparse(self, key: str, token_indices: Sequence[int], layer_range: tuple[int, int], *,
                   with_encoder: bool = False, heads: tuple[int, int] | None = None) -> SparseRead | None:
        return self._read(key, lambda view, release: open_sparse(self.name, view, token_indices, layer_range, release,
                                                                 key=key, seal=self.seal, with_encoder=with_encoder,
                                                                 heads=heads))

    @abstractmethod
    def _read(self, key: str, opener): ...


def opened(read: Callable[[], T], release: Callable[[], None], on_damaged: Callable[[], None]) -> T | None:
    """What ``read()`` returns (a handle over a read it verified); a damaged entry releases the read, is counted
    (``on_damaged``) and reads as None; any other error releases the read and propagates. Every tier's reads."""
    try:
        return read()
    except DamagedEntryError:
        release()
        on_damaged()
        return None
    except BaseException:
        release()
        raise


def entry_bytes(entry: EntryLike, key: str, seal: EntrySeal) -> memoryview:
    """The bytes to store under ``key``: an Entry sealed for it (in place), or raw entry bytes after checking their
    header and their seal for it (not their payload: reads verify that). Raises EntryFormatError.
    """
    if isinstance(entry, Entry):
        seal_entry(entry.data, key, seal)
        return memoryview(entry.data)
    data = memoryview(entry).cast("B")
    try:
        parse_header(data, key=key, seal=seal)
    except DamagedEntryError as exc:
        raise EntryFormatError(f"not a well-formed entry sealed for {key[:16]}...: {exc}") from None
    return data
