"""Store entries as the worker reads and writes them: an image's encoder output, positions and K/V of all layers.

Writes (after a miss) go whole: :func:`to_entry`. Reads for an exact plan come in two parts, so that the forward
waits for as little as possible:

- :func:`read_head` before the forward: the header and the encoder output (verified), a few percent of the entry.
  The encoder output must be in place before the forward embeds the prompt, and the header says whether the entry
  fits this request at all (a miss otherwise, decided before anything runs).
- :class:`KVFetch` during the forward: per group of rows that start reusing stored K/V at the same layer, a sparse
  read of exactly those rows' layers (the store's patch-first layout makes each row's late layers one byte range),
  on a reader thread, waited for only at the layer that first needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from engine_ext.executor.events import FullPrefill
from engine_ext.rope import reposition, reposition_axes
from store import Entry, KVStore, StoreError
from store.entry import DTYPES
from store.seal import PUBLIC, EntrySeal


@dataclass(frozen=True)
class StoredImage:
    encoder: torch.Tensor  # (n, hidden...) as the vision tower gave it
    positions: torch.Tensor  # (3, n) M-RoPE positions where the K were computed
    k: torch.Tensor  # (layers, n, kv_heads, head_dim), after RoPE
    v: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.k.shape[1])


def to_entry(model_id: str, grid: tuple[int, int], image: StoredImage, prefix_digest: str = "",
             seal: EntrySeal = PUBLIC, derived_from: str = "", derivation: str = "") -> Entry:
    """The entry of a stored image, its checksums under ``seal`` (the store's, which seals it for its key on put);
    ``derived_from``/``derivation`` for K/V an approximate plan computed (store.entry.EntryHeader)."""
    return Entry.from_arrays(model_id=model_id, grid=grid, positions=image.positions.T.contiguous(),
                             encoder_output=image.encoder, k=image.k.permute(0, 2, 1, 3), v=image.v.permute(0, 2, 1, 3),
                             prefix_digest=prefix_digest, derived_from=derived_from, derivation=derivation, seal=seal)


def _tensor(array: np.ndarray, dtype_name: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array))  # a private copy: the store's buffer is released after reading
    return tensor.view(torch.bfloat16) if dtype_name == "bfloat16" else tensor


def _positions(header) -> torch.Tensor:
    """(3, n) int64: the M-RoPE positions the stored keys were computed at."""
    return torch.from_numpy(header.positions_array().astype(np.int64)).T.contiguous()


def _fits(header, *, model_id: str, layers: int, kv_heads: int, head_dim: int, tokens: int) -> bool:
    return (header.model_id, header.num_layers, header.kv_heads, header.head_dim, header.num_tokens,
            header.position_dims) == (model_id, layers, kv_heads, head_dim, tokens, 3) and header.kv_dtype in DTYPES


@dataclass(frozen=True)
class EntryHead:
    """What an exact plan needs before the forward."""

    positions: torch.Tensor  # (3, n) int64: the M-RoPE positions the stored keys were computed at
    encoder: torch.Tensor | None  # as the vision tower gave it, on the host (None when not asked for)
    kv_dtype: str
    nbytes: int = 0  # read from the store: the header, and the encoder output when asked for
    prefix_digest: str = ""  # the gateway's digest of the prompt before the image when the entry was made
    derived: bool = False  # computed approximately (store.entry)


def read_head(store: KVStore, key: str, *, model_id: str, layers: int, kv_heads: int, head_dim: int,
              tokens: int, with_encoder: bool = True) -> EntryHead:
    """The entry's header and (unless with_encoder is False) encoder output, verified, if it is present and made
    by this model for an image of this size; else FullPrefill saying which it is not. Reads no K/V."""
    try:
        read = store.get_sparse(key, [], (0, 1), with_encoder=with_encoder)
        if read is None:
            raise FullPrefill("entry_damaged" if store.contains(key) else "entry_missing", key[:16])
    except StoreError as exc:
        raise FullPrefill("store_error", str(exc)) from exc
    with read:
        h = read.header
        if not _fits(h, model_id=model_id, layers=layers, kv_heads=kv_heads, head_dim=head_dim, tokens=tokens):
            raise FullPrefill("entry_foreign", f"{key[:16]} is {h.model_id}'s, {h.num_tokens} tokens")
        encoder = _tensor(read.encoder_array(), h.encoder_dtype) if with_encoder else None
        return EntryHead(positions=_positions(h), encoder=encoder, kv_dtype=h.kv_dtype,
                         nbytes=h.header_nbytes + (h.encoder_nbytes if with_encoder else 0),
                         prefix_digest=h.prefix_digest, derived=h.derived)


_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float64": torch.float64}


@dataclass(frozen=True)
class KVGroup:
    """Stored K/V of some image rows, used at layers [depth, layers)."""

    depth: int
    tokens: tuple[int, ...]  # the rows as indices into the image, increasing
    k: torch.Tensor  # (layers - depth, len(tokens), kv_heads * head_dim), keys moved to this request's positions
    v: torch.Tensor
    ready: torch.cuda.Event | None = None  # on a GPU: recorded on the reader's stream once k and v are there

    def wait(self) -> KVGroup:
        """Make the caller's CUDA stream wait for the reader's copies and turns, and tell the allocator that stream
        uses k and v (the reader's stream made them). SGLang runs the forward on a stream of its own, never the
        reader's: without this the layers could read K/V not yet copied. Nothing to do on a CPU."""
        if self.ready is not None:
            current = torch.cuda.current_stream(self.k.device)
            current.wait_event(self.ready)
            self.k.record_stream(current)
            self.v.record_stream(current)
        return self


class KVFetch:
    """Reads stored K/V on one reader thread; one per worker process. Each fetch is a Future of a KVGroup on the
    requested device, or of None when the store no longer holds an intact copy of those blocks (the caller then
    computes those rows instead). On a GPU the copies and turns run on the reader's own CUDA stream: the caller
    calls ``KVGroup.wait`` on its stream before using the K/V."""

    def __init__(self, on_read: Callable[[int], None] | None = None) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="revisit-kv-reader")
        self._on_read = on_read  # told the bytes of K/V each fetch read from the store

    def fetch(self, store: KVStore, key: str, *, tokens: list[int], depth: int, layers: int, kv_dtype: str,
              delta: int | torch.Tensor, frequencies: torch.Tensor, device: torch.device,
              axes: torch.Tensor | None = None, heads: tuple[int, int] | None = None) -> Future[KVGroup | None]:
        """Rows ``tokens`` of the entry under ``key``, layers [depth, layers), keys moved by ``delta`` positions: one
        step for the whole image (an int), or (3, tokens) steps per M-RoPE axis and token with ``axes``, the axis of
        each rotary frequency (tokens that moved inside the image: engine_ext.rope.reposition_axes). ``heads``: the
        KV heads [start, stop) to read (a tensor-parallel rank's), None for all."""
        return self._thread.submit(_read_group, store, key, tuple(tokens), depth, layers, kv_dtype, delta,
                                   frequencies, device, axes, self._on_read, heads)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def _read_group(store: KVStore, key: str, tokens: tuple[int, ...], depth: int, layers: int, kv_dtype: str,
                delta: int | torch.Tensor, frequencies: torch.Tensor, device: torch.device,
                axes: torch.Tensor | None, on_read: Callable[[int], None] | None = None,
                heads: tuple[int, int] | None = None) -> KVGroup | None:
    read = store.get_sparse(key, tokens, (depth, layers), heads=heads)
    if read is None:
        return None
    with read:
        # (tokens, layers - depth, 2, kv_heads, head_dim): one copy out of the store, into pinned memory when the
        # K/V go on to a GPU (a DMA copy from there).
        host = torch.empty(read.shape, dtype=torch.int16 if kv_dtype == "bfloat16" else _TORCH_DTYPES[kv_dtype],
                           pin_memory=device.type == "cuda")
        read.gather_into(host.numpy().view(DTYPES[kv_dtype]))
    if on_read is not None:
        on_read(host.numel() * host.element_size())
    kv = host.view(torch.bfloat16) if kv_dtype == "bfloat16" else host
    stream = _reader_stream(device)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        kv = kv.to(device, non_blocking=True).transpose(0, 1)  # (layers - depth, tokens, 2, kv_heads, head_dim)
        if isinstance(delta, torch.Tensor):
            assert axes is not None, "per-axis steps need the axis of each frequency"
            k = reposition_axes(kv[:, :, 0], delta.to(device), frequencies.to(device), axes)
        else:
            k = reposition(kv[:, :, 0], delta, frequencies.to(device))  # on the device: a GPU turns them in no time
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(stream)
    return KVGroup(depth=depth, tokens=tokens, k=k.flatten(2), v=kv[:, :, 1].flatten(2), ready=ready)


_streams: dict[torch.device, torch.cuda.Stream] = {}


def _reader_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The reader thread's CUDA stream for a device (made once), None off a GPU."""
    if device.type != "cuda":
        return None
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def read(store: KVStore, key: str, *, model_id: str, layers: int, kv_heads: int, head_dim: int,
         tokens: int) -> StoredImage | None:
    """The whole entry under key as a StoredImage if it is present, intact and made by this model for an image of
    this size; else None. For checking what a worker stored (tests, tools); the executor reads with read_head and
    KVFetch."""
    view = store.get(key)
    if view is None:
        return None
    with view:
        h = view.header
        if not _fits(h, model_id=model_id, layers=layers, kv_heads=kv_heads, head_dim=head_dim, tokens=tokens):
            return None
        kv = _tensor(view.kv_array(), h.kv_dtype)  # (T, L, 2, H, D)
        encoder = _tensor(view.encoder_array(), h.encoder_dtype)
        positions = _positions(h)
    k = kv[:, :, 0].permute(1, 0, 2, 3).contiguous()
    v = kv[:, :, 1].permute(1, 0, 2, 3).contiguous()
    return StoredImage(encoder=encoder, positions=positions, k=k, v=v)
