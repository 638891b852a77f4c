"""Flipped bytes in stored entries read as absent, only where they were read; tiered falls through to a healthy copy."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest

from store import DramTier, EntryFormatError, LmdbTier, TieredStore, open_tier
from store.entry import PREFIX
from store.lmdb_tier import ENTRIES_DB
from tests.store.entries import expected_sparse, key_for, make_entry

KEY = key_for("damaged")


def flip(data: bytes, offset: int) -> bytes:
    damaged = bytearray(data)
    damaged[offset] ^= 0x40
    return bytes(damaged)


def damage_dram_file(tier: DramTier, offset: int) -> None:
    with open(tier.path / f"{KEY}.kv", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


def damage_lmdb_value(tier: LmdbTier, offset: int) -> LmdbTier:
    """Close the tier, rewrite the stored value with LMDB directly, reopen."""
    path = tier.path
    tier.close()
    env = lmdb.open(str(path), max_dbs=2)
    db = env.open_db(ENTRIES_DB)
    with env.begin(write=True) as txn:
        txn.put(KEY.encode(), flip(bytes(txn.get(KEY.encode(), db=db)), offset), db=db)
    env.close()
    return LmdbTier(path)


def damage(kind: str, tier, entry, offset: int):
    """The tier, now holding KEY with the byte at offset flipped (its header still well-formed)."""
    if kind == "dram":
        damage_dram_file(tier, offset)
    elif kind == "lmdb":
        tier = damage_lmdb_value(tier, offset)
    else:  # the cluster holds what a client wrote: damaged bytes pass the header check put() makes
        tier.put(KEY, flip(entry.data, offset))
    return tier


@pytest.fixture(params=["dram", "lmdb", "mooncake"])
def damaged_store(request, store_config):
    """A tier holding KEY with one flipped byte in block (token 5, layer 3), and the original arrays."""
    entry, k, v, _ = make_entry(7)
    tier = open_tier(request.param, store_config)
    tier.put(KEY, entry)
    tier = damage(request.param, tier, entry, entry.header.token_layers_range(5, 3, 4).start + 9)
    yield tier, entry, k, v
    tier.close()


def test_damaged_block_reads_absent_only_where_read(damaged_store):
    tier, entry, k, v = damaged_store
    assert tier.contains(KEY)
    assert tier.get(KEY) is None
    assert tier.get_sparse(KEY, [5], (3, 4)) is None
    assert tier.get_sparse(KEY, [2, 5, 9], (2, 4)) is None
    assert tier.stats().damaged_reads == 3
    with tier.get_sparse(KEY, [5], (0, 3)) as read:  # the same token's earlier layers are intact
        assert read.gather() == expected_sparse(k, v, [5], 0, 3)
    with tier.get_sparse(KEY, [4, 6], (0, 4)) as read:
        assert read.gather() == expected_sparse(k, v, [4, 6], 0, 4)
    assert tier.stats().damaged_reads == 3


@pytest.mark.parametrize("where", ["magic", "metadata", "positions", "encoder", "truncated"])
def test_dram_damage_anywhere_reads_absent(store_config, where):
    entry, *_ = make_entry(8)
    tier = DramTier(store_config.dram_path, pin_host_memory=False)
    tier.put(KEY, entry)
    h = entry.header
    if where == "truncated":
        with open(tier.path / f"{KEY}.kv", "r+b") as f:
            f.truncate(len(entry.data) - 100)
    else:
        offset = {"magic": 1, "metadata": PREFIX.size + 2, "positions": h.positions_offset + 1,
                  "encoder": h.encoder_range.start + 3}[where]
        damage_dram_file(tier, offset)
    assert tier.get(KEY) is None
    sparse = tier.get_sparse(KEY, [0], (0, 1))
    if where == "encoder":  # sparse reads do not touch the encoder output
        assert sparse is not None and sparse.bytes_read == h.block_nbytes
        sparse.close()
    else:
        assert sparse is None
    tier.close()


def test_empty_dram_file_reads_absent(store_config):
    tier = DramTier(store_config.dram_path, pin_host_memory=False)
    (tier.path / f"{KEY}.kv").touch()
    assert tier.contains(KEY) and tier.get(KEY) is None and tier.stats().damaged_reads == 1


def test_put_refuses_bytes_with_a_bad_header(store_config):
    entry, *_ = make_entry(8)
    tier = LmdbTier(store_config.lmdb_path, map_size=store_config.lmdb_map_size)
    for bad in (flip(entry.data, 1), flip(entry.data, PREFIX.size + 1), entry.data[:-1], b""):
        with pytest.raises(EntryFormatError):
            tier.put(KEY, bad)
    assert not tier.contains(KEY)
    tier.close()


def test_tiered_falls_through_to_a_healthy_copy(store_config):
    entry, k, v, _ = make_entry(9)
    dram, lmdb_tier = open_tier("dram", store_config), open_tier("lmdb", store_config)
    store = TieredStore([dram, lmdb_tier])
    store.put(KEY, entry, tier="lmdb")
    store.put(KEY, flip(entry.data, entry.header.token_layers_range(5, 3, 4).start), tier="dram")
    assert store.tiers_holding(KEY) == ["dram", "lmdb"]
    with store.get(KEY) as view:
        assert view.tier == "lmdb" and bytes(view.buffer) == entry.data
    with store.get_sparse(KEY, [5], (2, 4)) as read:
        assert read.tier == "lmdb" and read.gather() == expected_sparse(k, v, [5], 2, 4)
    with store.get_sparse(KEY, [6], (2, 4)) as read:  # the damage is elsewhere: the fast tier serves it
        assert read.tier == "dram"
    assert store.tier_stats()["dram"].damaged_reads == 2 and store.tier_stats()["lmdb"].damaged_reads == 0
    assert store.copy(KEY, src="lmdb", dst="dram")  # the gateway repairs by copying the healthy one up
    with store.get(KEY) as view:
        assert view.tier == "dram"
    store.close()


def test_a_read_of_every_block_or_of_the_encoder_sees_the_damage(damaged_store):
    tier, entry, _, _ = damaged_store
    every = list(range(entry.header.num_tokens))
    assert tier.get_sparse(KEY, every, (0, entry.header.num_layers)) is None  # verified in one pass, still caught
    with tier.get_sparse(KEY, [], (0, 1), with_encoder=True) as read:  # the encoder output itself is intact
        assert read.encoder_array().shape == entry.header.encoder_shape


@pytest.mark.parametrize("kind", ["dram", "lmdb", "mooncake"])
def test_a_damaged_encoder_output_reads_absent_when_asked_for(kind, store_config):
    entry = make_entry(8)[0]
    tier = open_tier(kind, store_config)
    tier.put(KEY, entry)
    tier = damage(kind, tier, entry, entry.header.encoder_range.start + 3)
    try:
        assert tier.get_sparse(KEY, [0], (0, 1), with_encoder=True) is None
        with tier.get_sparse(KEY, [0], (0, 1)) as read:  # the KV blocks are intact
            assert read.bytes_read == entry.header.block_nbytes
    finally:
        tier.close()


def test_a_damaged_head_outside_the_head_range_still_fails_the_read(damaged_store):
    """The flipped byte lies in head 0's K of block (token 5, layer 3); a read of head 1 verifies the block whole."""
    tier, entry, k, v = damaged_store
    assert entry.header.kv_heads == 2
    assert tier.get_sparse(KEY, [5], (3, 4), heads=(1, 2)) is None
    assert tier.get_sparse(KEY, [2, 5, 9], (0, 4), heads=(1, 2)) is None
    every = list(range(entry.header.num_tokens))
    assert tier.get_sparse(KEY, every, (0, entry.header.num_layers), heads=(1, 2)) is None  # the one-pass check
    assert tier.stats().damaged_reads == 3
    with tier.get_sparse(KEY, [4, 6], (0, 4), heads=(1, 2)) as read:  # elsewhere the head range reads
        kv = np.frombuffer(expected_sparse(k, v, [4, 6], 0, 4), dtype=k.dtype).reshape(2, 4, 2, 2, 16)
        assert read.gather() == np.ascontiguousarray(kv[:, :, :, 1:2]).tobytes()
