"""One suite, run against every tier and the tiered composition."""

from __future__ import annotations

import numpy as np
import pytest

from store import EntryFormatError, EntryPinnedError, InvalidKeyError, InvalidReadError, StoreClosedError, split_kv
from store.entry import seal_entry
from tests.store.entries import SMALL, expected_sparse, key_for, make_entry


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_round_trip(store, dtype):
    entry, k, v, encoder = make_entry(1, dtype=dtype)
    key = key_for(dtype)
    assert store.put(key, entry) == len(entry.data) == store.size_of(key)
    with store.get(key) as view:
        assert view.header == entry.header
        assert view.header.positions == tuple(range(5, 5 + SMALL["tokens"]))
        assert bytes(view.buffer) == entry.data
        got_k, got_v = split_kv(view.kv_array())  # (L, H, T, D) each
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)
        np.testing.assert_array_equal(view.encoder_array(), encoder)
        assert view.tier in ("dram", "lmdb", "mooncake")
    assert view.closed


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "tokens,layers,segments",
    [
        ([0, 1, 2, 9, 63], (2, 4), 5),  # late layers: every token its own range
        ([3, 4, 5, 20, 21], (0, 4), 2),  # all layers: consecutive tokens coalesce
        ([7], (1, 2), 1),
        ([], (0, 1), 0),
    ],
)
def test_get_sparse_returns_exactly_the_requested_bytes(store, dtype, tokens, layers, segments):
    entry, k, v, _ = make_entry(2, dtype=dtype)
    key = key_for("sparse")
    store.put(key, entry)
    with store.get_sparse(key, tokens, layers) as read:
        expected = expected_sparse(k, v, tokens, *layers)
        assert read.gather() == expected
        assert read.bytes_read == len(expected) == len(tokens) * (layers[1] - layers[0]) * entry.header.block_nbytes
        assert len(read.segments) == segments
        assert read.token_indices == tuple(tokens) and read.header == entry.header
        if tokens:
            assert read.gather_array().shape == (len(tokens), layers[1] - layers[0], 2, 2, 16)
        for segment in read.segments:  # each segment is the entry's own byte range
            first = entry.header.token_layers_range(tokens[segment.first], *layers)
            assert bytes(segment.data) == entry.data[first.start : first.start + segment.data.nbytes]


@pytest.mark.parametrize("tokens,layers", [([5, 3], (0, 1)), ([1, 1], (0, 1)), ([64], (0, 1)), ([-1], (0, 1)),
                                           ([0], (2, 2)), ([0], (0, 5)), ([0], (-1, 2))])
def test_bad_sparse_request_is_refused(store, tokens, layers):
    store.put(key_for("x"), make_entry(3)[0])
    with pytest.raises(InvalidReadError):
        store.get_sparse(key_for("x"), tokens, layers)
    assert store.stats().damaged_reads == 0


def test_absent_reads_none(store):
    key = key_for("absent")
    assert not store.contains(key)
    assert store.get(key) is None and store.get_sparse(key, [0], (0, 1)) is None
    assert store.size_of(key) is None
    assert not store.remove(key) and not store.pin(key) and not store.unpin(key) and not store.is_pinned(key)


def test_contains_remove_keys_stats(store):
    keys = [key_for(i) for i in range(3)]
    sizes = [store.put(key, make_entry(i)[0]) for i, key in enumerate(keys)]
    assert all(store.contains(key) for key in keys)
    assert sorted(store.keys()) == sorted(keys)
    stats = store.stats()
    assert (stats.entries, stats.bytes, stats.pinned, stats.damaged_reads) == (3, sum(sizes), 0, 0)
    assert store.remove(keys[0])
    assert not store.contains(keys[0]) and store.get(keys[0]) is None
    assert not store.remove(keys[0])
    assert store.stats().entries == 2 and store.stats().bytes == sum(sizes[1:])


