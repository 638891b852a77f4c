"""The default extractor: weight-free token descriptors from the pixels themselves.

Each token's vector has two parts, weighted and then L2-normalised together:

    structure  the token's grey levels pooled to THUMB x THUMB cells, minus their mean: where the ink is. Divided by
               max(its norm, CONTRAST_FLOOR), so that a token with real contrast (text, edges) has a unit structure
               part, while the few grey levels of noise on a flat region (JPEG ringing) stay small instead of being
               blown up to a unit vector that points anywhere
    tone       the token's mean R, G, B minus mid-grey, and a constant: what colour and brightness it has. The
               constant keeps a mid-grey token from being a zero vector, and tells white from light grey apart less
               than white from black

Two tokens showing the same thing (a re-encode, a slight brightness change) have cosine near 1; the same kind of
content at the same place (two different words in one font) shares the tone and little of the structure, so it
scores well below the similarity threshold. Cost: one resize and a few array passes per image (bench/matching.py
prints it per image size).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from gateway.matching.features import (
    TokenFeatures,
    grey,
    normalise,
    resized,
    token_blocks,
    token_digests,
    token_entropy,
)

THUMB = 7  # structure cells per side: 4 x 4 pixels each for a 28-pixel token
CONTRAST_FLOOR = 0.35  # structure norm (grey levels in [0, 1], over THUMB^2 cells) below which it is not amplified
TONE_CONSTANT = 0.25
STRUCTURE_WEIGHT = 0.8  # share of the squared norm for a token with full contrast; the tone has the rest


class PixelExtractor:
    name = f"pixel-v1-t{THUMB}"
    dim = THUMB * THUMB + 4

    def extract(self, image: Image.Image, grid: tuple[int, int], factor: int) -> TokenFeatures:
        rows, cols = grid
        pixels = resized(image, grid, factor)  # (rows * f, cols * f, 3)
        blocks = token_blocks(pixels, factor)  # (rows, cols, f, f, 3)
        luma = grey(blocks)  # (rows, cols, f, f)
        edges = np.round(np.linspace(0, factor, THUMB + 1)).astype(np.int64)[:-1]
        pooled = np.add.reduceat(np.add.reduceat(luma, edges, axis=2), edges, axis=3)  # (rows, cols, T, T) sums
        sizes = np.diff(np.append(edges, factor))
        thumb = pooled / np.outer(sizes, sizes)  # cell means
        structure = (thumb - thumb.mean(axis=(2, 3), keepdims=True)).reshape(rows * cols, -1)  # (n, T*T)
        norms = np.linalg.norm(structure, axis=1, keepdims=True)
        structure = structure / np.maximum(norms, CONTRAST_FLOOR)
        colour = blocks.reshape(rows * cols, -1, 3).mean(axis=1) / 255.0 - 0.5  # (n, 3)
        tone = normalise(np.concatenate([colour, np.full((rows * cols, 1), TONE_CONSTANT)], axis=1))  # (n, 4)
        vectors = np.concatenate([np.sqrt(STRUCTURE_WEIGHT) * structure, np.sqrt(1 - STRUCTURE_WEIGHT) * tone],
                                 axis=1)
        return TokenFeatures(grid=grid, digests=token_digests(image, grid, factor),
                             vectors=normalise(vectors).astype(np.float16),
                             entropy=token_entropy(luma).reshape(-1).astype(np.float16))
