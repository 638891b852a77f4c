"""Content moved by part of a token: line a new image's tokens up with a cached image's again.

A page scrolled by 29 px, or a frame panned by 2, moves the content inside every token, so no digest stays in place
and the fine stage (align.py) finds nothing alike: the pair is a miss. Whether the cached K/V may be reused for such
content at all was measured by the oracle fine-tuned on moved panels (bench/moved_quality.py): it holds within 2
points of a full prefill where the content sits up to 2 px off the token grid (after a move of whole tokens or
none), each B token reusing the K/V of the cached token its pixels mostly came from; from 3 px on nothing says it
holds. So ``MatchSettings.max_subtoken_px`` (2) bounds what is planned.

For one candidate the fine stage found too unlike, ``MovedImage.find`` asks how far the content moved:

    1. phase correlation (motion.find_motion) between the two images' shades (each token's 7 x 7 grey levels, which
       the features keep for both: the cached image's pixels are not kept), which is within about a pixel;
    2. the exact pixel count, among the motion found rounded and its two neighbours on each axis: the one whose new
       image, moved back by it, has shades closest to the cached image's at the whole-token shift;
    3. the move as whole tokens (the plan's shift) and what is left over (``offset``, in pixels, each axis in
       (-token / 2, token / 2]); planned only when the offset is not zero and within ``max_subtoken_px``.

``MovedImage.realigned(offset)`` is then the new image's features computed on its pixels moved back by the offset
(edges repeated), which line up with the cached tokens at the shift; the matcher aligns those (matcher.compare). A
token of moved content is never the same as the cached one (the model sees other pixels), at best similar. The
plan runs the vision pass over the whole new image (gateway/matching/plans.py): the cached encoder output is of
the content where it was, and what was measured was B's own encoder output.

Cost, only for a candidate that fell short in place: the new image decoded again (once per request, from the bytes
the worker is sent), the shade search (nine candidate moves at most) and one more extraction.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

from gateway.config import MatchSettings
from gateway.matching.features import SHADE_SIDE, Extractor, TokenFeatures, cell_means, grey, resized
from gateway.matching.motion import find_motion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SubTokenMove:
    """How far the new image's content moved against the cached image's: ``shift`` whole tokens (dy, dx) and
    ``offset`` pixels more (dy, dx); ``confidence``: the motion's (motion.Motion)."""

    shift: tuple[int, int]
    offset: tuple[int, int]
    confidence: float


def shade_image(features: TokenFeatures) -> np.ndarray:
    """(rows * SHADE_SIDE, cols * SHADE_SIDE) float32: the image's grey levels as its features keep them."""
    rows, cols = features.grid
    side = SHADE_SIDE
    return features.shades.reshape(rows, cols, side, side).transpose(0, 2, 1, 3) \
        .reshape(rows * side, cols * side).astype(np.float32)


def moved_back(pixels: np.ndarray, offset: tuple[int, int]) -> np.ndarray:
    """``pixels`` (H, W, ...) with their content moved by -offset (so content that moved by offset is back where it
    was), the edges it uncovers repeated."""
    dy, dx = offset
    height, width = pixels.shape[:2]
    rows = np.clip(np.arange(height) + dy, 0, height - 1)
    cols = np.clip(np.arange(width) + dx, 0, width - 1)
    return pixels[rows][:, cols]


@dataclass(frozen=True)
class MovedImages:
    """What the planner needs to line new images up again: the extractor intake used, the pixels per token, and the
    bounds (MatchSettings.max_subtoken_px, min_motion_confidence)."""

    extractor: Extractor
    factor: int
    max_px: int
    min_confidence: float

    def of(self, payload: bytes, grid: tuple[int, int]) -> MovedImage | None:
        """The new image sent as ``payload``; None when no sub-token move is planned (max_px 0)."""
        if self.max_px <= 0:
            return None
        return MovedImage.of_payload(payload, self.extractor, grid=grid, factor=self.factor, max_px=self.max_px,
                                     min_confidence=self.min_confidence)


