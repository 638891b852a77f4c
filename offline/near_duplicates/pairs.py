"""The labelled pair, the families, and the token grid: fitting images to it and the rules that mark changed tokens."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from bundled.reader.panels import CELL

TOKEN = CELL  # pixels per token side
FAMILIES = ("doc_edit", "doc_scroll_whole", "doc_scroll_partial", "form_fill", "video_next", "video_distant",
            "photo_jpeg", "photo_crop", "photo_bright", "unrelated", "unrelated_same_site")
LOSSLESS_FAMILIES = ("doc_edit", "doc_scroll_whole", "form_fill", "photo_crop")
# Families whose B shows A's content moved by whole tokens (``shift``) or left in place
WHOLE_TOKEN_FAMILIES = ("doc_edit", "doc_scroll_whole", "form_fill", "photo_jpeg", "photo_crop", "photo_bright")
EXACT_THRESHOLD = 24  # lossless rule: a pixel differs if a channel moves by more than this
VIDEO_THRESHOLD = 12.0  # video rule: a token differs if its mean absolute difference is more than this
MAX_TOKENS = 4500
DEFAULT_TOKENS = (300, 1300)
LARGE_TOKENS = (3900, 4400)
EDIT_WORDS = ("value", "object", "string", "number", "record", "window", "button", "column", "server", "client",
              "option", "before", "after", "always", "never", "single", "double", "result", "format", "method")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Pair:
    """One labelled pair; see the package docstring (offline.near_duplicates) for what each label means."""

    name: str
    family: str
    a: Image.Image
    b: Image.Image
    near_duplicate: bool | None
    changed: np.ndarray | None
    shift: tuple[int, int] | None
    # Pixels b's content moved against a's (dy, dx), where the pair was made by moving it: a scroll or a pan by
    # any number of pixels; None where not known (see true_motion).
    motion: tuple[int, int] | None = None

    def true_motion(self) -> tuple[int, int] | None:
        """Pixels b's content moved against a's: ``motion``, else, in the families whose content moves by whole
        tokens or not at all (WHOLE_TOKEN_FAMILIES), ``shift`` in pixels; None where the pair does not say (a real
        clip's next frame, unrelated pairs)."""
        if self.motion is not None:
            return self.motion
        if self.family in WHOLE_TOKEN_FAMILIES and self.shift is not None:
            return self.shift[0] * TOKEN, self.shift[1] * TOKEN
        return None


@dataclass(frozen=True)
class Counts:
    """How many pairs each source contributes to a family: per source of the doc families, per single-source
    family, and the unrelated families' (which need more, to measure false matches)."""

    per_source: int
    single: int
    unrelated: int
    same_site: int


DEFAULT_COUNTS = Counts(per_source=8, single=16, unrelated=40, same_site=10)
LARGE_COUNTS = Counts(per_source=2, single=4, unrelated=8, same_site=3)


def grid(image: Image.Image) -> tuple[int, int]:
    """(rows, cols) of an image's token grid."""
    return image.height // TOKEN, image.width // TOKEN


def shape_for(rng: random.Random, aspect: float, tokens: tuple[int, int]) -> tuple[int, int]:
    """A (rows, cols) grid of about ``aspect`` (width / height) with a token count within ``tokens``."""
    target = rng.randint(*tokens)
    cols = max(2, round(math.sqrt(target * aspect)))
    rows = max(2, round(target / cols))
    while rows * cols > tokens[1]:
        rows -= 1
    while rows * cols < tokens[0]:
        rows += 1
    return rows, cols


def fit(image: Image.Image, rows: int, cols: int, rng: random.Random) -> Image.Image:
    """A rows x cols token crop of the image at a random offset, scaled up first where it is too small (a real photo
    is rarely the exact size: cropping keeps the token grid aligned to the pixels)."""
    width, height = cols * TOKEN, rows * TOKEN
    scale = max(width / image.width, height / image.height)
    if scale > 1:
        size = (max(width, math.ceil(image.width * scale)), max(height, math.ceil(image.height * scale)))
        image = image.resize(size, Image.Resampling.LANCZOS)
    x = rng.randint(0, image.width - width)
    y = rng.randint(0, image.height - height)
    return image.crop((x, y, x + width, y + height))


def _token_diffs(a: Image.Image, b: Image.Image, shift: tuple[int, int],
                 reduce: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per B token: the reduced absolute difference from the aligned A token, and whether that A token exists."""
    pa = np.asarray(a, dtype=np.int16)
    pb = np.asarray(b, dtype=np.int16)
    rows_a, cols_a = grid(a)
    rows_b, cols_b = grid(b)
    dy, dx = shift
    values = np.zeros((rows_b, cols_b), dtype=np.float64)
    inside = np.zeros((rows_b, cols_b), dtype=bool)
    r0, r1 = max(0, dy), min(rows_b, rows_a + dy)
    c0, c1 = max(0, dx), min(cols_b, cols_a + dx)
    if r0 < r1 and c0 < c1:
        sub_b = pb[r0 * TOKEN:r1 * TOKEN, c0 * TOKEN:c1 * TOKEN]
        sub_a = pa[(r0 - dy) * TOKEN:(r1 - dy) * TOKEN, (c0 - dx) * TOKEN:(c1 - dx) * TOKEN]
        diff = np.abs(sub_b - sub_a).reshape(r1 - r0, TOKEN, c1 - c0, TOKEN, 3)
        values[r0:r1, c0:c1] = reduce(diff)
        inside[r0:r1, c0:c1] = True
    return values, inside


def changed_exact(a: Image.Image, b: Image.Image, shift: tuple[int, int] = (0, 0)) -> np.ndarray:
    """The lossless rule: B's token is changed if any pixel of it differs from the aligned A token by more than
    EXACT_THRESHOLD in any channel, or if the aligned A token lies outside A."""
    values, inside = _token_diffs(a, b, shift, lambda d: d.max(axis=(1, 3, 4)))
    return ~inside | (values > EXACT_THRESHOLD)


def changed_video(a: Image.Image, b: Image.Image, shift: tuple[int, int] = (0, 0)) -> np.ndarray:
    """The video rule: frames are lossy and noisy (codec blocks, sensor noise, flicker), so a token is changed only
    if its mean absolute difference (over pixels and channels) exceeds VIDEO_THRESHOLD."""
    values, inside = _token_diffs(a, b, shift, lambda d: d.mean(axis=(1, 3, 4)))
    return ~inside | (values > VIDEO_THRESHOLD)


def unchanged(b: Image.Image) -> np.ndarray:
    return np.zeros(grid(b), dtype=bool)


def interleave(groups: Sequence[Sequence[Pair]], limit: int | None) -> list[Pair]:
    """Round-robin over the sources' lists, so a cap keeps every source."""
    out: list[Pair] = []
    for position in range(max((len(group) for group in groups), default=0)):
        out.extend(group[position] for group in groups if position < len(group))
    return out if limit is None else out[:limit]
