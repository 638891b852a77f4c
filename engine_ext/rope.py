"""Rotary position arithmetic shared by the reference and the workers: moving cached keys to new positions."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    """The rotary frequencies of RoPE with this base over rotary_dim dimensions: (rotary_dim / 2,)."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))


def reposition(k: torch.Tensor, delta: int, frequencies: torch.Tensor) -> torch.Tensor:
    """Keys after RoPE at positions p, moved to p + delta (the same delta on all three M-RoPE axes).

    Every rotary frequency j of M-RoPE turns by (its axis' position) * frequencies[j]. Moving an image as a whole
    shifts its temporal, height and width positions by the same delta, so each frequency turns by a further
    delta * frequencies[j] whichever axis it belongs to: a plain 1-D rotation of the cached keys, the same for
    Qwen2.5-VL's sectioned layout and Qwen3-VL's interleaved one (both rotate the two halves of the head, the
    "neox" style). k: (..., head_dim); computed in float64 and returned in k's dtype.
    """
    if delta == 0:
        return k
    angle = delta * frequencies.double()
    cos = torch.cat((angle.cos(), angle.cos()))
    sin = torch.cat((angle.sin(), angle.sin()))
    moved = k.double() * cos + rotate_half(k.double()) * sin
    return moved.to(k.dtype)
