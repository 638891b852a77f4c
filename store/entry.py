"""The entry format: header + encoder output + KV in patch-first layout, with checksums for partial verification.

Byte layout of one entry (all integers little-endian; offsets from the start of the entry):

    [0, 80)  fixed prefix, struct "<4sHHIIQQQQ32s"
        0  magic          4s   b"RVKV"
        4  version        u16  FORMAT_VERSION
        6  flags          u16  0 (reserved)
        8  meta_nbytes    u32  length of the JSON metadata
       12  header_nbytes  u32  length of the whole header area = offset of the encoder output
       16  total_nbytes   u64  length of the whole entry (truncation check)
       24  encoder_xxh3   u64  seeded xxh3_64 of the encoder output bytes
       32  kv_xxh3        u64  seeded xxh3_64 of the whole KV region (full reads)
       40  header_xxh3    u64  xxh3_64 of bytes [0, 40) + metadata + positions
       48  mac            32s  the seal's MAC over the store key, bytes [0, 48) and [80, header_nbytes) (store/seal.py)
    [80, 80+meta_nbytes)            metadata, compact JSON (model id, grid, dtypes, shapes), padded to 8
    positions   int32[T, P]         original positions of the image tokens (P = position_dims: 1 for RoPE,
                                    3 for M-RoPE's (t, h, w)), padded to 8
    block table u64[T, L]           seeded xxh3_64 of each (token, layer) block; padded to 64 -> header_nbytes
                                    (not under header_xxh3: a damaged table entry only makes its block read absent;
                                    under the MAC, so no table can be rewritten to match forged blocks)

Checksums are seeded by the deployment secret and the MAC is keyed by it (store/seal.py): an entry is sealed for
one key when it is put, and every read checks the seal for the key it reads.
    [header_nbytes, +E)             encoder output, C order, encoder_dtype; padded to 64 -> kv_offset
    [kv_offset, +T*token_nbytes)    KV, patch-first: (T, L, 2, kv_heads, head_dim), kv_dtype
        token record i = [layer0 K, layer0 V, layer1 K, layer1 V, ...]; one (token, layer) block = K then V,
        each (kv_heads, head_dim). So token i is one byte range and its layers [a, b) one contiguous sub-range.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
import xxhash

from store.errors import DamagedEntryError, EntryFormatError
from store.seal import MAC_BYTES, PUBLIC, EntrySeal

MAGIC = b"RVKV"
FORMAT_VERSION = 3  # 2: the seal (seeded checksums, a MAC over the key and the header area); 3: its MAC is keyed BLAKE3
PREFIX = struct.Struct("<4sHHIIQQQQ32s")
HEADER_XXH3_OFFSET = 40
MAC_OFFSET = 48
DATA_ALIGN = 64
_DERIVED_FROM = re.compile(r"(?:[0-9a-f]{64})?")

# dtype name (torch spelling) -> numpy dtype that stores it; bfloat16 travels as its raw 16 bits
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
}

def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype].itemsize
    except KeyError:
        raise EntryFormatError(f"unsupported dtype {dtype!r}; known: {sorted(DTYPES)}") from None


class ByteRange(NamedTuple):
    """Half-open byte range [start, stop) within an entry."""

    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, kw_only=True)
class EntryHeader:
    """What an entry describes, and (computed from that) where every byte of it lies."""

    model_id: str
    grid: tuple[int, int]  # (rows, cols) of image tokens after merging
    kv_dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    positions: tuple[int, ...]  # original positions, flattened (T, position_dims) row-major
    encoder_shape: tuple[int, ...]
    encoder_dtype: str
    position_dims: int = 1
    # The gateway's digest of the prompt before the image when the entry was made (gateway/intake.py
    # prefix_digests); empty when unknown. At most 256 characters.
    prefix_digest: str = ""
    # A derived entry's KV were computed approximately (an approximate hit's, stored so that the image's next sight
    # is exact): ``derived_from`` names the entry they were computed from (its alias), ``derivation`` the plan that
    # computed them (selector, W, R/B counts, vision pass), at most 256 characters. Both empty for an entry whose KV
    # are what a full prefill computes (a miss's). No derived entry is ever an alias itself (errors would compound).
    derived_from: str = ""
    derivation: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.prefix_digest, str) or len(self.prefix_digest) > 256:
            raise EntryFormatError("prefix_digest must be a string of at most 256 characters")
        if not isinstance(self.derived_from, str) or not _DERIVED_FROM.fullmatch(self.derived_from):
            raise EntryFormatError("derived_from must be empty or a 64-character lowercase hex key")
        if not isinstance(self.derivation, str) or len(self.derivation) > 256 or (
                bool(self.derivation) and not self.derived_from):
            raise EntryFormatError("derivation must be a string of at most 256 characters, given with derived_from")
        _itemsize(self.kv_dtype)
        _itemsize(self.encoder_dtype)
        if min(self.num_layers, self.kv_heads, self.head_dim) < 1 or min(self.grid) < 1:
            raise EntryFormatError("layers, kv_heads, head_dim and grid must be positive")
        if self.position_dims < 1 or len(self.positions) % self.position_dims:
            raise EntryFormatError(f"{len(self.positions)} positions do not split into {self.position_dims} dims")
        if self.grid[0] * self.grid[1] != self.num_tokens:
            raise EntryFormatError(f"grid {self.grid} does not hold {self.num_tokens} tokens")
        if any(not 0 <= p < 2**31 for p in self.positions) or any(d < 0 for d in self.encoder_shape):
            raise EntryFormatError("positions must fit in int32 and encoder_shape must be non-negative")

    @property
    def num_tokens(self) -> int:
        return len(self.positions) // self.position_dims

    @property
    def derived(self) -> bool:
        return bool(self.derived_from)

    def positions_array(self) -> np.ndarray:
        """(T, position_dims) int32."""
        return np.array(self.positions, dtype=np.int32).reshape(self.num_tokens, self.position_dims)

    @cached_property
    def block_nbytes(self) -> int:
        """Bytes of one (token, layer) block: K then V, each (kv_heads, head_dim)."""
        return 2 * self.kv_heads * self.head_dim * _itemsize(self.kv_dtype)

    @property
    def token_nbytes(self) -> int:
        return self.num_layers * self.block_nbytes

    @cached_property
    def encoder_nbytes(self) -> int:
        return int(np.prod(self.encoder_shape, dtype=np.int64)) * _itemsize(self.encoder_dtype)

    @cached_property
    def meta_bytes(self) -> bytes:
        meta = {
            "model_id": self.model_id,
            "grid": list(self.grid),
            "kv_dtype": self.kv_dtype,
            "num_layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_tokens": self.num_tokens,
            "position_dims": self.position_dims,
            "encoder_shape": list(self.encoder_shape),
            "encoder_dtype": self.encoder_dtype,
        }
        if self.prefix_digest:
            meta["prefix_digest"] = self.prefix_digest
        if self.derived_from:
            meta["derived_from"] = self.derived_from
            meta["derivation"] = self.derivation
        return json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()

    @cached_property
    def positions_offset(self) -> int:
        return _align(PREFIX.size + len(self.meta_bytes), 8)

    @cached_property
    def block_table_offset(self) -> int:
        return _align(self.positions_offset + 4 * len(self.positions), 8)

    @cached_property
    def header_nbytes(self) -> int:
        return _align(self.block_table_offset + 8 * self.num_tokens * self.num_layers, DATA_ALIGN)

    @property
    def encoder_range(self) -> ByteRange:
        return ByteRange(self.header_nbytes, self.header_nbytes + self.encoder_nbytes)

    @cached_property
    def kv_offset(self) -> int:
        return _align(self.header_nbytes + self.encoder_nbytes, DATA_ALIGN)

    @property
    def kv_range(self) -> ByteRange:
        return ByteRange(self.kv_offset, self.total_nbytes)

    @property
    def total_nbytes(self) -> int:
        return self.kv_offset + self.num_tokens * self.token_nbytes

    def token_range(self, token: int) -> ByteRange:
        """Bytes of all layers' K and V of image token `token`."""
        return self.token_layers_range(token, 0, self.num_layers)

    def token_layers_range(self, token: int, layer_start: int, layer_stop: int) -> ByteRange:
        """Bytes of layers [layer_start, layer_stop) of image token `token`: one contiguous range."""
        if not 0 <= token < self.num_tokens or not 0 <= layer_start < layer_stop <= self.num_layers:
            raise IndexError(f"token {token} layers [{layer_start}, {layer_stop}) outside {self.num_tokens}x"
                             f"{self.num_layers}")
        start = self.kv_offset + token * self.token_nbytes + layer_start * self.block_nbytes
        return ByteRange(start, start + (layer_stop - layer_start) * self.block_nbytes)


