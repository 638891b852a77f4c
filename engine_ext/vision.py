"""The partial vision pass: a Qwen2.5-VL / Qwen3-VL vision tower run over a subset of an image's LLM tokens.

When a new image is a near-duplicate of a cached one, only the LLM tokens whose pixels changed (plus a margin) need
the vision tower again; every other token's encoder output can come from the cached image. The partial pass runs
the tower over the patches of those tokens only.

Terms. An image of processor grid ``(t=1, H, W)`` patches is merged ``m x m`` (m = 2) into the LLM token grid
``(h, w) = (H / m, W / m)``; an LLM token's index is row-major over ``(h, w)``. The tower's patch sequence (and the
processor's ``pixel_values`` rows) is in merge-window order: each token's ``m * m`` patches are consecutive, tokens
in row-major order, so token ``i`` owns patch rows ``i*m*m .. i*m*m + m*m - 1`` (:func:`patch_rows`). The tower
outputs one row per LLM token (after the patch merger), and for Qwen3-VL the deepstack features (one ``(n, hidden)``
tensor per deepstack layer).

"At their true positions" means: every patch of the subset gets exactly the position signals it has in the full
pass over the whole image, not those of a crop. The rotary angles are those of the patch's (row, column) in the
full ``H x W`` grid, and for Qwen3-VL the learned absolute position embedding is the one interpolated for the full
grid's size (the table resampled to ``H x W``, then the patch's row taken). Both are computed for the whole image
with the tower's own methods and indexed by the subset's patch rows. Everything else (patch embedding, blocks,
mergers, dtypes) is the tower's own modules, called as its own forward calls them.

Attention is restricted to the subset. Qwen2.5-VL's windowed blocks attend within each of the model's own windows
(tiled from the top-left of the token grid, ``window_tokens`` LLM tokens a side), over the window's tokens that are
in the subset; its full-attention blocks (``fullatt_block_indexes``) and every Qwen3-VL block attend over the whole
subset. That is the only error the subset introduces: a token's attention renormalises over the subset instead of
the whole image, so whatever the tokens outside would have contributed is missing. For Qwen2.5-VL,
:func:`margin_tokens` takes whole windows, so a windowed block sees exactly its full-pass window; only the
full-attention blocks (and everything after the first of them) lose context. Qwen3-VL attends globally in every
block, so there the error starts at the first block; the margin ring re-encodes the changed tokens' nearest
neighbours too (the tokens their change affects most in a tower whose attention is local). When the subset is
every token the pass is the full pass (the same numbers up to float summation order, ~1e-6 relative in float32).

A composite encoder output (partial pass over the margin tokens of the new image, the cached image's output
elsewhere) has a second, separate error: the tokens taken from the cached image were computed with the old pixels
in their context.

Images only (t = 1), one image per call. Everything but :func:`encode_partial_sglang` is pure torch and shared with
``offline.reference.vision`` (the transformers towers); SGLang is imported only inside
:func:`encode_partial_sglang`, which runs SGLang's towers (``sglang.srt.models.qwen2_5_vl`` / ``qwen3_vl``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

QWEN2_5_VL = "qwen2_5_vl"
QWEN3_VL = "qwen3_vl"
ARCHS = (QWEN2_5_VL, QWEN3_VL)


# --- which tokens ---


def window_tokens_of(visual: Any) -> int | None:
    """LLM tokens per side of a Qwen2.5-VL tower's attention window (``window_size`` px / patch / merge, as the model
    computes it); None for a tower without window attention (Qwen3-VL). Works for the transformers and SGLang towers
    alike (both keep ``window_size``, ``patch_size`` and ``spatial_merge_size``)."""
    window_size = getattr(visual, "window_size", None)
    if not window_size:
        return None
    return int(window_size) // int(visual.spatial_merge_size) // int(visual.patch_size)


def margin_tokens(changed: torch.Tensor, *, arch: str, window_tokens: int | None, ring: int = 1) -> torch.Tensor:
    """The LLM tokens a partial pass encodes for these changed tokens: (h, w) bool, like ``changed``.

    Qwen2.5-VL: every token of every attention window that holds a changed token. Windows are ``window_tokens``
    tokens a side, tiled from the top-left corner; the model pads the grid at the bottom and right up to a multiple
    of the window, so the last row and column of windows may be narrower (never shifted).
    Qwen3-VL (no windows): the changed tokens dilated by ``ring`` tokens in all eight directions, clipped at the
    grid's edges. ``window_tokens`` is ignored.
    """
    if changed.dim() != 2 or changed.dtype != torch.bool:
        raise ValueError(f"changed must be an (h, w) bool tensor, got {changed.dtype} {tuple(changed.shape)}")
    h, w = changed.shape
    if arch == QWEN2_5_VL:
        if not window_tokens or window_tokens < 1:
            raise ValueError(f"Qwen2.5-VL needs window_tokens >= 1, got {window_tokens!r}")
        windows_w = -(-w // window_tokens)
        window = (torch.arange(h)[:, None] // window_tokens) * windows_w + torch.arange(w)[None, :] // window_tokens
        hit = torch.zeros(-(-h // window_tokens) * windows_w, dtype=torch.bool)
        hit[window[changed]] = True
        return hit[window]
    if arch == QWEN3_VL:
        if ring < 0:
            raise ValueError(f"ring must be >= 0, got {ring}")
        if ring == 0:
            return changed.clone()
        grown = F.max_pool2d(changed[None, None].float(), kernel_size=2 * ring + 1, stride=1, padding=ring)
        return grown[0, 0] > 0
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def changed_tokens(before: torch.Tensor, after: torch.Tensor, grid_thw: torch.Tensor | Sequence[int],
                   merge: int = 2) -> torch.Tensor:
    """(h, w) bool: the LLM tokens whose patches differ between two images' ``pixel_values`` of the same grid."""
    h, w = token_grid(grid_thw, merge)
    if before.shape != after.shape:
        raise ValueError(f"pixel_values of different shapes: {tuple(before.shape)} vs {tuple(after.shape)}")
    return (before != after).reshape(h * w, -1).any(dim=1).reshape(h, w)


