"""TieredStore: an ordered list of tiers (fastest first) behind the KVStore interface; moves data only when told."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from store.base import EntryLike, KVStore, StoreStats, validate_key
from store.config import StoreConfig
from store.dram import DramTier
from store.errors import EntryPinnedError, UnknownTierError
from store.lmdb_tier import LmdbTier
from store.seal import EntrySeal
from store.views import EntryView, SparseRead


class TieredStore(KVStore):
    """Reads come from the fastest tier holding a valid copy; writes, copies and moves go where the caller says.

    A damaged copy in a faster tier is skipped (and counted by that tier); the read falls through to the next.
    Reads never promote or demote anything: the gateway decides with copy()/move(). Handles come from the tier
    that served them (handle.tier) and follow that tier's buffer lifetime rules.
    """

    name = "tiered"

    def __init__(self, tiers: Sequence[KVStore]) -> None:
        if not tiers or len({t.name for t in tiers}) != len(tiers):
            raise UnknownTierError("tiers must be a non-empty list with distinct names")
        if len({t.seal for t in tiers}) != 1:
            raise UnknownTierError("every tier of a store must seal entries under the same secret")
        self.tiers: tuple[KVStore, ...] = tuple(tiers)
        self.seal = tiers[0].seal

    def tier(self, name: str) -> KVStore:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise UnknownTierError(f"no tier {name!r}; have {[t.name for t in self.tiers]}")

    def tiers_holding(self, key: str) -> list[str]:
        """Names of the tiers that have an entry under key (unverified), fastest first."""
        return [t.name for t in self.tiers if t.contains(key)]

    def contains(self, key: str) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def put(self, key: str, entry: EntryLike, *, tier: str | None = None) -> int:
        """Store into one tier (default: the fastest)."""
        return (self.tier(tier) if tier else self.tiers[0]).put(key, entry)

    def get(self, key: str) -> EntryView | None:
        validate_key(key)
        for tier in self.tiers:
            view = tier.get(key)
            if view is not None:
                return view
        return None

    def get_sparse(self, key: str, token_indices: Sequence[int], layer_range: tuple[int, int], *,
                   with_encoder: bool = False, heads: tuple[int, int] | None = None) -> SparseRead | None:
        validate_key(key)
        for tier in self.tiers:
            read = tier.get_sparse(key, token_indices, layer_range, with_encoder=with_encoder, heads=heads)
            if read is not None:
                return read
        return None

    def copy(self, key: str, *, src: str, dst: str) -> bool:
        """Copy a verified entry from tier src to tier dst (pin state in dst unchanged). False if src has no valid
        copy."""
        source, target = self.tier(src), self.tier(dst)
        view = source.get(key)
        if view is None:
            return False
        with view:
            target.put(key, view.buffer)
        return True

    def move(self, key: str, *, src: str, dst: str) -> bool:
        """Copy to dst then remove from src; a pin moves with the entry. False if src has no valid copy."""
        source, target = self.tier(src), self.tier(dst)
        pinned = source.is_pinned(key)
        if not self.copy(key, src=src, dst=dst):
            return False
        if pinned:
            target.pin(key)
        source.remove(key, force=True)
        return True

    def remove(self, key: str, *, force: bool = False) -> bool:
        """Remove from every tier. With a pin in any tier and not force, raises EntryPinnedError and removes nothing."""
        validate_key(key)
        if not force and any(t.is_pinned(key) for t in self.tiers):
            raise EntryPinnedError(f"{key} is pinned")
        removed = [t.remove(key, force=force) for t in self.tiers]
        return any(removed)

    def pin(self, key: str) -> bool:
        """Pin in every tier holding the entry. False if none does."""
        return any([t.pin(key) for t in self.tiers])

    def unpin(self, key: str) -> bool:
        return any([t.unpin(key) for t in self.tiers])

    def is_pinned(self, key: str) -> bool:
        return any(t.is_pinned(key) for t in self.tiers)

    def keys(self) -> Iterator[str]:
        seen: set[str] = set()
        for tier in self.tiers:
            for key in tier.keys():
                if key not in seen:
                    seen.add(key)
                    yield key

    def size_of(self, key: str) -> int | None:
        for tier in self.tiers:
            size = tier.size_of(key)
            if size is not None:
                return size
        return None

    def tier_stats(self) -> dict[str, StoreStats]:
        return {t.name: t.stats() for t in self.tiers}

    def stats(self) -> StoreStats:
        """Sums over tiers (an entry held by two tiers counts twice)."""
        parts = list(self.tier_stats().values())
        return StoreStats(entries=sum(p.entries for p in parts), bytes=sum(p.bytes for p in parts),
                          capacity_bytes=sum(p.capacity_bytes for p in parts), pinned=sum(p.pinned for p in parts),
                          damaged_reads=sum(p.damaged_reads for p in parts))

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def open_tier(name: str, config: StoreConfig, seal: EntrySeal | None = None) -> KVStore:
    """One tier, sealing entries under ``seal`` (default: the secret config.secret_file names)."""
    seal = seal if seal is not None else EntrySeal.from_file(config.secret_file)
    if name == "dram":
        return DramTier(config.dram_path, capacity_bytes=config.dram_limit_bytes,
                        pin_host_memory=config.pin_host_memory, mapping_cache_bytes=config.dram_mapping_cache_bytes,
                        seal=seal)
    if name == "lmdb":
        return LmdbTier(config.lmdb_path, map_size=config.lmdb_map_size, max_map_size=config.lmdb_max_map_size,
                        growth_factor=config.lmdb_growth_factor, max_readers=config.lmdb_max_readers,
                        grow_wait_s=config.lmdb_grow_wait_s, sync=config.lmdb_sync, seal=seal)
    if name == "mooncake":
        from store.mooncake_tier import MooncakeTier  # imports the Mooncake client library only when asked for

        return MooncakeTier(master=config.mooncake_master, metadata_server=config.mooncake_metadata_url,
                            admin_url=config.mooncake_admin, store_name=config.name,
                            local_hostname=config.mooncake_local_hostname, protocol=config.mooncake_protocol,
                            device_names=config.mooncake_device_names,
                            read_buffer_bytes=config.mooncake_read_buffer_bytes, seal=seal)
    raise UnknownTierError(f"no tier {name!r}")


def open_store(config: StoreConfig | None = None) -> TieredStore:
    """Open the tiers named by config.tiers (default: from REVISIT_STORE_* variables), fastest first."""
    config = StoreConfig.from_env() if config is None else config
    seal = EntrySeal.from_file(config.secret_file)
    return TieredStore([open_tier(name, config, seal) for name in config.tiers])