class ParsedHeader(NamedTuple):
    """A verified header and the checksums it carries."""

    header: EntryHeader
    encoder_xxh3: int
    kv_xxh3: int
    block_xxh3: np.ndarray  # (T, L) uint64, a view into the entry buffer
    seal: EntrySeal  # whose seeded checksums the entry carries


@dataclass(frozen=True)
class Entry:
    """A complete entry in memory: its header and its bytes (the layout in this module's docstring). The store seals
    ``data`` in place for the key it is put under (:func:`seal_entry`)."""

    header: EntryHeader
    data: bytearray

    @classmethod
    def from_arrays(
        cls,
        *,
        model_id: str,
        grid: tuple[int, int],
        positions: Any,
        encoder_output: Any,
        k: Any,
        v: Any,
        kv_dtype: str | None = None,
        encoder_dtype: str | None = None,
        prefix_digest: str = "",
        derived_from: str = "",
        derivation: str = "",
        seal: EntrySeal = PUBLIC,
    ) -> Entry:
        """Build an entry from numpy arrays or CPU/GPU torch tensors (copied to host), its checksums under ``seal``
        (the store's: ``KVStore.seal``); the store seals it for a key when it is put.

        k, v: (layers, kv_heads, tokens, head_dim). encoder_output: any shape. For numpy bfloat16 pass the raw bits
        as uint16 with kv_dtype="bfloat16" (or encoder_dtype="bfloat16").
        """
        k_np, k_dtype = _to_numpy(k, kv_dtype)
        v_np, v_dtype = _to_numpy(v, kv_dtype)
        enc_np, enc_dtype = _to_numpy(encoder_output, encoder_dtype)
        if k_np.ndim != 4 or k_np.shape != v_np.shape or k_dtype != v_dtype:
            raise EntryFormatError(f"k and v must match and be (layers, kv_heads, tokens, head_dim): "
                                   f"{k_np.shape}/{k_dtype} vs {v_np.shape}/{v_dtype}")
        layers, kv_heads, tokens, head_dim = k_np.shape
        positions_np = np.asarray(positions.cpu() if hasattr(positions, "cpu") else positions)
        positions_np = positions_np[:, None] if positions_np.ndim == 1 else positions_np  # (T,) -> (T, 1)
        if positions_np.ndim != 2 or positions_np.shape[0] != tokens:
            raise EntryFormatError(f"positions {positions_np.shape} must be (T,) or (T, P) for {tokens} tokens")
        header = EntryHeader(model_id=model_id, grid=(int(grid[0]), int(grid[1])), kv_dtype=k_dtype,
                             num_layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                             positions=tuple(positions_np.reshape(-1).tolist()), position_dims=positions_np.shape[1],
                             encoder_shape=tuple(int(d) for d in enc_np.shape), encoder_dtype=enc_dtype,
                             prefix_digest=prefix_digest, derived_from=derived_from, derivation=derivation)
        buf = bytearray(header.total_nbytes)
        kv = np.frombuffer(buf, dtype=DTYPES[k_dtype], offset=header.kv_offset).reshape(
            tokens, layers, 2, kv_heads, head_dim)  # (T, L, 2, H, D)
        kv[:, :, 0] = k_np.transpose(2, 0, 1, 3)  # (L, H, T, D) -> (T, L, H, D)
        kv[:, :, 1] = v_np.transpose(2, 0, 1, 3)
        enc_range = header.encoder_range
        buf[enc_range.start : enc_range.stop] = np.ascontiguousarray(enc_np).tobytes()
        _write_header(buf, header, seal)
        return cls(header, buf)


