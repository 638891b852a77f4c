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

from gateway.matching.features import Cells, TokenFeatures, cell_means, grey, normalise, resized

# Structure cells per side: 2 x 2 pixels each for a 28-pixel token. Measured on the labelled set (bench/matching.py):
# at 7 x 7, different pages of one site scored up to 0.88 against the 0.9 match threshold; at 14 x 14, up to 0.80.
THUMB = 14
CONTRAST_FLOOR = 0.025 * THUMB  # the structure norm of an RMS contrast of 0.025 (6 grey levels): not amplified below
TONE_CONSTANT = 0.25
STRUCTURE_WEIGHT = 0.8  # share of the squared norm for a token with full contrast; the tone has the rest


class PixelExtractor:
    name = f"pixel-v1-t{THUMB}"
    dim = THUMB * THUMB + 4

    def extract(self, image: Image.Image, grid: tuple[int, int], factor: int) -> TokenFeatures:
        rows, cols = grid
        n = rows * cols
        pixels = resized(image, grid, factor)  # (rows * f, cols * f, 3) uint8
        summed = Cells(pixels)  # the cells' sums, shared with the shades and chroma
        cells = summed.means(rows * THUMB, cols * THUMB)  # (rows * T, cols * T, 3) float32 in [0, 255]
        luma = grey(cells)  # (rows * T, cols * T) in [0, 1]
        thumb = luma.reshape(rows, THUMB, cols, THUMB).transpose(0, 2, 1, 3).reshape(n, THUMB * THUMB)  # (n, T*T)
        structure = thumb - thumb.mean(axis=1, keepdims=True)
        structure /= np.maximum(np.linalg.norm(structure, axis=1, keepdims=True), CONTRAST_FLOOR)
        colour = cell_means(cells, rows, cols).reshape(n, 3) / 255.0 - 0.5  # (n, 3) mean R, G, B
        tone = normalise(np.concatenate([colour, np.full((n, 1), TONE_CONSTANT, np.float32)], axis=1))  # (n, 4)
        vectors = np.concatenate([np.sqrt(STRUCTURE_WEIGHT) * structure, np.sqrt(1 - STRUCTURE_WEIGHT) * tone],
                                 axis=1)
        return TokenFeatures.of_pixels(image, grid, factor, pixels, vectors, luma, summed)
