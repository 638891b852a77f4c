"""Rows-only attention, the per-sequence loop against the batched call, side by side, per batch size.

engine_ext.executor.attention has two implementations of the same computation: ``attend_rows`` (one SDPA call per
sequence, a Python loop) and ``attend_rows_batched`` (the batch's sequences padded into one SDPA call per group
under a size limit). PoolAttention uses the batched one on CUDA and the loop elsewhere; this bench is what that
choice rests on. Per batch size, a random pool with every sequence's rows in scattered slots, each sequence a
``--tokens`` prompt extended whole, its last ``--active`` rows asking (the layers after an approximate plan's
warmup); both implementations on the same inputs, medians of repeats (CUDA events on a GPU, perf_counter on CPU):

    loop ms       attend_rows
    batched ms    attend_rows_batched (groups: how many SDPA calls the limit split it into)
    loop/batched  the speedup of the batched call (above 1: it is faster)
    max diff      the largest difference between the two outputs (float rounding only)
    peak MiB      on CUDA, each one's peak allocation above the inputs

    python bench/rows_attention.py [--batches 1 4 16 64] [--tokens 1024] [--active 256] [--heads 28]
                                   [--kv-heads 4] [--head-dim 128] [--reps 10] [--device cuda|cpu]
                                   [--dtype bfloat16|float16|float32] [--threads N] [--tiny]

The default shape is Qwen2.5-VL-7B's attention (28 query heads, 4 kv heads, head_dim 128), bf16 on a GPU and
float32 on CPU. ``--tiny`` runs a small shape (4 heads, 2 kv heads, head_dim 32, 128-token prompts, 32 active
rows) in a few seconds on CPU, to check the script (on a busy CPU, ``--threads 1`` keeps the medians steady).
Prints one JSON line per batch size and a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.timing import timed  # noqa: E402


def peak_mib(fn, device: str) -> float | None:
    """On CUDA, fn's peak allocation above what was allocated before it (MiB); None elsewhere."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def measure(batch: int, args, device: str, dtype: torch.dtype) -> dict:
    """One batch size: both implementations on the same random batch (see the module docstring)."""
    from engine_ext.executor import attention
    from engine_ext.executor.attention import Sequences, attend_rows, attend_rows_batched

    generator = torch.Generator().manual_seed(batch)
    tokens, active_rows = args.tokens, min(args.active, args.tokens)
    order = torch.randperm(batch * tokens + 1, generator=generator)[: batch * tokens].to(device)  # slot 0 unused
    slots = [order[i * tokens : (i + 1) * tokens] for i in range(batch)]
    pool = torch.randn(batch * tokens + 1, 2, args.kv_heads, args.head_dim, dtype=dtype, device=device)
    sequences = Sequences.of(prefix_lens=[0] * batch, extend_lens=[tokens] * batch, slots=slots,
                              device=torch.device(device))
    active = torch.cat([torch.arange((i + 1) * tokens - active_rows, (i + 1) * tokens, device=device)
                        for i in range(batch)])
    q = torch.randn(len(active), args.heads * args.head_dim, dtype=dtype, device=device)
    kwargs = dict(scaling=args.head_dim**-0.5, heads=args.heads, kv_heads=args.kv_heads)

    def loop() -> torch.Tensor:
        return attend_rows(q, pool[:, 0], pool[:, 1], sequences, active, **kwargs)

    def batched() -> torch.Tensor:
        return attend_rows_batched(q, pool[:, 0], pool[:, 1], sequences, active, **kwargs)

    per_sequence = attention.padded_elements(1, active_rows, tokens, heads=args.heads, kv_heads=args.kv_heads,
                                             head_dim=args.head_dim, v_head_dim=args.head_dim)
    per_group = max(1, attention.BATCHED_ELEMENTS // per_sequence)
    loop_ms, batched_ms = timed(loop, args.reps, device), timed(batched, args.reps, device)
    diff = (loop().float() - batched().float()).abs().max().item()
    result = dict(device=device, dtype=str(dtype).removeprefix("torch."), sequences=batch, tokens=tokens,
                  active=active_rows, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  groups=-(-batch // per_group), loop_ms=round(loop_ms, 3), batched_ms=round(batched_ms, 3),
                  loop_over_batched=round(loop_ms / batched_ms, 3), max_diff=diff,
                  loop_peak_mib=peak_mib(loop, device), batched_peak_mib=peak_mib(batched, device))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64], help="sequences per batch")
    parser.add_argument("--tokens", type=int, default=1024, help="each sequence's prompt length")
    parser.add_argument("--active", type=int, default=256, help="each sequence's asking rows (its last ones)")
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default: bfloat16 on CUDA, float32 elsewhere")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU intra-op threads (default: torch's); 1 gives steady numbers on a shared machine")
    parser.add_argument("--tiny", action="store_true", help="a small shape, for CPU (overrides the shape)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.tokens, args.active, args.heads, args.kv_heads, args.head_dim = 128, 32, 4, 2, 32
    device = args.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    results = []
    for batch in args.batches:
        r = measure(batch, args, device, dtype)
        results.append(r)
        print(json.dumps(r), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{device} {results[0]['dtype']} ({torch.get_num_threads()} CPU threads): {args.tokens}-token prompts, "
          f"{min(args.active, args.tokens)} active rows each, heads {args.heads}, kv heads {args.kv_heads}, "
          f"head_dim {args.head_dim}")
    print(f"{'sequences':>9} {'loop ms':>9} {'batched ms':>11} {'groups':>6} {'loop/batched':>12} {'max diff':>9}"
          + (f" {'loop MiB':>9} {'batched MiB':>11}" if device == "cuda" else ""))
    for r in results:
        print(f"{r['sequences']:>9} {r['loop_ms']:9.2f} {r['batched_ms']:11.2f} {r['groups']:>6} "
              f"{r['loop_over_batched']:12.2f} {r['max_diff']:9.1e}"
              + (f" {r['loop_peak_mib']:9.1f} {r['batched_peak_mib']:11.1f}" if device == "cuda" else ""))


if __name__ == "__main__":
    main()