def _to_numpy(array: Any, dtype_name: str | None) -> tuple[np.ndarray, str]:
    if type(array).__module__.startswith("torch"):
        import torch

        tensor = array.detach().to("cpu").contiguous()
        name = str(tensor.dtype).removeprefix("torch.")
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16)
        np_array = tensor.numpy()
        if name == "bfloat16":
            np_array = np_array.view(np.uint16)
        if dtype_name is not None and dtype_name != name:
            raise EntryFormatError(f"tensor is {name}, not {dtype_name}")
        return np_array, name
    np_array = np.asarray(array)
    name = dtype_name or np_array.dtype.name
    if name not in DTYPES or np_array.dtype.newbyteorder("<") != DTYPES[name].newbyteorder("<"):
        raise EntryFormatError(f"array dtype {np_array.dtype} cannot be stored as {name!r}")
    return np_array.astype(DTYPES[name], copy=False), name


def _write_header(buf: bytearray, header: EntryHeader, seal: EntrySeal) -> None:
    """Fill the header area of a buffer whose encoder output and KV are already in place (the MAC left zero)."""
    mv = memoryview(buf)
    meta = header.meta_bytes
    mv[PREFIX.size : PREFIX.size + len(meta)] = meta
    positions = np.frombuffer(buf, dtype="<i4", count=len(header.positions), offset=header.positions_offset)
    positions[:] = header.positions
    table = np.frombuffer(buf, dtype="<u8", count=header.num_tokens * header.num_layers,
                          offset=header.block_table_offset)  # (T * L,)
    block, base = header.block_nbytes, header.kv_offset
    checksum = seal.checksum
    table[:] = [checksum(mv[base + j * block : base + (j + 1) * block]) for j in range(len(table))]
    enc, kv = header.encoder_range, header.kv_range
    PREFIX.pack_into(buf, 0, MAGIC, FORMAT_VERSION, 0, len(meta), header.header_nbytes, header.total_nbytes,
                     checksum(mv[enc.start : enc.stop]), checksum(mv[kv.start : kv.stop]), 0, bytes(MAC_BYTES))
    struct.pack_into("<Q", buf, HEADER_XXH3_OFFSET, _header_xxh3(mv, header.block_table_offset))


