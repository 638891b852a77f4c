"""Deterministic real-shaped entries and the bytes a read of them must return (importable by child processes)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from store.entry import DTYPES, Entry

SMALL = {"layers": 4, "kv_heads": 2, "tokens": 64, "head_dim": 16}


def key_for(label: object) -> str:
    return hashlib.sha256(str(label).encode()).hexdigest()


def make_entry(seed: int, *, dtype: str = "float16", layers: int = 4, kv_heads: int = 2, tokens: int = 64,
               head_dim: int = 16) -> tuple[Entry, np.ndarray, np.ndarray, np.ndarray]:
    """An entry whose model_id names its seed, and its K, V (L, H, T, D) and encoder output as stored (bf16 as
    uint16 bits)."""
    rng = np.random.default_rng(seed)
    k32 = rng.standard_normal((layers, kv_heads, tokens, head_dim), dtype=np.float32)  # (L, H, T, D)
    v32 = rng.standard_normal((layers, kv_heads, tokens, head_dim), dtype=np.float32)
    encoder = rng.standard_normal((tokens, 8), dtype=np.float32).astype(np.float16)  # (T, hidden)
    positions = np.arange(tokens) + 5
    grid = (tokens // 8, 8) if tokens % 8 == 0 else (1, tokens)
    if dtype == "bfloat16":  # bf16 is the top half of float32's bits; numpy carries it as uint16
        k, v = (k32.view(np.uint32) >> 16).astype(np.uint16), (v32.view(np.uint32) >> 16).astype(np.uint16)
    else:
        k, v = k32.astype(DTYPES[dtype]), v32.astype(DTYPES[dtype])
    entry = Entry.from_arrays(model_id=f"seed-{seed}", grid=grid, positions=positions, encoder_output=encoder,
                              k=k, v=v, kv_dtype=dtype)
    return entry, k, v, encoder


def expected_sparse(k: np.ndarray, v: np.ndarray, tokens: Sequence[int], layer_start: int, layer_stop: int) -> bytes:
    """Slice the original arrays: (n, layer_stop - layer_start, 2, H, D) bytes."""
    idx = list(tokens)
    kv = np.stack([k[layer_start:layer_stop][:, :, idx], v[layer_start:layer_stop][:, :, idx]])  # (2, l, H, n, D)
    return np.ascontiguousarray(kv.transpose(3, 1, 0, 2, 4)).tobytes()  # (n, l, 2, H, D)