def test_put_replaces(store):
    key = key_for("replace")
    store.put(key, make_entry(1)[0])
    replacement = make_entry(2)[0]
    with pytest.raises(EntryFormatError, match="seal"):
        store.put(key, bytes(replacement.data))  # raw bytes must be sealed for the key already
    seal_entry(replacement.data, key, store.seal)
    store.put(key, bytes(replacement.data))  # as a copy from another tier is
    with store.get(key) as view:
        assert view.header.model_id == "seed-2"
    assert store.stats().entries == 1


def test_pin_blocks_remove_until_unpin_or_force(store):
    key, other = key_for("pinned"), key_for("other")
    store.put(key, make_entry(1)[0])
    store.put(other, make_entry(2)[0])
    assert store.pin(key) and store.is_pinned(key) and not store.is_pinned(other)
    assert store.pin(key)  # a flag: pinning twice is still one pin
    assert store.stats().pinned == 1
    with pytest.raises(EntryPinnedError):
        store.remove(key)
    assert store.contains(key)
    assert store.unpin(key) and not store.unpin(key)
    assert store.remove(key)
    store.put(key, make_entry(1)[0])
    store.pin(key)
    store.put(key, make_entry(3)[0])
    assert store.is_pinned(key), "a replaced entry keeps its pin"
    assert store.remove(key, force=True) and not store.contains(key)
    store.put(key, make_entry(1)[0])
    assert not store.is_pinned(key), "remove drops the pin with the entry"


def test_handle_outlives_remove(store):
    entry, k, v, _ = make_entry(4)
    key = key_for("outlive")
    store.put(key, entry)
    view = store.get(key)
    sparse = store.get_sparse(key, [1, 2], (3, 4))
    store.remove(key)
    store.put(key, make_entry(5)[0])
    assert bytes(view.buffer) == entry.data
    assert sparse.gather() == expected_sparse(k, v, [1, 2], 3, 4)
    view.close()
    sparse.close()
    view.close()  # idempotent


@pytest.mark.parametrize("bad", ["", "ab", "A" * 64, "g" * 64, "0" * 63, "0" * 65, b"0" * 64, None, 7])
def test_invalid_keys_are_refused(store, bad):
    entry = make_entry(1)[0]
    for call in (lambda: store.contains(bad), lambda: store.put(bad, entry), lambda: store.get(bad),
                 lambda: store.get_sparse(bad, [0], (0, 1)), lambda: store.remove(bad), lambda: store.pin(bad),
                 lambda: store.unpin(bad), lambda: store.size_of(bad), lambda: store.is_pinned(bad)):
        with pytest.raises(InvalidKeyError):
            call()


def test_closed_store_refuses(store):
    store.put(key_for(1), make_entry(1)[0])
    store.close()
    with pytest.raises(StoreClosedError):
        store.get(key_for(1))
    with pytest.raises(StoreClosedError):
        store.put(key_for(1), make_entry(1)[0])
    store.close()


@pytest.mark.parametrize("tokens,layers", [([3, 4, 9], (1, 3)), (list(range(SMALL["tokens"])), (0, SMALL["layers"]))])
def test_get_sparse_with_the_encoder_output_and_gathered_into_a_buffer(store, tokens, layers):
    entry, k, v, encoder = make_entry(4, dtype="bfloat16")
    key = key_for("with-encoder")
    store.put(key, entry)
    with store.get_sparse(key, tokens, layers, with_encoder=True) as read:
        np.testing.assert_array_equal(read.encoder_array(), encoder)
        out = np.empty(read.shape, dtype=np.uint16)
        assert read.gather_into(out) is out
        assert out.tobytes() == expected_sparse(k, v, tokens, *layers)
        with pytest.raises(ValueError):
            read.gather_into(np.empty(read.shape, dtype=np.float32))
    with store.get_sparse(key, tokens, layers) as read, pytest.raises(InvalidReadError):
        read.encoder_array()  # not asked for, not read