def _header_xxh3(mv: memoryview, table_offset: int) -> int:
    state = xxhash.xxh3_64()
    state.update(mv[:HEADER_XXH3_OFFSET])
    state.update(mv[PREFIX.size : table_offset])
    return state.intdigest()


def _signed(buf: memoryview, header_nbytes: int) -> list[memoryview]:
    """What an entry's MAC covers besides its key: the header area less the MAC field."""
    return [buf[:MAC_OFFSET], buf[PREFIX.size : header_nbytes]]


def seal_entry(buf: bytearray, key: str, seal: EntrySeal) -> None:
    """Write the MAC that binds the entry in ``buf`` (built under ``seal``) to the store key ``key``."""
    header_nbytes = struct.unpack_from("<I", buf, 12)[0]
    view = memoryview(buf)
    buf[MAC_OFFSET : MAC_OFFSET + MAC_BYTES] = seal.mac(key, _signed(view, header_nbytes))


def parse_header(buf: memoryview, *, key: str | None = None, seal: EntrySeal = PUBLIC) -> ParsedHeader:
    """Read and verify the header of an entry held in `buf` (the whole entry), and with ``key`` its seal for that
    key. Touches only the header area.

    Raises DamagedEntryError on bad magic/version, a length that does not match (truncation), a checksum mismatch,
    or a seal that is not the one ``seal`` makes for ``key`` (a forged entry, or one moved from another key).
    """
    if len(buf) < PREFIX.size:
        raise DamagedEntryError("shorter than the prefix")
    magic, version, _flags, meta_n, header_n, total_n, enc_x, kv_x, header_x, given_mac = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise DamagedEntryError(f"bad magic/version {magic!r}/{version}")
    if total_n != len(buf) or not PREFIX.size + meta_n <= header_n <= total_n:
        raise DamagedEntryError(f"length {len(buf)} does not match the header ({total_n})")
    try:
        meta = json.loads(bytes(buf[PREFIX.size : PREFIX.size + meta_n]))
        tokens = int(meta["num_tokens"])
        position_count = tokens * int(meta["position_dims"])
        positions_offset = _align(PREFIX.size + meta_n, 8)
        table_offset = _align(positions_offset + 4 * position_count, 8)
        if table_offset > header_n or _header_xxh3(buf, table_offset) != header_x:
            raise DamagedEntryError("header checksum mismatch")
        positions = np.frombuffer(buf, dtype="<i4", count=position_count, offset=positions_offset)
        header = EntryHeader(model_id=meta["model_id"], grid=tuple(meta["grid"]), kv_dtype=meta["kv_dtype"],
                             num_layers=meta["num_layers"], kv_heads=meta["kv_heads"], head_dim=meta["head_dim"],
                             positions=tuple(positions.tolist()), encoder_shape=tuple(meta["encoder_shape"]),
                             encoder_dtype=meta["encoder_dtype"],
                             position_dims=meta["position_dims"], prefix_digest=meta.get("prefix_digest", ""),
                             derived_from=meta.get("derived_from", ""), derivation=meta.get("derivation", ""))
    except (ValueError, KeyError, TypeError, EntryFormatError) as exc:
        raise DamagedEntryError(f"unreadable metadata: {exc}") from exc
    if header.header_nbytes != header_n or header.total_nbytes != total_n:
        raise DamagedEntryError("metadata disagrees with the prefix")
    if key is not None and not seal.matches(key, _signed(buf, header_n), given_mac):
        raise DamagedEntryError("the entry's seal does not hold for its key: forged, or moved from another key")
    table = np.frombuffer(buf, dtype="<u8", count=tokens * header.num_layers, offset=table_offset)
    return ParsedHeader(header, enc_x, kv_x, table.reshape(tokens, header.num_layers), seal)


