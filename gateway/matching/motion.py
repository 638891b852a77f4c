"""Motion at pixel level: how far one image's content moved against another's, in pixels, parts of a token included.

Token digests and descriptors (align.find_shift) find a shift of whole tokens: a page scrolled by 56 px, a crop on
the token grid. Content moved by part of a token (a page scrolled by 13 px, a camera that panned by 8) changes the
pixels inside every token, so no digest and no descriptor stays in place, and those pairs were never matched. This
finds such a motion from the pixels themselves, by phase correlation: the normalised cross-power spectrum of two
images related by a shift is a pure phase ramp whose inverse transform is a single peak at the shift.

    motion = find_motion(grey_of(a), grey_of(b))   # b shows a's content moved by (motion.dy, motion.dx) pixels
    parts = regional_motions(grey_of(a), grey_of(b), regions=(2, 2))   # the same, per quarter of the frame

Both images are taken as the model sees them (the resized image, on the token grid), in grey, reduced by
``reduce`` (box filter) for speed and windowed (Hann) so that the content entering and leaving at the borders does
not pull the peak to zero. The peak is refined to a fraction of a pixel by a parabola through its neighbours on
each axis. ``confidence`` is the peak's height over the correlation surface's spread (its z-score divided by the
square root of the pixels compared, so that it does not grow with the image): pure shifts score far above
unrelated images, which score near the noise floor. What threshold separates them is measured, not set here
(bench/matching.py's ``motion`` section, on the labelled set's scrolls, pans and unrelated pairs).

A video frame may hold more than one motion: the camera's, and a subject's across it. ``regional_motions`` finds
one per region of a grid over the frame (the same region of both images, so content entering a region from a
neighbour lowers that region's confidence), each with its own confidence; a region finds motions up to about a
quarter of its side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

_EPSILON = 1e-9


@dataclass(frozen=True)
class Motion:
    """b's content at (y, x) shows a's at (y - dy, x - dx); pixels of the images as given to find_motion."""

    dy: float
    dx: float
    confidence: float  # the peak's prominence (see the module docstring): higher is surer

    def in_tokens(self, token: int) -> tuple[tuple[int, int], tuple[float, float]]:
        """The motion as whole tokens of ``token`` pixels and what is left over, each remainder in
        (-token / 2, token / 2]: 41 px at 28 px a token is one token and 13 px; 15 px is one token and -13 px."""
        whole = (round(self.dy / token), round(self.dx / token))
        return whole, (self.dy - whole[0] * token, self.dx - whole[1] * token)


def grey_of(image: Image.Image, reduce: int = 1) -> np.ndarray:
    """The image in grey (ITU-R 601 luma, as PIL's "L"), float32, reduced by ``reduce`` on each side by averaging."""
    grey = image.convert("L")
    if reduce > 1:
        grey = grey.reduce(reduce)
    return np.asarray(grey, dtype=np.float32)


def find_motion(a: np.ndarray, b: np.ndarray, *, reduce: int = 1) -> Motion:
    """How far b's content moved against a's (both grey, the same pixels per token; the top-left corner they share
    is compared). ``reduce``: the images were reduced by this before (the motion is given in the unreduced pixels)."""
    height, width = min(a.shape[0], b.shape[0]), min(a.shape[1], b.shape[1])
    if height < 4 or width < 4:
        return Motion(0.0, 0.0, 0.0)
    window = np.outer(np.hanning(height), np.hanning(width)).astype(np.float32)
    a = (a[:height, :width] - a[:height, :width].mean()) * window
    b = (b[:height, :width] - b[:height, :width].mean()) * window
    cross = np.fft.rfft2(b) * np.conj(np.fft.rfft2(a))
    cross /= np.abs(cross) + _EPSILON
    surface = np.fft.irfft2(cross, s=(height, width))
    peak_y, peak_x = np.unravel_index(int(np.argmax(surface)), surface.shape)
    spread = float(surface.std())
    confidence = 0.0 if spread < _EPSILON else \
        float((surface[peak_y, peak_x] - surface.mean()) / spread) / math.sqrt(height * width)
    dy = _signed(peak_y + _refine(surface[(peak_y - 1) % height, peak_x], surface[peak_y, peak_x],
                                  surface[(peak_y + 1) % height, peak_x]), height)
    dx = _signed(peak_x + _refine(surface[peak_y, (peak_x - 1) % width], surface[peak_y, peak_x],
                                  surface[peak_y, (peak_x + 1) % width]), width)
    return Motion(dy * reduce, dx * reduce, confidence)


@dataclass(frozen=True)
class RegionMotion:
    """The motion of the content within one region of the images (``box``: top, left, bottom, right, in the
    pixels of the images as given to regional_motions)."""

    box: tuple[int, int, int, int]
    motion: Motion


def regional_motions(a: np.ndarray, b: np.ndarray, *, regions: tuple[int, int] = (2, 2),
                     reduce: int = 1) -> list[RegionMotion]:
    """find_motion within each region of a ``regions`` (rows, cols) grid over the area a and b share, row by row."""
    height, width = min(a.shape[0], b.shape[0]), min(a.shape[1], b.shape[1])
    rows, cols = regions
    if rows < 1 or cols < 1:
        raise ValueError(f"regions must be at least 1 x 1, got {regions}")
    out = []
    for row in range(rows):
        top, bottom = row * height // rows, (row + 1) * height // rows
        for col in range(cols):
            left, right = col * width // cols, (col + 1) * width // cols
            motion = find_motion(a[top:bottom, left:right], b[top:bottom, left:right], reduce=reduce)
            out.append(RegionMotion((top * reduce, left * reduce, bottom * reduce, right * reduce), motion))
    return out


def _refine(before: float, at: float, after: float) -> float:
    """The offset of a parabola's vertex through three samples, in [-0.5, 0.5]."""
    curvature = before - 2 * at + after
    if curvature >= 0:  # not a maximum: keep the sample
        return 0.0
    return float(np.clip(0.5 * (before - after) / curvature, -0.5, 0.5))


def _signed(position: float, size: int) -> float:
    """A position on the circular correlation surface as a displacement in (-size / 2, size / 2]."""
    return position - size if position > size / 2 else position
