"""Store entries as the worker reads and writes them: an image's encoder output, positions and K/V of all layers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from store import Entry, KVStore
from store.entry import DTYPES


@dataclass(frozen=True)
class StoredImage:
    encoder: torch.Tensor  # (n, hidden...) as the vision tower gave it
    positions: torch.Tensor  # (3, n) M-RoPE positions where the K were computed
    k: torch.Tensor  # (layers, n, kv_heads, head_dim), after RoPE
    v: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.k.shape[1])


def to_entry(model_id: str, grid: tuple[int, int], image: StoredImage, origin: str = "") -> Entry:
    return Entry.from_arrays(model_id=model_id, grid=grid, positions=image.positions.T.contiguous(),
                             encoder_output=image.encoder, k=image.k.permute(0, 2, 1, 3), v=image.v.permute(0, 2, 1, 3),
                             origin=origin)


def _tensor(array: np.ndarray, dtype_name: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array))  # a private copy: the store's buffer is released after reading
    return tensor.view(torch.bfloat16) if dtype_name == "bfloat16" else tensor


def read(store: KVStore, key: str, *, model_id: str, layers: int, kv_heads: int, head_dim: int,
         tokens: int) -> StoredImage | None:
    """The entry under key if it is present, intact and made by this model for an image of this size; else None."""
    view = store.get(key)
    if view is None:
        return None
    with view:
        h = view.header
        if (h.model_id, h.num_layers, h.kv_heads, h.head_dim, h.num_tokens, h.position_dims) != (
                model_id, layers, kv_heads, head_dim, tokens, 3) or h.kv_dtype not in DTYPES:
            return None
        kv = _tensor(view.kv_array(), h.kv_dtype)  # (T, L, 2, H, D)
        encoder = _tensor(view.encoder_array(), h.encoder_dtype)
        positions = torch.from_numpy(h.positions_array().astype(np.int64)).T.contiguous()
    k = kv[:, :, 0].permute(1, 0, 2, 3).contiguous()
    v = kv[:, :, 1].permute(1, 0, 2, 3).contiguous()
    return StoredImage(encoder=encoder, positions=positions, k=k, v=v)
