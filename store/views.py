"""Read results: EntryView (a whole verified entry) and SparseRead (some tokens' layers, all their KV heads or a
head range), both zero-copy handles (a head range is cut out when gathered: the tier's bytes hold whole blocks).

Both are context managers. Their memoryviews point into tier-owned memory (an mmap of a shared-memory file, or an
LMDB page inside a read transaction) and stay valid only until the handle is closed; copy what must outlive it
(bytes(view), np.array(...)). Each tier documents what else holds across close (see DramTier, LmdbTier).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from store.entry import (
    DTYPES,
    EntryHeader,
    ParsedHeader,
    kv_array,
    parse_header,
    verify_blocks,
    verify_encoder,
    verify_full,
    verify_kv,
)
from store.errors import InvalidReadError
from store.seal import EntrySeal


class _Handle:
    """Owns the release of the tier memory its views point into."""

    def __init__(self, tier: str, release: Callable[[], None]) -> None:
        self.tier = tier
        self._release: Callable[[], None] | None = release

    @property
    def closed(self) -> bool:
        return self._release is None

    def close(self) -> None:
        """Release the tier memory. Views handed out earlier must not be used afterwards. Idempotent."""
        release, self._release = self._release, None
        if release is not None:
            self._drop_views()
            release()

    def _drop_views(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class EntryView(_Handle):
    """A whole entry whose header, encoder output and KV were verified when it was read."""

    def __init__(self, *, tier: str, buffer: memoryview, parsed: ParsedHeader, release: Callable[[], None]) -> None:
        super().__init__(tier, release)
        self.header: EntryHeader = parsed.header
        self.buffer = buffer  # the whole entry, read-only

    @property
    def encoder_output(self) -> memoryview:
        r = self.header.encoder_range
        return self.buffer[r.start : r.stop]

    @property
    def kv(self) -> memoryview:
        """The KV region: (T, L, 2, kv_heads, head_dim) patch-first bytes."""
        r = self.header.kv_range
        return self.buffer[r.start : r.stop]

    def kv_array(self) -> np.ndarray:
        """Zero-copy numpy view (T, L, 2, kv_heads, head_dim); bfloat16 as uint16. Valid until close()."""
        return kv_array(self.buffer, self.header)

    def encoder_array(self) -> np.ndarray:
        """Zero-copy numpy view of the encoder output in its stored shape. Valid until close()."""
        dtype = DTYPES[self.header.encoder_dtype]
        return np.frombuffer(self.encoder_output, dtype=dtype).reshape(self.header.encoder_shape)

    def _drop_views(self) -> None:
        release_view(self.buffer)


class SparseSegment(NamedTuple):
    """Consecutive requested tokens whose requested layers lie in one byte range.

    data: (token_count, layer_stop - layer_start, 2, kv_heads, head_dim) bytes, whole blocks with every KV head even
    when the read asked for a head range (gather, gather_into and shape hold only those); tokens are
    token_indices[first : first + token_count] of the SparseRead.
    """

    first: int
    token_count: int
    data: memoryview


class SparseRead(_Handle):
    """Layers [layer_start, layer_stop) of chosen tokens, KV heads [head_start, head_stop) of each; every block read
    was verified whole (all heads: a block's checksum covers them all). Nothing else was read.

    The head range is what a tensor-parallel rank holds (store.heads.rank_heads); by default every head. bytes_read
    counts KV bytes read from the tier, whole blocks (the header area is read too, and not counted here).
    """

    def __init__(self, *, tier: str, header: EntryHeader, token_indices: tuple[int, ...], layer_start: int,
                 layer_stop: int, segments: tuple[SparseSegment, ...], release: Callable[[], None],
                 encoder: memoryview | None = None, head_start: int = 0, head_stop: int | None = None) -> None:
        super().__init__(tier, release)
        self.header = header
        self.token_indices = token_indices
        self.layer_start = layer_start
        self.layer_stop = layer_stop
        self.head_start = head_start
        self.head_stop = header.kv_heads if head_stop is None else head_stop
        self.segments = segments
        self.encoder = encoder  # the verified encoder output, when it was asked for
        self.bytes_read = sum(s.data.nbytes for s in segments)

    @property
    def all_heads(self) -> bool:
        """Whether the read holds every KV head (then a segment's bytes are the gathered bytes as they are)."""
        return self.head_start == 0 and self.head_stop == self.header.kv_heads

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """(len(token_indices), layer_stop - layer_start, 2, head_stop - head_start, head_dim); without a head range
        head_stop - head_start is the entry's kv_heads."""
        h = self.header
        return (len(self.token_indices), self.layer_stop - self.layer_start, 2, self.head_stop - self.head_start,
                h.head_dim)

    def gather(self) -> bytes:
        """One copy in request order, of self.shape (only the read's heads)."""
        if self.all_heads:
            return b"".join(s.data for s in self.segments)
        return self.gather_array().tobytes()

    def gather_array(self) -> np.ndarray:
        """A copy in request order as an array of self.shape and the stored dtype."""
        if self.all_heads:
            return np.frombuffer(self.gather(), dtype=DTYPES[self.header.kv_dtype]).reshape(self.shape)
        return self.gather_into(np.empty(self.shape, dtype=DTYPES[self.header.kv_dtype]))

    def gather_into(self, out: np.ndarray) -> np.ndarray:
        """Copy into a caller's C-contiguous array of self.shape and the stored dtype (e.g. a pinned host buffer):
        one copy (of only the read's heads, strided out of the whole blocks when it has a head range), without the
        GIL for large segments. Returns out."""
        if out.shape != self.shape or out.dtype != DTYPES[self.header.kv_dtype] or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous {self.shape} {DTYPES[self.header.kv_dtype]}, got "
                             f"{out.shape} {out.dtype}")
        if self.all_heads:
            for segment in self.segments:
                rows = out[segment.first : segment.first + segment.token_count]
                np.copyto(rows, np.frombuffer(segment.data, dtype=out.dtype).reshape(rows.shape))
            return out
        _, layers, _, _, head_dim = out.shape
        stored = (layers, 2, self.header.kv_heads, head_dim)
        for segment in self.segments:
            blocks = np.frombuffer(segment.data, dtype=out.dtype).reshape(segment.token_count, *stored)
            np.copyto(out[segment.first : segment.first + segment.token_count],
                      blocks[:, :, :, self.head_start : self.head_stop])
        return out

    def encoder_array(self) -> np.ndarray:
        """Zero-copy numpy view of the encoder output in its stored shape. Valid until close()."""
        if self.encoder is None:
            raise InvalidReadError("the encoder output was not asked for (with_encoder=True)")
        return np.frombuffer(self.encoder, dtype=DTYPES[self.header.encoder_dtype]).reshape(self.header.encoder_shape)

    def _drop_views(self) -> None:
        for segment in self.segments:
            release_view(segment.data)
        if self.encoder is not None:
            release_view(self.encoder)


def release_view(view: memoryview) -> None:
    """Release a view unless numpy arrays made from it are still alive; then the memory is freed when they are."""
    try:
        view.release()
    except BufferError:
        pass  # an array from kv_array()/encoder_array() still refers to it; the caller was told not to use it


def open_full(tier: str, buffer: memoryview, release: Callable[[], None], *, key: str, seal: EntrySeal) -> EntryView:
    """Verify a whole entry stored under ``key`` (its seal, then every checksum). Raises DamagedEntryError (the
    caller releases and reports absent)."""
    parsed = parse_header(buffer, key=key, seal=seal)
    verify_full(buffer, parsed)
    return EntryView(tier=tier, buffer=buffer, parsed=parsed, release=release)


def check_head_range(header: EntryHeader, heads: tuple[int, int] | None) -> tuple[int, int]:
    """The head range [start, stop) a read asks for: every KV head when None. Raises InvalidReadError for an empty
    or reversed range, or one past the entry's kv_heads."""
    if heads is None:
        return 0, header.kv_heads
    try:
        head_start, head_stop = (int(x) for x in heads)
    except (TypeError, ValueError):
        raise InvalidReadError(f"heads must be a (start, stop) pair of ints, got {heads!r:.80}") from None
    if not 0 <= head_start < head_stop <= header.kv_heads:
        raise InvalidReadError(f"head range {heads} outside [0, {header.kv_heads}] or empty")
    return head_start, head_stop


def check_sparse_request(header: EntryHeader, token_indices: Sequence[int], layer_range: tuple[int, int],
                         heads: tuple[int, int] | None = None) -> tuple[tuple[int, ...], int, int]:
    """The request's tokens and layer range, checked against the entry (and its head range, see check_head_range).
    Raises InvalidReadError."""
    tokens = tuple(int(t) for t in token_indices)
    layer_start, layer_stop = (int(x) for x in layer_range)
    if not 0 <= layer_start < layer_stop <= header.num_layers:
        raise InvalidReadError(f"layer range {layer_range} outside [0, {header.num_layers}]")
    check_head_range(header, heads)
    if tokens and not (0 <= tokens[0] and tokens[-1] < header.num_tokens
                       and all(a < b for a, b in zip(tokens, tokens[1:], strict=False))):
        raise InvalidReadError(f"token indices must be strictly increasing within [0, {header.num_tokens})")
    return tokens, layer_start, layer_stop


def open_sparse(tier: str, buffer: memoryview, token_indices: Sequence[int], layer_range: tuple[int, int],
                release: Callable[[], None], *, key: str, seal: EntrySeal, with_encoder: bool = False,
                heads: tuple[int, int] | None = None) -> SparseRead:
    """Verify the header and its seal for ``key``, and exactly the requested blocks (and the encoder output when
    asked); coalesce requested ranges that touch. A request for every block is verified with the whole-region
    checksum in one pass. With ``heads`` the blocks read and verified are the same, whole; the handle gathers only
    those heads.

    Raises DamagedEntryError, or InvalidReadError for a request the entry cannot satisfy.
    """
    parsed = parse_header(buffer, key=key, seal=seal)
    header = parsed.header
    tokens, layer_start, layer_stop = check_sparse_request(header, token_indices, layer_range)
    head_start, head_stop = check_head_range(header, heads)
    encoder = None
    if with_encoder:
        verify_encoder(buffer, parsed)
        r = header.encoder_range
        encoder = buffer[r.start : r.stop]
    whole = len(tokens) == header.num_tokens and (layer_start, layer_stop) == (0, header.num_layers)
    if whole:
        verify_kv(buffer, parsed)
    segments: list[SparseSegment] = []
    run_first, run_start, run_stop = 0, 0, -1
    for position, token in enumerate(tokens):
        if not whole:
            verify_blocks(buffer, parsed, token, layer_start, layer_stop)
        start, stop = header.token_layers_range(token, layer_start, layer_stop)
        if start == run_stop:  # only when all layers are requested and tokens are consecutive
            run_stop = stop
            continue
        if run_stop >= 0:
            segments.append(SparseSegment(run_first, position - run_first, buffer[run_start:run_stop]))
        run_first, run_start, run_stop = position, start, stop
    if run_stop >= 0:
        segments.append(SparseSegment(run_first, len(tokens) - run_first, buffer[run_start:run_stop]))
    return SparseRead(tier=tier, header=header, token_indices=tokens, layer_start=layer_start,
                      layer_stop=layer_stop, segments=tuple(segments), release=release, encoder=encoder,
                      head_start=head_start, head_stop=head_stop)
