"""The partial vision pass over the transformers towers: the reference's side of ``engine_ext.vision``.

:func:`encode_partial` runs ``ReferenceModel.hf.model.visual`` over the patches of some LLM tokens of one image, at
their true positions in the full image, with attention restricted to the subset (see ``engine_ext.vision`` for
what that means and the error it introduces). It calls transformers' own tower forward: its vision encoders take
the grid-dependent tensors precomputed by name (``transformers.vision_utils``), so the partial pass hands it the
whole image's position ids (and for Qwen3-VL the interpolation taps of the learned position embeddings) at the
subset's patch rows, and attention segments over the subset: one segment for the full-attention blocks and, for
Qwen2.5-VL's windowed blocks, the model's own windows cut down to the subset. With every token it is
``ReferenceModel.encode``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.vision_utils import (
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)

from engine_ext.vision import check_tokens, patch_rows, token_grid, window_order
from offline.reference.model import QWEN2_5_VL, EncoderOutput, Prompt, ReferenceModel


def image_inputs(model: ReferenceModel, source: Prompt | tuple[torch.Tensor, torch.Tensor],
                 image: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values`` and ``grid_thw`` (1, 3) of one image: the ``image``-th of a prompt, or given as they are."""
    if not isinstance(source, Prompt):
        pixel_values, grid_thw = source
        return pixel_values, torch.as_tensor(grid_thw).reshape(-1, 3)
    if source.pixel_values is None or source.image_grid_thw is None or image >= len(source.image_grid_thw):
        raise ValueError(f"the prompt has no image {image}")
    sizes = source.image_grid_thw.prod(-1).tolist()
    start = sum(sizes[:image])
    return source.pixel_values[start:start + sizes[image]], source.image_grid_thw[image:image + 1]


@torch.no_grad()
def encode_partial(model: ReferenceModel, source: Prompt | tuple[torch.Tensor, torch.Tensor],
                   tokens: torch.Tensor | Sequence[int], *, image: int = 0) -> EncoderOutput:
    """The encoder output of these LLM tokens of one image (in the order given), from the transformers tower run
    over their patches only. ``source`` is a prompt (its ``image``-th image) or (pixel_values, grid_thw)."""
    visual = model.hf.model.visual
    pixel_values, grid_thw = image_inputs(model, source, image)
    merge = int(visual.spatial_merge_size)
    h, w = token_grid(grid_thw, merge)
    tokens = check_tokens(tokens, h * w)
    device = visual.patch_embed.proj.weight.device
    # The subset in raster order (for Qwen2.5-VL the tower then lays it out window by window, as the full image).
    order = torch.argsort(tokens)
    tokens = tokens[order]
    rows = patch_rows(tokens, merge)
    # The whole image's position ids (patch row and column), at the subset's rows: their true positions.
    precomputed = {
        "position_ids": get_vision_position_ids(grid_thw, merge)[rows],
        "cu_seqlens": torch.tensor([0, rows.numel()], dtype=torch.int32, device=device),  # the whole subset
    }
    if model.arch == QWEN2_5_VL:
        window_index, cu_window_seqlens = get_vision_window_index(
            grid_thw, spatial_merge_size=merge, window_size=visual.window_size, patch_size=visual.patch_size)
        in_windows, cu_window_seqlens = window_order(window_index, cu_window_seqlens, tokens, merge)
        precomputed |= {"window_index": in_windows.to(device), "cu_window_seqlens": cu_window_seqlens.to(device)}
    else:
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=merge)
        precomputed |= {"interp_indices": indices[rows].to(device), "interp_weights": weights[rows].to(device)}
    out = visual(pixel_values[rows].type(visual.dtype), grid_thw=grid_thw, return_dict=True, **precomputed)
    deepstack = getattr(out, "deepstack_features", None) or []
    back = torch.argsort(order).to(out.pooler_output.device)  # to the order of `tokens`
    return EncoderOutput(out.pooler_output[back], tuple(features[back] for features in deepstack))
