"""Offline tools: never imported by the gateway or the engine extension.

- :mod:`offline.reference`: every reuse path in plain PyTorch over transformers' Qwen-VL models; the ground
  truth the workers' execution is checked against.
- :mod:`offline.profiler`: ``python -m offline.profiler``, per-layer recompute ratios (VLCache's greedy allocation)
  written as a recompute profile (:mod:`plan.profile`).
- :mod:`offline.reader_eval`: ``python -m offline.reader_eval``, a reader's accuracy under each reference plan,
  through the reference or through a running gateway; and (``probe``) :mod:`offline.layer_probe`, from which layers
  it reads a field.
"""
