"""Content moved by part of a token: line a new image's tokens up with a cached image's again.

A page scrolled by 29 px, or a frame panned by 2, moves the content inside every token, so no digest stays in place
and the fine stage (align.py) finds nothing alike: the pair is a miss. Whether the cached K/V may be reused for such
content at all is measured by the oracle fine-tuned on moved panels (bench/moved_quality.py), each B token reusing
the K/V of the cached token its pixels mostly came from: within 2 points of a full prefill for content scrolled by
any part of a token (after a move of whole tokens or none), and for content panned up to 5 px off the grid, not by
half a token (README, Approximate matching), where which cached token a token's content came from is a tie (the
gateway's own plans of a scroll by 42 px answered 24% of changed fields right). So
``MatchSettings.max_subtoken_px_y`` (13: every remainder but half a token) and ``max_subtoken_px_x`` (5) bound what
is planned, per axis (``MatchSettings.plans_offset``).

When no candidate matches in place within the guard, the matcher (matcher.Matcher.lookup) asks of each, in the
coarse stage's order up to the first that matches so, how far the content moved (``MovedImage.find``):

    1. phase correlation (motion.find_motion) between the two images' shades (each token's 7 x 7 grey levels, which
       the features keep for both: the cached image's pixels are not kept), which is within about a pixel;
    2. the exact pixel count, among the motion found rounded and its two neighbours on each axis: the one whose new
       image, moved back by it, has shades closest to the cached image's at the whole-token shift;
    3. the move as whole tokens (the plan's shift) and what is left over (``offset``, in pixels, each axis in
       [-token / 2, token / 2], half a token going either way by Python's round, to even); planned only when the
       offset is not zero and within each axis' bound;
    4. not even then when the move leaves more of the tokens changed than the guard plans (``max_changed_share``:
       no cached token under the move, or a shade moved by more than ``max_shade_change``), counted from the
       shades before any extraction: look-alike pages of one layout line up as well as the page itself does.

``MovedImage.realigned(offset)`` is then the new image's features computed on its pixels moved back by the offset
(edges repeated), which line up with the cached tokens at the shift; the matcher aligns those (matcher.compare). A
token of moved content is never the same as the cached one (the model sees other pixels), at best similar. The
plan runs the vision pass over the whole new image (gateway/matching/plans.py): the cached encoder output is of
the content where it was, and what was measured was B's own encoder output.

A video frame may hold more than one motion (a camera moving with parallax, a subject across the frame): when the
whole frame's motion does not line it up within the guard, ``MovedImage.find_regions`` finds one per region of a
REGIONS x REGIONS grid of tokens over the frame (phase correlation on the region's shades, the exact pixel count as
above), each region moved back by its own offset where that is sure enough and within the bounds, the rest left
in place; the plan keeps every token where it is (no whole-token shift), so a token reuses the cached token at its
own position whose content is that region's offset away, as with one motion. A region whose content surely moved
further than the bounds plan (a subject crossing the frame, a near object's parallax: over 5 px sideways) is
out of reach: left in place, its tokens that changed are recomputed and, their content being elsewhere rather than
different, not scored in the similarity (align.align's ``out_of_reach``), as tokens with no cached token are not;
the guard still counts them. Without that, a frame whose background stood still while a quarter of it panned 9 px
scored under the match threshold over the tokens of that quarter alone. Measured on the next frames of a
moving camera (bench/matching.py --sections video); each region's offset is within the bounds the oracle measured
for one motion, but regions moved apart were not judged on their own. ``MovedImage.realigned_regions`` is the new
image's features with each region's pixels moved back by its offset.

Cost, only for a candidate that fell short in place: the new image decoded again (once per request, from the bytes
the worker is sent), the shade search (nine candidate moves at most: sums over shifted windows of the image, one
pass over it per vertical offset) and one more extraction; where one motion falls short, REGIONS x REGIONS phase
correlations on the regions' shades, nine candidate offsets each, and one more extraction.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

from gateway.config import MatchSettings
from gateway.matching.features import SHADE_SIDE, Extractor, TokenFeatures, grey, resized, shade_change
from gateway.matching.motion import find_motion

log = logging.getLogger(__name__)

# The side of the grid of regions (token-aligned) a frame's motions are found in when one motion does not line it up.
# Measured on opencv-doc's Megamind.avi, next frames with the camera moving, with every region's motion allowed up
# to 14 px either way: 2 x 2 lined up 45 of 57 within the guard, 3 x 3 54, 4 x 4 56 (one motion: 41); 6 x 6 gained
# one pair more than 4 x 4 within the bounds planned (bench/matching.py --sections video).
REGIONS = 4


@dataclass(frozen=True)
class SubTokenMove:
    """How far the new image's content moved against the cached image's: ``shift`` whole tokens (dy, dx) and
    ``offset`` pixels more (dy, dx); ``confidence``: the motion's (motion.Motion)."""

    shift: tuple[int, int]
    offset: tuple[int, int]
    confidence: float


