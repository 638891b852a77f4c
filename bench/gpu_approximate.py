"""An approximate hit against a miss on one GPU, at 4K and 8K image tokens: for when a device is lent.

A random-weight Qwen3-VL-8B-shaped model (bf16, transformers, SDPA), built on the device (no weights travel).
Per size, medians of repeats (CUDA events), every part run for real:

    vision/full      the vision tower over the whole image
    vision/partial   the partial vision pass (offline.reference.vision) over a box of changed tokens and its ring
                     (--changed of the tokens); where this transformers lacks what it needs, a band of patch rows
                     of the same size through the plain tower stands in, and the output says so
    llm              the decoder's full prefill of the image tokens and a 64-token question
    warmup           layers [0, W) over every row, and the question's attention on the image at each (the score)
    late             layers [W, L) over R (rho * n rows) and the question, over B's K/V (beta * n rows of the
                     alias, on the GPU) and their own: the causal kernel, as R and B lie in prompt order
    h2d              B's late-layer K/V from pinned host memory (the sparse read's copy)

    miss               = vision/full + llm
    approximate/full   = vision/full + warmup + late + h2d
    approximate/partial = vision/partial + warmup + late + h2d

    python bench/gpu_approximate.py [--tokens 4096 8192] [--rho 0.3] [--beta 0.1] [--warmup 3] [--tiny]

About 3 minutes on an H200 (model build included); ``--tiny`` runs a small shape anywhere (CPU included) to
check the script. Prints one JSON line per size and a table of ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.timing import timed  # noqa: E402

QUESTION = 64


def config(tiny: bool):
    from transformers import Qwen3VLConfig

    if tiny:
        text = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, vocab_size=4096, rope_theta=5e6,
                    rope_scaling={"rope_type": "default", "mrope_section": [8, 4, 4], "mrope_interleaved": True},
                    max_position_embeddings=262144, tie_word_embeddings=False)
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128,
                      deepstack_visual_indexes=[0], num_position_embeddings=2304, in_channels=3)
    else:
        text = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=5e6,
                    rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
                    max_position_embeddings=262144, tie_word_embeddings=False)
        vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096,
                      deepstack_visual_indexes=[8, 16, 24], num_position_embeddings=2304, in_channels=3)
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
                         vision_start_token_id=151652, vision_end_token_id=151653)


def box_tokens(h: int, w: int, share: float) -> torch.Tensor:
    """A box of about ``share`` of an (h, w) token grid, with a ring of one token (Qwen3-VL's margin)."""
    from engine_ext.vision import QWEN3_VL, margin_tokens

    side = max(1, int((share * h * w) ** 0.5))
    changed = torch.zeros(h, w, dtype=torch.bool)
    changed[h // 3 : h // 3 + side, w // 3 : w // 3 + side] = True
    return margin_tokens(changed, arch=QWEN3_VL, window_tokens=None).flatten().nonzero().flatten()


def measure(n: int, model, args, device: str) -> dict:
    """One image size's parts and ratios (see the module docstring)."""
    from transformers import DynamicCache

    dtype = torch.bfloat16
    visual, lm = model.model.visual, model.model.language_model
    tc = model.config.text_config
    layers, kv_heads, head_dim, warmup = tc.num_hidden_layers, tc.num_key_value_heads, tc.head_dim, args.warmup
    all_layers = lm.layers
    side = int(round(n ** 0.5)) * 2  # patches per side (2 x 2 merge)
    gh, gw = side, (n * 4) // side
    patches = gh * gw
    n = patches // 4
    pixel_values = torch.randn(patches, 3 * 2 * 16 * 16, dtype=dtype, device=device)
    grid = torch.tensor([[1, gh, gw]], device=device)
    rows = n + QUESTION
    embeds = torch.randn(1, rows, tc.hidden_size, dtype=dtype, device=device) * 0.02
    recompute, reuse = int(args.rho * n), int(args.beta * n)
    r: dict = {"image_tokens": n, "rho": args.rho, "beta": args.beta, "W": warmup}
    with torch.inference_mode():
        r["vision_full_ms"] = timed(lambda: visual(pixel_values, grid_thw=grid), args.reps, device)
        tokens = box_tokens(gh // 2, gw // 2, args.changed)
        r["vision_partial_tokens"] = len(tokens)
        try:
            from offline.reference.model import ReferenceModel
            from offline.reference.vision import encode_partial

            reference = ReferenceModel(model, processor=None)
            r["vision_partial_ms"] = timed(lambda: encode_partial(reference, (pixel_values, grid.cpu()), tokens),
                                           args.reps, device)
            r["vision_partial_kind"] = "partial pass"
        except Exception as exc:  # an older transformers: the same number of patches as a band
            band = max(2, (len(tokens) * 4 // gw // 2) * 2)
            band_pv, band_grid = pixel_values[: band * gw], torch.tensor([[1, band, gw]], device=device)
            r["vision_partial_ms"] = timed(lambda: visual(band_pv, grid_thw=band_grid), args.reps, device)
            r["vision_partial_kind"] = f"band of {band} patch rows ({type(exc).__name__}: {exc})"[:200]
        r["llm_ms"] = timed(lambda: model.lm_head(lm(inputs_embeds=embeds).last_hidden_state[:, -1:]),
                            args.reps, device)

        def warm() -> None:
            lm.layers = all_layers[:warmup]
            cache = DynamicCache(config=tc)
            lm(inputs_embeds=embeds, past_key_values=cache, use_cache=True)
            for index in range(warmup):  # the question's attention on the image's keys: the score
                layer_cache: Any = cache.layers[index]  # a full-attention layer's: it holds keys
                keys: torch.Tensor = layer_cache.keys[0]  # (kv_heads, rows, head_dim)
                queries = keys[:, -QUESTION:].repeat_interleave(tc.num_attention_heads // kv_heads, 0)
                scores = queries @ keys[:, :n].repeat_interleave(tc.num_attention_heads // kv_heads, 0).mT
                scores.softmax(-1).sum((0, 1))
            lm.layers = all_layers

        r["warmup_ms"] = timed(warm, args.reps, device)
        late_rows = embeds[:, : recompute + QUESTION]
        alias_k = torch.randn(1, kv_heads, reuse, head_dim, dtype=dtype, device=device)

        def late() -> None:
            cache = DynamicCache(config=tc)
            for index in range(layers):  # B's K/V at every late layer (layers < W hold nothing, unused)
                cache.update(alias_k, alias_k, index)
            lm.layers = all_layers[warmup:]
            try:
                out = lm(inputs_embeds=late_rows, past_key_values=cache, use_cache=True)
                model.lm_head(out.last_hidden_state[:, -1:])
            finally:
                lm.layers = all_layers

        r["late_ms"] = timed(late, args.reps, device)
        b_bytes = (layers - warmup) * 2 * kv_heads * head_dim * reuse * 2
        r["b_bytes"], r["entry_bytes"] = b_bytes, layers * 2 * kv_heads * head_dim * n * 2
        if device == "cuda":
            host = torch.empty(b_bytes // 2, dtype=dtype, pin_memory=True)
            target = torch.empty_like(host, device=device)
            r["h2d_ms"] = timed(lambda: target.copy_(host, non_blocking=True), args.reps, device)
            del host, target
    h2d = r.get("h2d_ms", 0.0)
    miss = r["vision_full_ms"] + r["llm_ms"]
    r["miss_ms"] = miss
    r["approximate_full_x"] = (r["vision_full_ms"] + r["warmup_ms"] + r["late_ms"] + h2d) / miss
    r["approximate_partial_x"] = (r["vision_partial_ms"] + r["warmup_ms"] + r["late_ms"] + h2d) / miss
    r["llm_only_x"] = r["llm_ms"] / miss
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--rho", type=float, default=0.3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--changed", type=float, default=0.1, help="share of the tokens changed (a box)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    from transformers import Qwen3VLForConditionalGeneration

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    cfg = config(args.tiny)
    began = time.time()
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(cfg, dtype=dtype).eval()
    print(f"[approx] model built in {time.time() - began:.1f} s on {device}", flush=True)
    results = []
    for n in args.tokens:
        r = measure(n, model, args, device)
        results.append(r)
        print(json.dumps(r), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'tokens':>7} {'miss ms':>9} {'llm x':>7} {'approx/full x':>14} {'approx/partial x':>17} "
          f"{'B bytes / entry':>16}")
    for r in results:
        print(f"{r['image_tokens']:>7} {r['miss_ms']:9.1f} {r['llm_only_x']:7.3f} {r['approximate_full_x']:14.3f} "
              f"{r['approximate_partial_x']:17.3f} {r['b_bytes'] / r['entry_bytes']:16.3f}")


if __name__ == "__main__":
    main()
