"""Unrelated pairs across sources: photos of different subjects, a page, a panel or a video frame against a photo."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from PIL import Image

from offline.near_duplicates.pairs import DEFAULT_TOKENS, LARGE_TOKENS, TOKEN, Pair, fit, grid, shape_for
from offline.near_duplicates.panels import panel_shape, random_look, random_panel
from offline.near_duplicates.scans import TWINS, photos, scan_for, scan_rows, skimage_image
from offline.near_duplicates.video import decode, frame_count


def unrelated(rng: random.Random, count: int, large: bool, clips: Sequence[Path]) -> list[Pair]:
    """Two different things: photos of different subjects, a scanned page against a photo, a panel against a photo
    or a page, a video frame against a photo. Half the pairs have B at A's size (harder for size-based shortcuts)."""
    tokens = LARGE_TOKENS if large else DEFAULT_TOKENS
    kinds = [f"photo:{name}" for name in photos()] + ["scan", "panel"] + [f"clip:{clip.name}" for clip in clips]
    frames: dict[str, Image.Image] = {}
    for clip in clips:
        decoded = decode(clip, [rng.randrange(frame_count(clip))])
        frames[clip.name] = next(iter(decoded.values()))

    def make(kind: str, shape: tuple[int, int] | None) -> Image.Image:
        if kind == "scan":
            scan = scan_for(large).image
            if shape is None:
                cols = scan.width // TOKEN
                shape = (scan_rows(rng, cols, tokens), cols)
            return fit(scan, *shape, rng)
        if kind == "panel":
            return random_panel(rng, random_look(rng), *(shape or panel_shape(rng, tokens))).render()
        source = skimage_image(kind[6:]) if kind.startswith("photo:") else frames[kind[5:]]
        return fit(source, *(shape or shape_for(rng, source.width / source.height, tokens)), rng)

    pairs: list[Pair] = []
    for index in range(count):
        while True:
            first, second = rng.sample(kinds, 2)
            names = frozenset({first.split(":")[-1], second.split(":")[-1]})
            if names not in TWINS:
                break
        a = make(first, None)
        same_size = index % 2 == 0
        b = make(second, grid(a) if same_size else None)
        label = f"{first.split(':')[-1]}-vs-{second.split(':')[-1]}{'-same-size' if same_size else ''}"
        pairs.append(Pair(f"unrelated/mixed/{label}-{index}", "unrelated", a, b, False, None, None))
    return pairs
