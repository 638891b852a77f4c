"""The entry format: patch-first byte ranges, header round trip, and refusal of malformed input."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from store import Entry, EntryFormatError
from store.entry import (
    DATA_ALIGN,
    MAGIC,
    PREFIX,
    _header_xxh3,
    kv_array,
    parse_header,
    verify_blocks,
    verify_full,
)
from store.errors import DamagedEntryError
from tests.store.entries import make_entry


def test_token_ranges_are_patch_first():
    entry, k, v, _ = make_entry(1, dtype="float32")
    h = entry.header
    assert h.block_nbytes == 2 * 2 * 16 * 4 and h.token_nbytes == 4 * h.block_nbytes
    assert h.kv_offset % DATA_ALIGN == 0 and h.header_nbytes % DATA_ALIGN == 0
    assert h.total_nbytes == len(entry.data) == h.kv_offset + 64 * h.token_nbytes
    for token in (0, 17, 63):
        whole = h.token_range(token)
        assert whole.nbytes == h.token_nbytes
        record = np.frombuffer(entry.data[whole.start : whole.stop], dtype=np.float32).reshape(4, 2, 2, 16)
        np.testing.assert_array_equal(record[:, 0], k[:, :, token])  # (L, H, D): every layer's K of this token
        np.testing.assert_array_equal(record[:, 1], v[:, :, token])
        late = h.token_layers_range(token, 2, 4)
        assert late.stop == whole.stop and late.nbytes == 2 * h.block_nbytes
    with pytest.raises(IndexError):
        h.token_range(64)
    with pytest.raises(IndexError):
        h.token_layers_range(0, 3, 3)


def test_multi_dimensional_positions_round_trip():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 1, 6, 8)).astype(np.float16)  # (L, H, T, D)
    positions = np.stack([np.zeros(6), np.repeat(np.arange(2), 3), np.tile(np.arange(3), 2)], axis=1) + 10  # (T, 3)
    entry = Entry.from_arrays(model_id="m", grid=(2, 3), positions=positions, encoder_output=np.zeros(0), k=k, v=k)
    parsed = parse_header(memoryview(entry.data)).header
    assert parsed.position_dims == 3 and parsed.num_tokens == 6
    np.testing.assert_array_equal(parsed.positions_array(), positions)
    with pytest.raises(EntryFormatError):
        Entry.from_arrays(model_id="m", grid=(2, 3), positions=np.zeros((3, 6)), encoder_output=np.zeros(0), k=k, v=k)


def test_parse_and_verify_round_trip():
    entry, *_ = make_entry(2)
    buf = memoryview(entry.data)
    parsed = parse_header(buf)
    assert parsed.header == entry.header and parsed.block_xxh3.shape == (64, 4)
    verify_full(buf, parsed)
    verify_blocks(buf, parsed, 63, 0, 4)
    assert kv_array(buf, parsed.header).shape == (64, 4, 2, 2, 16)
    assert entry.data[:4] == MAGIC


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b.__setitem__(slice(0, 4), b"XXXX"),  # magic
        lambda b: struct.pack_into("<H", b, 4, 99),  # version
        lambda b: b.__setitem__(PREFIX.size + 3, b[PREFIX.size + 3] ^ 1),  # metadata
        lambda b: b.__setitem__(-1, b[-1] ^ 0xFF),  # last KV byte: whole-payload check
    ],
)
def test_damage_is_detected(damage):
    entry, *_ = make_entry(3)
    buf = bytearray(entry.data)
    damage(buf)
    with pytest.raises(DamagedEntryError):
        parsed = parse_header(memoryview(buf))
        verify_full(memoryview(buf), parsed)


@pytest.mark.parametrize("cut", [0, 10, PREFIX.size, 1000, -1])
def test_truncation_is_detected(cut):
    entry, *_ = make_entry(3)
    with pytest.raises(DamagedEntryError):
        parse_header(memoryview(entry.data[:cut]))


def test_block_damage_is_local():
    entry, *_ = make_entry(4)
    buf = bytearray(entry.data)
    r = entry.header.token_layers_range(10, 2, 3)
    buf[r.start + 5] ^= 0x10
    parsed = parse_header(memoryview(buf))
    with pytest.raises(DamagedEntryError):
        verify_blocks(memoryview(buf), parsed, 10, 0, 4)
    verify_blocks(memoryview(buf), parsed, 10, 3, 4)
    verify_blocks(memoryview(buf), parsed, 11, 0, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"k": np.zeros((2, 1, 4, 8), np.float16), "v": np.zeros((2, 1, 4, 8), np.float32)},  # dtypes differ
        {"k": np.zeros((2, 1, 4, 8), np.float16), "v": np.zeros((2, 1, 5, 8), np.float16)},  # shapes differ
        {"k": np.zeros((1, 4, 8), np.float16), "v": np.zeros((1, 4, 8), np.float16)},  # not 4-D
        {"k": np.zeros((2, 1, 4, 8), np.int64), "v": np.zeros((2, 1, 4, 8), np.int64)},  # unsupported dtype
        {"positions": [0, 1, 2]},  # wrong count
        {"positions": list(range(8))},  # 8 positions for 4 tokens
        {"positions": [0, 1, 2, 2**31]},  # not int32
        {"grid": (3, 3)},  # grid does not hold 4 tokens
        {"k": np.zeros((2, 1, 4, 8), np.float16), "v": np.zeros((2, 1, 4, 8), np.float16), "kv_dtype": "bfloat16"},
    ],
)
def test_malformed_arrays_are_refused(kwargs):
    args = {"model_id": "m", "grid": (2, 2), "positions": [0, 1, 2, 3], "encoder_output": np.zeros((4, 2)),
            "k": np.zeros((2, 1, 4, 8), np.float16), "v": np.zeros((2, 1, 4, 8), np.float16)} | kwargs
    with pytest.raises(EntryFormatError):
        Entry.from_arrays(**args)


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    k = torch.randn(2, 1, 4, 8, dtype=torch.bfloat16)  # (L, H, T, D)
    entry = Entry.from_arrays(model_id="m", grid=(2, 2), positions=torch.arange(4), encoder_output=torch.zeros(4, 3),
                              k=k, v=k)
    assert entry.header.kv_dtype == "bfloat16" and entry.header.encoder_dtype == "float32"
    stored = kv_array(memoryview(entry.data), entry.header)  # (T, L, 2, H, D) uint16 bits
    expected = k.permute(2, 0, 1, 3).contiguous().view(torch.int16).numpy().view(np.uint16)  # (T, L, H, D)
    np.testing.assert_array_equal(stored[:, :, 0], expected)
    with pytest.raises(EntryFormatError):
        Entry.from_arrays(model_id="m", grid=(2, 2), positions=range(4), encoder_output=torch.zeros(4),
                          k=k, v=k, kv_dtype="float16")


def test_prefix_digest_round_trips_and_is_optional() -> None:
    import numpy as np

    from store.entry import Entry, parse_header

    arrays = {"k": np.zeros((2, 1, 4, 8), np.float16), "v": np.zeros((2, 1, 4, 8), np.float16),
              "encoder_output": np.zeros((4, 3), np.float16), "positions": np.arange(4), "grid": (2, 2)}
    plain = Entry.from_arrays(model_id="m", **arrays)
    marked = Entry.from_arrays(model_id="m", prefix_digest="f" * 32, **arrays)
    assert parse_header(memoryview(plain.data)).header.prefix_digest == ""
    assert b"prefix_digest" not in plain.data  # entries without one carry no such field
    assert parse_header(memoryview(marked.data)).header.prefix_digest == "f" * 32


def test_a_derived_mark_round_trips_is_checked_and_cannot_be_rewritten_under_the_seal() -> None:
    from settings.secret import DataPlaneSecret
    from store.entry import seal_entry
    from store.seal import EntrySeal

    arrays = {"k": np.zeros((2, 1, 4, 8), np.float16), "v": np.zeros((2, 1, 4, 8), np.float16),
              "encoder_output": np.zeros((4, 3), np.float16), "positions": np.arange(4), "grid": (2, 2)}
    seal = EntrySeal(DataPlaneSecret(b"d" * 32))
    derived = Entry.from_arrays(model_id="m", derived_from="a" * 64, derivation="selector=attention_only", seal=seal,
                                **arrays)
    header = parse_header(memoryview(derived.data)).header
    assert header.derived and header.derived_from == "a" * 64 and header.derivation == "selector=attention_only"
    plain = parse_header(memoryview(Entry.from_arrays(model_id="m", **arrays).data)).header
    assert not plain.derived and plain.derivation == ""
    for bad in ({"derived_from": "A" * 64}, {"derived_from": "a" * 63}, {"derivation": "x"},
                {"derived_from": "a" * 64, "derivation": "x" * 257}):
        with pytest.raises(EntryFormatError):
            Entry.from_arrays(model_id="m", **arrays, **bad)  # type: ignore[arg-type]
    # Whoever can write the store but holds no secret cannot unmark a derived entry (so that it would serve as an
    # alias) or point it at another alias: the metadata is under the seal's MAC.
    buf = bytearray(derived.data)
    seal_entry(buf, "k" * 64, seal)
    parse_header(memoryview(buf), key="k" * 64, seal=seal)
    forged = bytearray(bytes(buf).replace(b'"derived_from":"' + b"a" * 64, b'"derived_from":"' + b"b" * 64))
    assert forged != buf
    # its plain checksum made to match, as anyone can
    struct.pack_into("<Q", forged, 40, _header_xxh3(memoryview(forged), derived.header.block_table_offset))
    parse_header(memoryview(forged))  # intact but for the seal
    with pytest.raises(DamagedEntryError, match="seal|MAC|forged"):
        parse_header(memoryview(forged), key="k" * 64, seal=seal)
