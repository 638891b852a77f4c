"""Rotary position arithmetic shared by the reference and the workers: moving cached keys to new positions."""

from __future__ import annotations

from collections.abc import Callable

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


def frequency_axes(rotate: Callable[[torch.Tensor], torch.Tensor], pairs: int) -> torch.Tensor:
    """Which M-RoPE axis (0 temporal, 1 height, 2 width) turns each of the ``pairs`` rotary frequencies.

    ``rotate(positions)`` must give the sines the model applies at M-RoPE positions (3, rows): (rows, >= pairs).
    Probing with a unit step on one axis at a time reads the layout off the model itself (Qwen2.5-VL's sections,
    Qwen3-VL's interleaving) instead of re-deriving it: a frequency turns only under a step of its own axis.
    """
    sines = rotate(torch.eye(3, dtype=torch.long))[:, :pairs].abs()  # (3 steps, pairs)
    if bool((sines.max(0).values == 0).any()):
        raise ValueError("a rotary frequency turned under no axis: not an M-RoPE embedding")
    return sines.argmax(0)


def reposition_axes(k: torch.Tensor, deltas: torch.Tensor, frequencies: torch.Tensor,
                    axes: torch.Tensor) -> torch.Tensor:
    """Keys after RoPE moved by a position step of their own per axis: a token that moved inside its image (a
    scrolled page: its height position changed, its width position did not) turns by a different angle on each
    axis' frequencies.

    k: (..., rows, heads, head_dim); deltas: (3, rows) per-axis position steps; frequencies: (head_dim / 2,);
    axes: (head_dim / 2,) from frequency_axes. Computed in float64, returned in k's dtype. With the same delta on
    every axis this is :func:`reposition`.
    """
    angle = deltas.double().T[:, axes.to(deltas.device)] * frequencies.double().to(deltas.device)  # (rows, pairs)
    cos = torch.cat((angle.cos(), angle.cos()), -1)[:, None, :]  # (rows, 1, head_dim)
    sin = torch.cat((angle.sin(), angle.sin()), -1)[:, None, :]
    moved = k.double() * cos + rotate_half(k.double()) * sin
    return moved.to(k.dtype)