class MovedImage:
    """A new image, ready to be lined up with cached images its content moved against by part of a token."""

    def __init__(self, pixels_of: Callable[[], np.ndarray], extractor: Extractor, *, grid: tuple[int, int],
                 factor: int, max_px: int, min_confidence: float) -> None:
        self._pixels_of = pixels_of  # () -> (rows * factor, cols * factor, 3) uint8, what the model sees
        self._pixels: np.ndarray | None = None
        self._grey: np.ndarray | None = None
        self.extractor = extractor
        self.grid, self.factor = grid, factor
        self.max_px, self.min_confidence = max_px, min_confidence
        self._realigned: dict[tuple[int, int], TokenFeatures] = {}

    @classmethod
    def of_payload(cls, payload: bytes, extractor: Extractor, *, grid: tuple[int, int], factor: int, max_px: int,
                   min_confidence: float) -> MovedImage:
        """From the bytes the worker is sent (images.CanonicalImage.payload: they decode to the keyed pixels)."""
        def pixels_of() -> np.ndarray:
            with Image.open(io.BytesIO(payload)) as image:
                return resized(image, grid, factor)
        return cls(pixels_of, extractor, grid=grid, factor=factor, max_px=max_px, min_confidence=min_confidence)

    @classmethod
    def of_image(cls, image: Image.Image, extractor: Extractor, *, grid: tuple[int, int], factor: int,
                 settings: MatchSettings) -> MovedImage:
        """From an image at hand (benches, tests), within ``settings``' bounds."""
        return cls(lambda: resized(image, grid, factor), extractor, grid=grid, factor=factor,
                   max_px=settings.max_subtoken_px, min_confidence=settings.min_motion_confidence)

    @property
    def pixels(self) -> np.ndarray:
        if self._pixels is None:
            self._pixels = self._pixels_of()
        return self._pixels

    def find(self, features: TokenFeatures, alias_features: TokenFeatures) -> SubTokenMove | None:
        """How the new image (its ``features``) moved against the cached one, when by part of a token within
        ``max_px`` of the grid and surely enough (``min_confidence``); None otherwise."""
        if self.max_px <= 0 or features.grid != self.grid:
            return None
        cell = self.factor / SHADE_SIDE  # pixels per shade
        motion = find_motion(shade_image(alias_features), shade_image(features))
        if motion.confidence < self.min_confidence:
            return None
        if not self._decoded():
            return None
        best: tuple[float, int, int] | None = None
        alias = shade_image(alias_features)
        around_y, around_x = round(motion.dy * cell), round(motion.dx * cell)
        for total_y in (around_y - 1, around_y, around_y + 1):
            for total_x in (around_x - 1, around_x, around_x + 1):
                distance = self._shade_distance(alias, total_y, total_x)
                if distance is not None and (best is None or distance < best[0]):
                    best = (distance, total_y, total_x)
        if best is None:
            return None
        _, total_y, total_x = best
        shift = (round(total_y / self.factor), round(total_x / self.factor))
        offset = (total_y - shift[0] * self.factor, total_x - shift[1] * self.factor)
        if offset == (0, 0) or max(abs(offset[0]), abs(offset[1])) > self.max_px:
            return None
        return SubTokenMove(shift=shift, offset=offset, confidence=motion.confidence)

    def _decoded(self) -> bool:
        """Whether the new image's pixels are at hand: decoded once, from bytes intake decoded already; should that
        ever fail, the image is planned as it would be without a sub-token move."""
        try:
            self.pixels  # noqa: B018 (decoded here, once)
        except (OSError, ValueError) as exc:
            log.warning("could not decode an image again to line it up: %s", exc)
            return False
        return True

    def realigned(self, offset: tuple[int, int]) -> TokenFeatures:
        """The new image's features with its content moved back by ``offset`` pixels."""
        found = self._realigned.get(offset)
        if found is None:
            image = Image.fromarray(moved_back(self.pixels, offset))
            found = self._realigned[offset] = self.extractor.extract(image, self.grid, self.factor)
        return found

    def _shade_distance(self, alias: np.ndarray, total_y: int, total_x: int) -> float | None:
        """Mean absolute difference of grey levels (cells of the shades' size) between the new image moved back by
        (total_y, total_x) pixels and the cached one (``alias``: its shade_image) where both have content; None
        where they share none."""
        if self._grey is None:
            self._grey = grey(self.pixels.astype(np.float32)) * 255.0
        rows, cols = self.grid
        side = SHADE_SIDE
        back = moved_back(self._grey, (total_y % self.factor, total_x % self.factor))
        shades = cell_means(back[:, :, None], rows * side, cols * side)[:, :, 0]
        # New cell (y, x) now shows the alias' cell (y - whole_y, x - whole_x), whole tokens of shades.
        whole_y, whole_x = total_y // self.factor * side, total_x // self.factor * side
        height, width = min(shades.shape[0], alias.shape[0] + whole_y), min(shades.shape[1], alias.shape[1] + whole_x)
        top, left = max(0, whole_y), max(0, whole_x)
        if height - top <= 0 or width - left <= 0:
            return None
        new_part = shades[top:height, left:width]
        alias_part = alias[top - whole_y:height - whole_y, left - whole_x:width - whole_x]
        if new_part.shape != alias_part.shape or new_part.size == 0:
            return None
        return float(np.abs(new_part - alias_part).mean())
