"""Timing a callable on the CPU or a CUDA device, for the benches that measure kernels (torch only: it runs on GPU
machines without the project's other dependencies)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], reps: int, device: str) -> float:
    """Median milliseconds of fn over reps runs, after two warm-up runs (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(stop))
        else:
            began = time.perf_counter()
            fn()
            out.append((time.perf_counter() - began) * 1e3)
    return statistics.median(out)