def verify_full(buf: memoryview, parsed: ParsedHeader) -> None:
    """Check the encoder output and the whole KV region. Raises DamagedEntryError."""
    verify_encoder(buf, parsed)
    verify_kv(buf, parsed)


def verify_encoder(buf: memoryview, parsed: ParsedHeader) -> None:
    """Check the encoder output. Raises DamagedEntryError."""
    enc = parsed.header.encoder_range
    if parsed.seal.checksum(buf[enc.start : enc.stop]) != parsed.encoder_xxh3:
        raise DamagedEntryError("encoder output checksum mismatch")


def verify_kv(buf: memoryview, parsed: ParsedHeader) -> None:
    """Check the whole KV region in one pass. Raises DamagedEntryError."""
    kv = parsed.header.kv_range
    if parsed.seal.checksum(buf[kv.start : kv.stop]) != parsed.kv_xxh3:
        raise DamagedEntryError("KV checksum mismatch")


def verify_blocks(buf: memoryview, parsed: ParsedHeader, token: int, layer_start: int, layer_stop: int) -> None:
    """Check the (token, layer) blocks of one token's layers [layer_start, layer_stop). Raises DamagedEntryError."""
    header = parsed.header
    block = header.block_nbytes
    start = header.token_layers_range(token, layer_start, layer_stop).start
    expected = parsed.block_xxh3[token]
    checksum = parsed.seal.checksum
    for layer in range(layer_start, layer_stop):
        if checksum(buf[start : start + block]) != expected[layer]:
            raise DamagedEntryError(f"block (token {token}, layer {layer}) checksum mismatch")
        start += block


def kv_array(buf: memoryview, header: EntryHeader) -> np.ndarray:
    """A read-only numpy view of the KV region: (T, L, 2, kv_heads, head_dim); bfloat16 shows as uint16."""
    kv = header.kv_range
    return np.frombuffer(buf, dtype=DTYPES[header.kv_dtype], count=kv.nbytes // _itemsize(header.kv_dtype),
                         offset=kv.start).reshape(header.num_tokens, header.num_layers, 2, header.kv_heads,
                                                  header.head_dim)


def split_kv(kv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(T, L, 2, H, D) patch-first -> K, V each (L, H, T, D), the shape Entry.from_arrays takes (copies)."""
    return (np.ascontiguousarray(kv[:, :, 0].transpose(1, 2, 0, 3)),
            np.ascontiguousarray(kv[:, :, 1].transpose(1, 2, 0, 3)))
