"""Where each image of each request in an SGLang extend batch sits: prompt rows, batch rows and KV pool slots.

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


def _is_image(item: object) -> bool:
    modality = getattr(item, "modality", None)
    return getattr(modality, "name", str(modality)).upper().endswith("IMAGE")


def locate(forward_batch, req_to_token: torch.Tensor) -> list[ImageRows]:
    """Every image of every request of an extend batch (read mm_inputs before the model's forward clears it)."""
    found: list[ImageRows] = []
    mm_inputs = forward_batch.mm_inputs or []
    batch_start = 0
    for request, mm in enumerate(mm_inputs):
        prefix = int(forward_batch.extend_prefix_lens_cpu[request])
        extend = int(forward_batch.extend_seq_lens_cpu[request])
        if mm is not None:
            pool_row = int(forward_batch.req_pool_indices[request])
            images = [item for item in mm.mm_items if _is_image(item)]
            prompt_positions = getattr(mm, "mrope_positions", None)
            for index, item in enumerate(images):
                if len(item.offsets) != 1:
                    continue  # an image in several spans is not planned for
                start, last = (int(x) for x in item.offsets[0])
                lo, hi = max(start, prefix), min(last + 1, prefix + extend)
                hi = max(hi, lo)
                found.append(ImageRows(
                    request=request, rid=str(forward_batch.rids[request]), index=index, item_hash=item.hash,
                    start=start, stop=last + 1, lo=lo, hi=hi, batch_lo=batch_start + lo - prefix,
                    slots=req_to_token[pool_row, start : last + 1].to(torch.long), done=prefix + extend,
                    positions=(prompt_positions[:, start : last + 1].clone()
                               if prompt_positions is not None and prompt_positions.shape[-1] > last else None),
                    item=item,
                ))
        batch_start += extend
    return found
