"""The shared KV store: patch-first entries in a DRAM tier (L2) and an LMDB tier (L3); no policy.

- :mod:`store.entry`: the entry format (header, encoder output, patch-first K/V, checksums per token and layer).
- :mod:`store.base`: ``KVStore``, the one interface every tier implements; ``BufferTier`` for buffer-backed ones.
- :mod:`store.dram`, :mod:`store.lmdb_tier`: the tiers, one file each; :mod:`store.tiered`: fastest-first
  composition, moves only when told (the gateway's policy tells it).
- :mod:`store.features`: ``FeatureStore``, the gateway's image features beside the entries (its index outlives it).
- :mod:`store.views`: read handles (whole entries, sparse reads of some tokens' layers and KV heads), zero-copy.
- :mod:`store.heads`: ``rank_heads``, the KV heads a tensor-parallel rank holds (SGLang's rule): its sparse reads'
  head range.
- :mod:`store.config`: ``StoreConfig`` (``REVISIT_STORE_*``) and ``Tier``; :mod:`store.errors`: its exceptions.

Used by the gateway (planning, policy decisions) and by the engine extension in every worker (writes after a miss,
reads for a hit), across processes on one host.
"""

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
from store.features import FeatureStore
from store.heads import rank_heads
from store.lmdb_tier import LmdbTier
from store.tiered import TieredStore, open_store, open_tier
from store.views import EntryView, SparseRead, SparseSegment

__all__ = [
    "ByteRange", "ConfigError", "DramTier", "Entry", "EntryFormatError", "EntryHeader", "EntryPinnedError",
    "EntryView", "FeatureStore", "InvalidKeyError", "InvalidReadError", "KVStore", "LmdbTier", "SparseRead",
    "SparseSegment", "StoreClosedError", "StoreConfig", "StoreError", "StoreFullError", "StoreStats", "Tier",
    "TieredStore", "UnknownTierError", "open_store", "open_tier", "rank_heads", "split_kv", "validate_key",
]
