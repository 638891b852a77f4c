"""The shared KV store: patch-first entries in a pinned-DRAM tier and an LMDB tier; no policy."""

from store.base import KVStore, StoreStats, validate_key
from store.config import StoreConfig, Tier
from store.dram import DramTier
from store.entry import ByteRange, Entry, EntryHeader, split_kv
from store.errors import (
    ConfigError,
    EntryFormatError,
    EntryPinnedError,
    InvalidKeyError,
    InvalidReadError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    UnknownTierError,
)
from store.lmdb_tier import LmdbTier
from store.tiered import TieredStore, open_store, open_tier
from store.views import EntryView, SparseRead, SparseSegment

__all__ = [
    "ByteRange", "ConfigError", "DramTier", "Entry", "EntryFormatError", "EntryHeader", "EntryPinnedError",
    "EntryView", "InvalidKeyError", "InvalidReadError", "KVStore", "LmdbTier", "SparseRead", "SparseSegment",
    "StoreClosedError", "StoreConfig", "StoreError", "StoreFullError", "StoreStats", "Tier", "TieredStore",
    "UnknownTierError", "open_store", "open_tier", "split_kv", "validate_key",
]