@dataclass(frozen=True)
class RegionalMove:
    """Content moved by part of a token region by region: ``offsets[i]`` (dy, dx) pixels in region ``boxes[i]``
    (token rows top, bottom and columns left, right; bottom and right excluded), (0, 0) where it stays in place."""

    boxes: tuple[tuple[int, int, int, int], ...]
    offsets: tuple[tuple[int, int], ...]
    # Per region: its content surely moved, by more than the bounds plan (a pan of over 5 px); left in place, and its
    # tokens that changed so are recomputed, not counted against the similarity (align.align's out_of_reach).
    out_of_reach: tuple[bool, ...]

    @property
    def offset(self) -> tuple[int, int]:
        """The regions' largest offset (by its larger axis): what the alignment says the content moved by."""
        return max(self.offsets, key=lambda o: max(abs(o[0]), abs(o[1])))

    @property
    def moves(self) -> bool:
        """Whether some region's content is moved back (its offset not (0, 0))."""
        return any(offset != (0, 0) for offset in self.offsets)

    def out_of_reach_tokens(self, grid: tuple[int, int]) -> np.ndarray:
        """(rows * cols,) bool: the tokens of the regions out of reach."""
        mask = np.zeros(grid, dtype=bool)
        for (top, bottom, left, right), gone in zip(self.boxes, self.out_of_reach, strict=True):
            mask[top:bottom, left:right] = gone
        return mask.reshape(-1)


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
    match settings (their bounds: max_subtoken_px_y and _x, min_motion_confidence, and the guard's)."""

    extractor: Extractor
    factor: int
    settings: MatchSettings

    def of(self, payload: Callable[[], bytes], grid: tuple[int, int]) -> MovedImage | None:
        """The new image sent as the bytes ``payload()`` gives (called only if its pixels are needed); None when no
        sub-token move is planned (both bounds 0)."""
        if not self.settings.plans_moves():
            return None
        return MovedImage.of_payload(payload, self.extractor, grid=grid, factor=self.factor, settings=self.settings)


class MovedImage:
    """A new image, ready to be lined up with cached images its content moved against by part of a token."""

    def __init__(self, pixels_of: Callable[[], np.ndarray], extractor: Extractor, *, grid: tuple[int, int],
                 factor: int, settings: MatchSettings) -> None:
        self._pixels_of = pixels_of  # () -> (rows * factor, cols * factor, 3) uint8, what the model sees
        self._pixels: np.ndarray | None = None
        # The grey levels with the edges repeated by a token all round, and where the shades' cells start (rows,
        # columns) and their areas: what _shades_moved_back sums windows of, made once.
        self._padded: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._bands: dict[int, np.ndarray] = {}  # vertical offset -> sums over each row of shade cells
        self.extractor = extractor
        self.grid, self.factor = grid, factor
        self.settings = settings
        self._realigned: dict[object, TokenFeatures] = {}  # an offset, or a RegionalMove's offsets -> features

    @classmethod
    def of_payload(cls, payload: Callable[[], bytes], extractor: Extractor, *, grid: tuple[int, int], factor: int,
                   settings: MatchSettings) -> MovedImage:
        """From the bytes the worker is sent (images.CanonicalImage.payload: they decode to the keyed pixels), got
        when the pixels are first needed."""
        def pixels_of() -> np.ndarray:
            with Image.open(io.BytesIO(payload())) as image:
                return resized(image, grid, factor)
        return cls(pixels_of, extractor, grid=grid, factor=factor, settings=settings)

    @classmethod
    def of_image(cls, image: Image.Image, extractor: Extractor, *, grid: tuple[int, int], factor: int,
                 settings: MatchSettings) -> MovedImage:
        """From an image at hand (benches, tests), within ``settings``' bounds."""
        return cls(lambda: resized(image, grid, factor), extractor, grid=grid, factor=factor, settings=settings)

    @property
    def pixels(self) -> np.ndarray:
        if self._pixels is None:
            self._pixels = self._pixels_of()
        return self._pixels

    def find(self, features: TokenFeatures, alias_features: TokenFeatures) -> SubTokenMove | None:
        """How the new image (its ``features``) moved against the cached one, when by part of a token within each
        axis' bound off the grid, surely enough (``min_motion_confidence``) and with few enough tokens changed under
        the move for the guard to plan it; None otherwise."""
        settings = self.settings
        if not settings.plans_moves() or features.grid != self.grid:
            return None
        cell = self.factor / SHADE_SIDE  # pixels per shade
        alias = shade_image(alias_features)
        motion = find_motion(alias, shade_image(features))
        if motion.confidence < settings.min_motion_confidence:
            return None
        if not self._decoded():
            return None
        best: tuple[float, tuple[int, int], tuple[int, int], tuple[np.ndarray, np.ndarray]] | None = None
        around_y, around_x = round(motion.dy * cell), round(motion.dx * cell)
        for total_y in (around_y - 1, around_y, around_y + 1):
            for total_x in (around_x - 1, around_x, around_x + 1):
                shift = (round(total_y / self.factor), round(total_x / self.factor))
                offset = (total_y - shift[0] * self.factor, total_x - shift[1] * self.factor)
                compared = self._moved_shades(alias, shift, offset)
                if compared is None:
                    continue
                distance = float(np.abs(compared[0] - compared[1]).mean())
                if best is None or distance < best[0]:
                    best = (distance, shift, offset, compared)
        if best is None:
            return None
        _, shift, offset, compared = best
        if not settings.plans_offset(offset):
            return None
        if self._changed_share(*compared) > settings.max_changed_share:
            return None  # the guard would plan a miss: not worth an extraction (look-alike pages of one layout)
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

    def find_regions(self, features: TokenFeatures, alias_features: TokenFeatures) -> RegionalMove | None:
        """How the new image moved against the cached one region by region (REGIONS x REGIONS, token-aligned), each
        region by part of a token within the bounds and surely enough, surely by more (out of reach: left in place),
        or not at all; None when no region moved either way, the grid is smaller than the regions, or the moves
        leave more tokens changed than the guard plans.

        The regions' motions come from the shades alone; the new image is decoded again only when some region
        moved within reach and the regions left in place do not already change more tokens than the guard plans
        (an unrelated image stops there)."""
        settings = self.settings
        rows, cols = self.grid
        if not settings.plans_moves() or features.grid != self.grid or alias_features.grid != self.grid or \
                min(rows, cols) < REGIONS:
            return None
        alias, new = shade_image(alias_features), shade_image(features)
        side, cell = SHADE_SIDE, self.factor / SHADE_SIDE
        # Each region's box and its motion in whole pixels (None: the region stays in place), and whether it surely
        # moved by more than the bounds plan.
        regions: list[tuple[tuple[int, int, int, int], tuple[int, int] | None]] = []
        beyond: list[bool] = []
        for region_row in range(REGIONS):
            top, bottom = region_row * rows // REGIONS, (region_row + 1) * rows // REGIONS
            for region_col in range(REGIONS):
                left, right = region_col * cols // REGIONS, (region_col + 1) * cols // REGIONS
                motion = find_motion(alias[top * side:bottom * side, left * side:right * side],
                                     new[top * side:bottom * side, left * side:right * side])
                around = (round(motion.dy * cell), round(motion.dx * cell))
                within = abs(around[0]) <= settings.max_subtoken_px_y + 1 and \
                    abs(around[1]) <= settings.max_subtoken_px_x + 1 and around != (0, 0)
                sure = motion.confidence >= settings.min_motion_confidence
                regions.append(((top, bottom, left, right), around if within and sure else None))
                beyond.append(sure and not within and around != (0, 0))
        if all(found is None for _, found in regions) and not any(beyond):
            return None
        staying = np.zeros((rows, cols), dtype=bool)
        for (top, bottom, left, right), found in regions:
            staying[top:bottom, left:right] = found is None
        if self._changed_share(new, alias, among=staying.reshape(-1)) > settings.max_changed_share:
            return None
        if any(found is not None for _, found in regions) and not self._decoded():
            return None
        moved = new.copy()
        offsets = []
        for index, ((top, bottom, left, right), found) in enumerate(regions):
            offset = (0, 0)
            cells = (slice(top * side, bottom * side), slice(left * side, right * side))
            if found is not None:
                offset = min(((found[0] + y, found[1] + x) for y in (-1, 0, 1) for x in (-1, 0, 1)),
                             key=lambda o: float(np.abs(self._shades_moved_back(o)[cells] - alias[cells]).mean()))
                if offset != (0, 0) and not settings.plans_offset(offset):
                    offset, beyond[index] = (0, 0), True
                moved[cells] = self._shades_moved_back(offset)[cells]
            offsets.append(offset)
        move = RegionalMove(boxes=tuple(box for box, _ in regions), offsets=tuple(offsets), out_of_reach=tuple(beyond))
        if not move.moves and not any(beyond) or self._changed_share(moved, alias) > settings.max_changed_share:
            return None
        return move

    def realigned_regions(self, move: RegionalMove) -> TokenFeatures:
        """The new image's features with each region's content moved back by its own offset."""
        found = self._realigned.get(move.offsets)
        if found is None:
            pixels = self.pixels.copy()
            factor = self.factor
            moved: dict[tuple[int, int], np.ndarray] = {}  # regions that moved alike share one moved copy
            for (top, bottom, left, right), offset in zip(move.boxes, move.offsets, strict=True):
                if offset != (0, 0):
                    box = (slice(top * factor, bottom * factor), slice(left * factor, right * factor))
                    if offset not in moved:
                        moved[offset] = moved_back(self.pixels, offset)
                    pixels[box] = moved[offset][box]
            found = self._realigned[move.offsets] = self.extractor.extract(Image.fromarray(pixels), self.grid, factor)
        return found

    def _moved_shades(self, alias: np.ndarray, shift: tuple[int, int], offset: tuple[int, int]) -> \
            tuple[np.ndarray, np.ndarray] | None:
        """The grey levels (cells of the shades' size) of the new image moved back by ``offset`` pixels, and of the
        cached one (``alias``: its shade_image), lined up at ``shift`` whole tokens and cut to the tokens both have;
        None where they share none."""
        shades = self._shades_moved_back(offset)
        side = SHADE_SIDE
        # New cell (y, x) now shows the alias' cell (y - whole_y, x - whole_x), whole tokens of shades.
        whole_y, whole_x = shift[0] * side, shift[1] * side
        height, width = min(shades.shape[0], alias.shape[0] + whole_y), min(shades.shape[1], alias.shape[1] + whole_x)
        top, left = max(0, whole_y), max(0, whole_x)
        if height - top <= 0 or width - left <= 0:
            return None
        return shades[top:height, left:width], alias[top - whole_y:height - whole_y, left - whole_x:width - whole_x]

    def _shades_moved_back(self, offset: tuple[int, int]) -> np.ndarray:
        """(rows * SHADE_SIDE, cols * SHADE_SIDE) float32: the grey levels over the cells of the shades (as
        features.cell_means cuts them) of the new image moved back by ``offset`` pixels (|offset| within a token),
        the edges repeated. Sums over shifted windows of the padded image, rows of cells first (one pass over the
        image per vertical offset, kept for the other horizontal ones), instead of a moved copy per offset."""
        factor = self.factor
        height, width = self.pixels.shape[:2]
        if self._padded is None:
            rows, cols = self.grid
            top = np.round(np.linspace(0, height, rows * SHADE_SIDE + 1)).astype(np.int64)
            left = np.round(np.linspace(0, width, cols * SHADE_SIDE + 1)).astype(np.int64)
            self._padded = (np.pad(grey(self.pixels.astype(np.float32)) * 255.0, factor, mode="edge"), top[:-1],
                            left[:-1], np.outer(np.diff(top), np.diff(left)).astype(np.float32))
        padded, tops, lefts, areas = self._padded
        dy, dx = offset
        band = self._bands.get(dy)
        if band is None:
            band = self._bands[dy] = np.add.reduceat(padded[factor + dy:factor + dy + height], tops, axis=0)
        return np.add.reduceat(band[:, factor + dx:factor + dx + width], lefts, axis=1) / areas

    def _changed_share(self, new: np.ndarray, alias: np.ndarray, among: np.ndarray | None = None) -> float:
        """The share of the new image's tokens a move leaves changed, as the fine stage would count them from the
        shades (``new`` and ``alias`` as _moved_shades gives them): those with no cached token under the move, and
        those one of whose shades moved by more than max_shade_change (features.shade_change); ``among``: count
        only these tokens (a mask over the whole grid, ``new`` and ``alias`` being whole), the rest as unchanged."""
        side = SHADE_SIDE

        def tokens(cells: np.ndarray) -> np.ndarray:  # (h * side, w * side) -> (h * w, side * side)
            h, w = cells.shape[0] // side, cells.shape[1] // side
            return cells.reshape(h, side, w, side).transpose(0, 2, 1, 3).reshape(h * w, side * side)

        new_tokens = tokens(new)
        differs = shade_change(new_tokens, tokens(alias)) > self.settings.max_shade_change
        changed = int((differs & among).sum() if among is not None else differs.sum())
        n = self.grid[0] * self.grid[1]
        return (changed + n - len(new_tokens)) / n
