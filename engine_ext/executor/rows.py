"""Where each image of each request in an SGLang extend batch sits: prompt rows, batch rows and KV pool slots.

A video's temporal patches are located as images are (an ``ImageRows`` each, with ``patch`` set): Qwen2.5-VL puts
a video's tokens in one span, patch after patch (each the same number of tokens); Qwen3-VL puts each patch in a
span of its own (a timestamp before each). A patch's index among its request's units follows the request's images
(images 0..n-1, then patches), so that what is marked and reported per unit never mixes the two.

SGLang flattens the rows every request computes in this extend (after its radix-cache prefix) into one batch:
request i's rows start at the sum of the earlier requests' extend lengths. An image's item carries its inclusive
absolute offsets in the prompt; the rows of it computed now are those inside [prefix, prefix + extend). Rows
before the prefix already hold K/V in the pool (from the radix cache or an earlier chunk); every row of the
request has a pool slot in ``req_to_token`` once the batch is built.

Pure bookkeeping over the batch's fields (duck-typed), so it is tested without a running engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ImageRows:
    request: int  # index of the request in the batch
    rid: str
    index: int  # the image's index among its request's images, in prompt order
    item_hash: int  # SGLang's hash of the image item (keys its encoder-output cache)
    start: int  # the image's prompt rows: [start, stop)
    stop: int
    lo: int  # the rows of it computed in this extend: [lo, hi), empty when lo == hi
    hi: int
    batch_lo: int  # the batch row of prompt row lo
    slots: torch.Tensor  # KV pool slots of prompt rows [start, stop)
    done: int  # prompt rows [0, done) have K/V in the pool once this extend is computed
    positions: torch.Tensor | None = None  # (3, tokens) M-RoPE positions of the image rows, when known
    item: Any = None  # SGLang's multimodal item (pixel values, grid): what a partial vision pass encodes
    patch: int | None = None  # a video's temporal patch: its index among the request's patches (plan.patches)
    encoder_rows: tuple[int, int] | None = None  # a patch: its rows of the video item's encoder output
    # a patch: the hashes of its request's video items, and the rows of the items before its own, for where SGLang
    # keeps one encoder output for all of a request's videos (items in several spans: Qwen3-VL's)
    encoder_group: tuple[int, ...] = ()
    group_rows: int = 0

    @property
    def tokens(self) -> int:
        return self.stop - self.start

    @property
    def in_extend(self) -> bool:
        return self.hi > self.lo

    @property
    def whole_in_extend(self) -> bool:
        return self.lo == self.start and self.hi == self.stop

    @property
    def complete(self) -> bool:
        """Every row of the image has its K/V in the pool after this extend (computed now or before)."""
        return self.stop <= self.done

    @property
    def batch_rows(self) -> torch.Tensor:
        """Batch rows of the image rows computed now, in prompt order (on the batch's device)."""
        return torch.arange(self.batch_lo, self.batch_lo + self.hi - self.lo, device=self.slots.device)

    def batch_rows_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """Batch rows of some image tokens computed in this extend (indices into the image, within [lo, hi))."""
        return tokens.to(self.slots.device) + (self.batch_lo - (self.lo - self.start))

    @property
    def local_rows(self) -> torch.Tensor:
        """The same rows as indices into the image (0 = its first token)."""
        return torch.arange(self.lo - self.start, self.hi - self.start, device=self.slots.device)


def reuse_depths(counts: list[int], local_rows: torch.Tensor) -> torch.Tensor:
    """Per image row: how many leading layers compute it (the rest reuse its stored K/V).

    counts[l] is how many of the image's first tokens layer l recomputes (non-increasing in l), so row i is computed
    at exactly the layers l with counts[l] > i, which are the first ones. local_rows: (rows,) indices into the image;
    returns (rows,) on their device.
    """
    if not counts:
        return torch.zeros_like(local_rows)
    recomputed = torch.tensor(counts, device=local_rows.device)  # (layers,)
    return (recomputed.unsqueeze(1) > local_rows.unsqueeze(0)).sum(0)  # (layers, rows) -> (rows,)


def _is_modality(item: object, name: str) -> bool:
    modality = getattr(item, "modality", None)
    return getattr(modality, "name", str(modality)).upper().endswith(name)


def patch_spans(item: Any) -> list[tuple[int, int]]:
    """A video item's temporal patches as prompt rows [start, stop), in order; [] where its spans do not divide into
    its ``video_grid_thw``'s patches (not planned for)."""
    try:
        patches = int(torch.as_tensor(item.video_grid_thw).reshape(-1, 3)[0, 0])
    except (AttributeError, IndexError, TypeError, ValueError):
        return []
    spans = [(int(a), int(b) + 1) for a, b in item.offsets or ()]
    if len(spans) == patches:  # one span a patch (Qwen3-VL)
        return spans
    if len(spans) == 1 and patches > 0 and (spans[0][1] - spans[0][0]) % patches == 0:  # one span (Qwen2.5-VL)
        start, stop = spans[0]
        size = (stop - start) // patches
        return [(start + i * size, start + (i + 1) * size) for i in range(patches)]
    return []


def locate(forward_batch, req_to_token: torch.Tensor) -> list[ImageRows]:
    """Every image and video patch of every request of an extend batch (read mm_inputs before the model's forward
    clears it)."""
    found: list[ImageRows] = []
    mm_inputs = forward_batch.mm_inputs or []
    batch_start = 0
    for request, mm in enumerate(mm_inputs):
        extend = int(forward_batch.extend_seq_lens_cpu[request])
        if mm is not None:
            rows = _Request(forward_batch, req_to_token, request, batch_start, mm)
            images = [item for item in mm.mm_items if _is_modality(item, "IMAGE")]
            for index, item in enumerate(images):
                if len(item.offsets) != 1:
                    continue  # an image in several spans is not planned for
                start, last = (int(x) for x in item.offsets[0])
                found.append(rows.of(index, item, start, last + 1))
            videos = [item for item in mm.mm_items if _is_modality(item, "VIDEO")]
            group = tuple(item.hash for item in videos)
            patch, before = 0, 0
            for item in videos:
                encoded = 0
                for start, stop in patch_spans(item):
                    found.append(rows.of(len(images) + patch, item, start, stop, patch=patch,
                                         encoder_rows=(encoded, encoded + stop - start), encoder_group=group,
                                         group_rows=before))
                    encoded += stop - start
                    patch += 1
                before += sum(int(b) - int(a) + 1 for a, b in item.offsets or ())
        batch_start += extend
    return found


class _Request:
    """One request of the batch, making the ImageRows of its spans."""

    def __init__(self, forward_batch, req_to_token: torch.Tensor, request: int, batch_start: int, mm) -> None:
        self.request, self.batch_start = request, batch_start
        self.rid = str(forward_batch.rids[request])
        self.prefix = int(forward_batch.extend_prefix_lens_cpu[request])
        self.extend = int(forward_batch.extend_seq_lens_cpu[request])
        self.slots = req_to_token[int(forward_batch.req_pool_indices[request])]
        self.positions = getattr(mm, "mrope_positions", None)

    def of(self, index: int, item: Any, start: int, stop: int, **patch: Any) -> ImageRows:
        lo, hi = max(start, self.prefix), min(stop, self.prefix + self.extend)
        positions = self.positions
        return ImageRows(
            request=self.request, rid=self.rid, index=index, item_hash=item.hash, start=start, stop=stop, lo=lo,
            hi=max(hi, lo), batch_lo=self.batch_start + lo - self.prefix, slots=self.slots[start:stop].to(torch.long),
            done=self.prefix + self.extend,
            positions=positions[:, start:stop].clone() if positions is not None and positions.shape[-1] >= stop
            else None,
            item=item, **patch)