def test_a_handle_outlives_the_store(store):
    entry, k, v, _ = make_entry(6)
    key = key_for("outlive-close")
    store.put(key, entry)
    view = store.get(key)
    sparse = store.get_sparse(key, [3], (0, 2))
    store.close()
    assert bytes(view.buffer) == entry.data and sparse.gather() == expected_sparse(k, v, [3], 0, 2)
    view.close()
    sparse.close()


def test_reads_after_reads_see_only_their_own_entry(store):
    """Read buffers may be reused (the mooncake tier keeps them): each read shows its own entry's bytes, whole or
    sparse, whatever an earlier read of another entry left."""
    entries = [make_entry(seed) for seed in (11, 12, 13)]
    keys = [key_for(f"reuse-{i}") for i in range(3)]
    for key, (entry, *_rest) in zip(keys, entries, strict=True):
        store.put(key, entry)
    for _ in range(2):
        for key, (entry, k, v, _encoder) in zip(keys, entries, strict=True):
            with store.get(key) as view:
                assert bytes(view.buffer) == entry.data
            with store.get_sparse(key, [0, 7], (1, 3)) as read:
                assert read.gather() == expected_sparse(k, v, [0, 7], 1, 3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("tokens,layers", [([0, 1, 2, 9, 63], (2, 4)), ([3, 4, 5, 20, 21], (0, 4)),
                                           (list(range(SMALL["tokens"])), (0, SMALL["layers"])), ([], (0, 1))])
@pytest.mark.parametrize("heads", [(0, 1), (1, 3), (3, 4), (0, 4)])
def test_get_sparse_of_a_head_range_is_the_full_read_sliced(store, dtype, tokens, layers, heads):
    entry, k, v, _ = make_entry(14, dtype=dtype, kv_heads=4)
    key = key_for("heads")
    store.put(key, entry)
    h0, h1 = heads
    with store.get_sparse(key, tokens, layers) as full, store.get_sparse(key, tokens, layers, heads=heads) as part:
        whole = full.gather_array()  # (tokens, layers, 2, kv_heads, head_dim)
        sliced = np.ascontiguousarray(whole[:, :, :, h0:h1])
        assert part.shape == sliced.shape == (len(tokens), layers[1] - layers[0], 2, h1 - h0, 16)
        assert (part.head_start, part.head_stop) == heads and (full.head_start, full.head_stop) == (0, 4)
        np.testing.assert_array_equal(part.gather_array(), sliced)
        assert part.gather() == sliced.tobytes()
        out = np.empty(part.shape, dtype=sliced.dtype)
        assert part.gather_into(out) is out
        np.testing.assert_array_equal(out, sliced)
        if heads != (0, 4):
            with pytest.raises(ValueError):
                part.gather_into(np.empty(full.shape, dtype=sliced.dtype))  # the shape is the head range's
        assert part.bytes_read == full.bytes_read  # whole blocks are read (and verified) either way
        assert [s.data.nbytes for s in part.segments] == [s.data.nbytes for s in full.segments]
    with store.get_sparse(key, tokens, layers, with_encoder=True, heads=heads) as part:
        assert part.gather() == sliced.tobytes()


@pytest.mark.parametrize("heads", [(1, 1), (2, 1), (0, 5), (3, 5), (-1, 1), (4, 5), (0,), (0, 1, 2), "ab", None])
def test_bad_head_range_is_refused(store, heads):
    key = key_for("bad-heads")
    store.put(key, make_entry(3, kv_heads=4)[0])
    if heads is None:  # every head: the default
        with store.get_sparse(key, [0], (0, 1), heads=heads) as read:
            assert read.shape == (1, 1, 2, 4, 16)
        return
    with pytest.raises(InvalidReadError):
        store.get_sparse(key, [0], (0, 1), heads=heads)
    with pytest.raises(InvalidReadError):
        store.get_sparse(key, [], (0, 1), heads=heads)  # checked even when no block is read
    assert store.stats().damaged_reads == 0