# --- where they are ---


def patch_rows(tokens: torch.Tensor, merge: int = 2) -> torch.Tensor:
    """The rows of the patch sequence (and of ``pixel_values``) that make up these LLM tokens, token by token."""
    unit = merge * merge
    return (tokens[:, None] * unit + torch.arange(unit, device=tokens.device)).reshape(-1)


def window_order(window_index: torch.Tensor, cu_window_seqlens: torch.Tensor | Sequence[int], tokens: torch.Tensor,
                 merge: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A subset of tokens in a Qwen2.5-VL tower's window order, and its windows' boundaries.

    ``window_index`` (every token, in the order the model lays them out: window by window) and ``cu_window_seqlens``
    (window boundaries in patches, repeats allowed) are the model's own, from its ``get_window_index``. Returns
    ``order``, positions into ``tokens`` that lay the subset out the same way (the model's order, tokens outside the
    subset left out), and the subset's window boundaries in patches (int32, empty windows dropped), for the windowed
    blocks' ``cu_seqlens``. With every token, ``tokens[order]`` is ``window_index`` and the boundaries are the
    model's.
    """
    cu = torch.as_tensor(cu_window_seqlens, dtype=torch.long).cpu().unique_consecutive()
    window_sizes = (cu[1:] - cu[:-1]) // (merge * merge)
    window_index, tokens = window_index.cpu(), tokens.cpu()
    n = window_index.numel()
    window_of = torch.empty(n, dtype=torch.long)
    window_of[window_index] = torch.repeat_interleave(torch.arange(window_sizes.numel()), window_sizes)
    place = torch.empty(n, dtype=torch.long)  # where the model puts each token
    place[window_index] = torch.arange(n)
    order = torch.argsort(place[tokens])
    counts = torch.bincount(window_of[tokens[order]], minlength=window_sizes.numel())
    counts = counts[counts > 0]
    return order, F.pad(counts.cumsum(0) * merge * merge, (1, 0)).to(torch.int32)


def check_tokens(tokens: torch.Tensor | Sequence[int], count: int) -> torch.Tensor:
    """``tokens`` as a 1-D LongTensor (on the CPU) of distinct LLM token indices in [0, count), at least one."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).cpu()
    if tokens.numel() == 0:
        raise ValueError("a partial pass needs at least one token")
    if int(tokens.min()) < 0 or int(tokens.max()) >= count:
        raise ValueError(f"token indices must lie in [0, {count})")
    if tokens.unique().numel() != tokens.numel():
        raise ValueError("token indices must be distinct")
    return tokens


def token_grid(grid_thw: torch.Tensor | Sequence[int], merge: int = 2) -> tuple[int, int]:
    """The LLM token grid (h, w) of one image's processor ``grid_thw`` (one image, t = 1)."""
    grid = torch.as_tensor(grid_thw).reshape(-1, 3)
    if grid.shape[0] != 1:
        raise ValueError(f"one image per partial pass, got grid_thw of {grid.shape[0]}")
    t, height, width = (int(x) for x in grid[0])
    if t != 1:
        raise ValueError(f"images only (t = 1), got t = {t}")
    return height // merge, width // merge


# --- SGLang's towers ---


@torch.no_grad()
def encode_partial_sglang(visual: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                          tokens: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """SGLang's vision tower over the patches of these LLM tokens only, at their true positions in the full image.

    ``visual`` is the ``visual`` module of SGLang's Qwen2_5_VLForConditionalGeneration (Qwen2_5_VisionTransformer) or
    Qwen3VLForConditionalGeneration (Qwen3VLMoeVisionModel); ``pixel_values`` and ``grid_thw`` (1, 3) are one
    image's processor output; ``tokens`` are distinct LLM token indices of that image. Returns the encoder output of
    those tokens, in the order given: embeddings (len(tokens), hidden) and the deepstack features (one
    (len(tokens), hidden) tensor per deepstack layer; none for Qwen2.5-VL). With every token, in order, this is what
    ``visual(pixel_values, grid_thw)`` returns (split into embeddings and deepstack features). It mirrors SGLang's
    eager forward (the ViT CUDA-graph path computes the same). The subset runs laid out as the full pass lays out
    the image (raster order; Qwen2.5-VL then window by window), so a set of tokens gives the same numbers in
    whatever order it is given.
    """
    merge = int(visual.spatial_merge_size)
    h, w = token_grid(grid_thw, merge)
    tokens = check_tokens(tokens, h * w)
    if pixel_values.shape[0] != h * w * merge * merge:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows, grid_thw {grid_thw.tolist()} needs "
                         f"{h * w * merge * merge}")
    if hasattr(visual, "deepstack_merger_list"):
        return _qwen3_vl(visual, pixel_values, grid_thw, tokens)
    return _qwen2_5_vl(visual, pixel_values, grid_thw, tokens), ()


def _qwen2_5_vl(visual: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mirrors Qwen2_5_VisionTransformer.forward over the subset (sglang/srt/models/qwen2_5_vl.py)."""
    from sglang.srt.layers.attention.vision import prepare_vision_attention_metadata

    merge = int(visual.spatial_merge_size)
    # The subset in window order: window_index over the subset, as the model's forward orders the whole image.
    window_index, cu_window_seqlens = visual.get_window_index(grid_thw)
    order, cu_window_seqlens = window_order(window_index, cu_window_seqlens, tokens, merge)
    rows = patch_rows(tokens[order], merge)

    x = pixel_values[rows].to(device=visual.device, dtype=visual.dtype)
    x = visual.patch_embed(x)
    # Rotary angles of the whole image's patches, taken at the subset's rows: their true positions.
    rotary_pos_emb = visual.rot_pos_emb(grid_thw)[rows.to(visual.device)].to(device=x.device, dtype=x.dtype)
    emb = torch.cat((rotary_pos_emb, rotary_pos_emb), dim=-1)
    position_embeddings = (emb.cos().to(x.device, x.dtype), emb.sin().to(x.device, x.dtype))

    cu_seqlens = torch.tensor([0, x.shape[0]], device=x.device, dtype=torch.int32)  # the whole subset
    cu_window_seqlens = cu_window_seqlens.to(x.device)
    full_metadata = prepare_vision_attention_metadata(cu_seqlens, device=x.device)
    window_metadata = prepare_vision_attention_metadata(cu_window_seqlens, device=x.device)

    fullatt = visual.fullatt_block_indexes
    fullatt = fullatt.tolist() if isinstance(fullatt, torch.Tensor) else list(fullatt)
    x = x.unsqueeze(1)
    for layer_num, blk in enumerate(visual.blocks):
        full = layer_num in fullatt
        x = blk(x, cu_seqlens=cu_seqlens if full else cu_window_seqlens, position_embeddings=position_embeddings,
                forward_metadata=full_metadata if full else window_metadata)
    x = visual.merger(x)
    return x[torch.argsort(order).to(x.device)]  # back to the order of `tokens`


def _qwen3_vl(visual: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
              tokens: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Mirrors Qwen3VLMoeVisionModel.forward over the subset (sglang/srt/models/qwen3_vl.py)."""
    from sglang.srt.layers.attention.vision import prepare_vision_attention_metadata

    merge = int(visual.spatial_merge_size)
    order = torch.argsort(tokens)  # raster order, as the full pass lays the image out
    rows = patch_rows(tokens[order], merge).to(visual.device)
    grid_list = grid_thw.tolist()

    x = pixel_values[rows.to(pixel_values.device)].to(device=visual.device, dtype=visual.dtype)
    x = visual.patch_embed(x)
    # The learned position embeddings interpolated for the whole image, and its rotary angles, at the subset's rows.
    if visual._use_vectorized_pos_embed(len(grid_list)):
        pos_embeds = visual.fast_pos_embed_interpolate_vectorized(grid_list)
    else:
        pos_embeds = visual.fast_pos_embed_interpolate_from_list(grid_list)
    x += pos_embeds[rows]
    cos, sin = visual.rot_pos_emb(grid_list)
    cos, sin = cos[rows], sin[rows]

    token_cu_seqlens = torch.tensor([0, x.shape[0]], dtype=torch.int32)  # the whole subset
    cu_seqlens = token_cu_seqlens.to(visual.device) if visual.device.type != "npu" else token_cu_seqlens
    forward_metadata = prepare_vision_attention_metadata(cu_seqlens, device=visual.device,
                                                         **_flashinfer_cudnn_metadata(visual, token_cu_seqlens))

    x = x.unsqueeze(1)
    deepstack: list[torch.Tensor] = []
    for layer_num, blk in enumerate(visual.blocks):
        x = blk(x, cu_seqlens=cu_seqlens, rotary_pos_emb_cos=cos, rotary_pos_emb_sin=sin,
                forward_metadata=forward_metadata)
        if layer_num in visual.deepstack_visual_indexes:
            deepstack.append(visual.deepstack_merger_list[len(deepstack)](x))
    back = torch.argsort(order).to(x.device)  # to the order of `tokens`
    return visual.merger(x)[back], tuple(features[back] for features in deepstack)


def _flashinfer_cudnn_metadata(visual: Any, token_cu_seqlens: torch.Tensor) -> dict[str, Any]:
    """The extra attention metadata SGLang's Qwen3-VL forward builds for the flashinfer_cudnn backend (none else)."""
    from sglang.srt.runtime_context import get_mm

    if get_mm().mm_attention_backend != "flashinfer_cudnn":
        return {"packed_indptrs": None, "sequence_lengths": None, "flashinfer_max_seqlen": 0}
    cu = token_cu_seqlens.numpy()
    attn_tp_size = 1 if visual.use_data_parallel else visual.tp_size
    offsets = visual.compute_flashinfer_batch_offsets_packed(cu, elem_per_token=visual.hidden_size // attn_tp_size)
    lengths = visual.compute_flashinfer_sequence_lengths_padded(cu)
    return {
        "packed_indptrs": torch.from_numpy(offsets).to(device=visual.device, dtype=torch.int32),
        "sequence_lengths": torch.from_numpy(lengths).to(device=visual.device, dtype=torch.int32).view(-1, 1, 1, 1),
        "flashinfer_max_seqlen": visual.bucket_flashinfer_max_seqlen(int(cu[-1] - cu[0])),
    }
