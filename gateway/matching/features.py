"""Per-token image features: what approximate matching compares, one row per LLM token of the image's grid.

For each token of the grid the model will see (``grid.rows x grid.cols``, one token per ``factor x factor`` pixels
of the resized image), an extractor gives

    digest   an exact 64-bit digest of the pixels the token is made from, so "unchanged" is known exactly
    vector   an L2-normalised descriptor; cosine similarity between two images' vectors at a position says how
             alike the two tokens look
    entropy  the Shannon entropy (bits) of the token's grey-level histogram: low for blank margins and flat
             regions, whose KV is the least risky to reuse
    shades   the token's grey levels (0-255) over SHADE_SIDE x SHADE_SIDE cells (4 x 4 pixels of a 28-pixel token):
             coarse pixels, so that a match can tell an edited glyph (some cell moves by 40 grey levels or more)
             from re-encoding noise or a change of brightness, which a cosine cannot: a changed stroke in one
             corner of a token moves its descriptor less than noise spread over all of it (``shade_change``)
    chroma   the token's mean colour apart from its brightness, as two opponent components (R - G and
             (R + G) / 2 - B, in levels of 0-255): a swatch redrawn in another colour of the same grey level
             (orange and pink, purple and blue) leaves the shades as they were, and moves these
             (``chroma_change``)

Digests are of the source pixels a token is resized from (its rectangle of the canonical image plus the resize
kernel's reach), so equal digests mean the resize produced the same pixels; when the image needs no resize the
rectangle is the token's own 28 x 28 pixels. Vectors and entropy are computed on the resized image the model sees.

Extractors implement :class:`Extractor`; the default, :class:`gateway.matching.pixel.PixelExtractor`, needs no
weights. ``TokenFeatures.regional`` gives the coarse stage's 2 x 2 regional descriptors, from the shades and
chroma.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash
from PIL import Image

HISTOGRAM_BINS = 32  # grey levels per entropy histogram: log2(32) = 5 bits at most
# The coarse stage's per-token layout (token_layout): where the ink is, pooled to LAYOUT_CELLS x LAYOUT_CELLS cells of
# half a token, weighted LAYOUT_STRUCTURE against the token's tone. Measured on the labelled set's images moved by 1, 2
# and 29 px, looked up among all of them (what bench/matching.py's crowd section does, then with moves tried for
# every candidate short of a match): the own image matched for 87-89% of the moves at weights 0 to 1, 76-79% at 3,
# and 75-76% with the means of the extractor's vectors (14 x 14 cells a token) that this replaced. On the reader's
# panels (bench/moved_quality.py's), 1-2 px moves among 300: 136-142 of 150 at weight 1, 144-145 at 0 to 0.3 (the
# panels differ in colour). 1 is the largest weight that did as well: at it the structure is still small beside the
# tone (a text token's pooled cells move a tenth of its spread), but pages of one colour scheme keep some of it.
LAYOUT_CELLS = 2
LAYOUT_STRUCTURE = 1.0
LAYOUT_CONTRAST_FLOOR = 42.0  # a token's shades' spread (L2, grey levels) below which its structure is not amplified
LAYOUT_DIM = LAYOUT_CELLS * LAYOUT_CELLS + 4
_RECORD = struct.Struct("<4sHHHH")  # magic, version, rows, cols, dim
# Versions 1 (no shades) and 2 (no chroma) are read as damaged and dropped: their images cannot be aliases until seen
# again.
_MAGIC, _VERSION = b"RVTF", 3
SHADE_SIDE = 7
MIN_GAIN, MAX_GAIN = 0.8, 1.25  # the contrast changes shade_change forgives (a brightness change of +-20%)


@dataclass(frozen=True, eq=False)
class TokenFeatures:
    """One image's features, one row per token in row-major grid order."""

    grid: tuple[int, int]  # (rows, cols)
    digests: np.ndarray  # (n,) uint64
    vectors: np.ndarray  # (n, dim) float16, each row of unit L2 norm (or zero)
    entropy: np.ndarray  # (n,) float16, bits
    shades: np.ndarray  # (n, SHADE_SIDE * SHADE_SIDE) uint8 grey levels
    chroma: np.ndarray  # (n, 2) int16: mean R - G and (R + G) / 2 - B

    def __post_init__(self) -> None:
        n = self.grid[0] * self.grid[1]
        if self.digests.shape != (n,) or self.entropy.shape != (n,) or self.vectors.ndim != 2 \
                or self.vectors.shape[0] != n or self.shades.shape != (n, SHADE_SIDE * SHADE_SIDE) \
                or self.chroma.shape != (n, 2):
            raise ValueError(f"features do not fit grid {self.grid}: digests {self.digests.shape}, vectors "
                             f"{self.vectors.shape}, entropy {self.entropy.shape}, shades {self.shades.shape}, "
                             f"chroma {self.chroma.shape}")

    @classmethod
    def of_pixels(cls, image: Image.Image, grid: tuple[int, int], factor: int, pixels: np.ndarray,
                  vectors: np.ndarray, luma: np.ndarray | None = None, cells: Cells | None = None) -> TokenFeatures:
        """An extractor's result: its descriptor ``vectors`` (n, dim), normalised here, with the digests, entropy and
        shades every extractor takes from the pixels. ``pixels``: the image as :func:`resized` gives it; ``luma``:
        the grey levels to take the entropy of (default: every pixel's); ``cells``: the pixels' :class:`Cells`, if
        the extractor made them."""
        cells = cells or Cells(pixels)
        return cls(grid=grid, digests=token_digests(image, grid, factor, resized_pixels=pixels),
                   vectors=normalise(vectors).astype(np.float16),
                   entropy=token_entropy(grey(pixels) if luma is None else luma, grid).astype(np.float16),
                   shades=token_shades(pixels, grid, cells), chroma=token_chroma(pixels, grid, cells))

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    @property
    def nbytes(self) -> int:
        return self.digests.nbytes + self.vectors.nbytes + self.entropy.nbytes + self.shades.nbytes + \
            self.chroma.nbytes

    def regional(self) -> np.ndarray:
        """(4, LAYOUT_DIM) float32: the coarse stage's descriptors, the mean over each quadrant of the grid (top-left,
        top-right, bottom-left, bottom-right) of each token's layout (:func:`token_layout`), each L2-normalised. A
        one-token-wide grid splits its one side only. Taken from the shades and chroma, whatever the extractor."""
        rows, cols = self.grid
        grid = token_layout(self.shades, self.chroma).reshape(rows, cols, LAYOUT_DIM)
        # A side of one token is not split: both halves are that one row (or column).
        top, left = (slice(0, max(1, rows // 2)), slice(rows // 2, rows)), (slice(0, max(1, cols // 2)),
                                                                             slice(cols // 2, cols))
        means = np.stack([grid[r, c].reshape(-1, LAYOUT_DIM).mean(axis=0) for r in top for c in left])
        return normalise(means)

    def to_bytes(self) -> bytes:
        head = _RECORD.pack(_MAGIC, _VERSION, self.grid[0], self.grid[1], self.dim)
        return b"".join((head, self.digests.astype("<u8").tobytes(), self.vectors.astype("<f2").tobytes(),
                         self.entropy.astype("<f2").tobytes(), self.shades.astype(np.uint8).tobytes(),
                         self.chroma.astype("<i2").tobytes()))

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> TokenFeatures:
        """Raises ValueError for bytes that are not a features record of this version."""
        data = memoryview(data)
        if len(data) < _RECORD.size:
            raise ValueError("features record is truncated")
        magic, version, rows, cols, dim = _RECORD.unpack_from(data)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError(f"not a features record of version {_VERSION}")
        n = rows * cols
        shade_cells = SHADE_SIDE * SHADE_SIDE
        if len(data) != _RECORD.size + n * (8 + 2 * dim + 2 + shade_cells + 4):
            raise ValueError("features record has the wrong length")
        at = _RECORD.size
        digests = np.frombuffer(data, "<u8", n, at).astype(np.uint64)
        at += 8 * n
        vectors = np.frombuffer(data, "<f2", n * dim, at).reshape(n, dim).astype(np.float16)
        at += 2 * n * dim
        entropy = np.frombuffer(data, "<f2", n, at).astype(np.float16)
        at += 2 * n
        shades = np.frombuffer(data, np.uint8, n * shade_cells, at).reshape(n, shade_cells).copy()
        at += n * shade_cells
        chroma = np.frombuffer(data, "<i2", n * 2, at).reshape(n, 2).astype(np.int16)
        return cls(grid=(rows, cols), digests=digests, vectors=vectors, entropy=entropy, shades=shades,
                   chroma=chroma)


class Extractor(Protocol):
    """Computes :class:`TokenFeatures` for a canonical RGB image and its token grid. Thread-safe; CPU-bound (call
    it off the event loop)."""

    name: str  # names the extractor and its version: features of different names are never compared
    dim: int

    def extract(self, image: Image.Image, grid: tuple[int, int], factor: int) -> TokenFeatures: ...


def normalise(vectors: np.ndarray, floor: float = 1e-12) -> np.ndarray:
    """Rows scaled to unit L2 norm; all-zero rows stay zero."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.maximum(norms, floor)


def resized(image: Image.Image, grid: tuple[int, int], factor: int) -> np.ndarray:
    """(rows * factor, cols * factor, 3) uint8: the image at the size the model's processor resizes it to
    (bicubic, as Qwen-VL's processors resize)."""
    size = (grid[1] * factor, grid[0] * factor)
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    return np.asarray(rgb if rgb.size == size else rgb.resize(size, Image.Resampling.BICUBIC), dtype=np.uint8)


def token_blocks(pixels: np.ndarray, factor: int) -> np.ndarray:
    """(rows, cols, factor, factor, channels) view of a (rows * factor, cols * factor, channels) image."""
    height, width, channels = pixels.shape
    blocks = pixels.reshape(height // factor, factor, width // factor, factor, channels)
    return blocks.swapaxes(1, 2)


def token_digests(image: Image.Image, grid: tuple[int, int], factor: int, *,
                  resized_pixels: np.ndarray | None = None) -> np.ndarray:
    """(n,) uint64: per token, xxh3 of the canonical pixels it is resized from (see the module docstring).
    ``resized_pixels``: the image as :func:`resized` gives it, when the caller has it already."""
    rows, cols = grid
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    width, height = rgb.size
    if (height, width) == (rows * factor, cols * factor):
        pixels = resized_pixels if resized_pixels is not None else np.asarray(rgb, dtype=np.uint8)
        blocks = np.ascontiguousarray(token_blocks(pixels, factor)).reshape(rows * cols, -1)  # (n, f*f*3)
        return np.fromiter((xxhash.xxh3_64_intdigest(row.tobytes()) for row in blocks), np.uint64, rows * cols)
    scale_y, scale_x = height / (rows * factor), width / (cols * factor)
    # A bicubic (antialiased when shrinking) output pixel reads 2 * max(1, scale) source pixels on each side.
    margin_y, margin_x = math.ceil(2 * max(1.0, scale_y)) + 1, math.ceil(2 * max(1.0, scale_x)) + 1
    digests = np.empty(rows * cols, np.uint64)
    for r in range(rows):
        top = max(0, math.floor(r * factor * scale_y) - margin_y)
        bottom = min(height, math.ceil((r + 1) * factor * scale_y) + margin_y)
        # One band of rows at a time: a copy of the whole image (120 MB at 40 Mpx, and as much again for numpy's)
        # is what digesting cost before.
        band = np.asarray(rgb.crop((0, top, width, bottom)), dtype=np.uint8)
        for c in range(cols):
            left = max(0, math.floor(c * factor * scale_x) - margin_x)
            right = min(width, math.ceil((c + 1) * factor * scale_x) + margin_x)
            block = np.ascontiguousarray(band[:, left:right])
            digests[r * cols + c] = xxhash.xxh3_64_intdigest(struct.pack("<4I", top, bottom, left, right)
                                                             + block.tobytes())
    return digests


def token_shades(pixels: np.ndarray, grid: tuple[int, int], cells: Cells | None = None) -> np.ndarray:
    """(n, SHADE_SIDE * SHADE_SIDE) uint8: each token's grey levels over SHADE_SIDE x SHADE_SIDE cells, from the
    resized image's (rows * factor, cols * factor, 3) pixels (``cells``: their :class:`Cells`, if made already)."""
    rows, cols = grid
    side = SHADE_SIDE
    means = (cells or Cells(pixels)).means(rows * side, cols * side)
    levels = np.rint(grey(means) * 255.0).astype(np.uint8)
    return levels.reshape(rows, side, cols, side).transpose(0, 2, 1, 3).reshape(rows * cols, side * side)


def token_chroma(pixels: np.ndarray, grid: tuple[int, int], cells: Cells | None = None) -> np.ndarray:
    """(n, 2) int16: each token's mean R - G and (R + G) / 2 - B, from the resized image's pixels (``cells``: their
    :class:`Cells`, if made already)."""
    rows, cols = grid
    means = (cells or Cells(pixels)).means(rows, cols).reshape(rows * cols, 3)
    opponent = np.stack([means[:, 0] - means[:, 1], (means[:, 0] + means[:, 1]) / 2 - means[:, 2]], axis=1)
    return np.rint(opponent).astype(np.int16)


def token_layout(shades: np.ndarray, chroma: np.ndarray) -> np.ndarray:
    """(n, LAYOUT_DIM) float32: per token, what a move of a pixel or two leaves nearly in place (the coarse stage's
    ingredient, TokenFeatures.regional): its grey levels pooled to LAYOUT_CELLS x LAYOUT_CELLS cells minus their
    mean, over the spread of its shades (at least LAYOUT_CONTRAST_FLOOR), weighted LAYOUT_STRUCTURE; and its tone,
    the mean grey level, the chroma and a constant, normalised to the norm sqrt(0.2)."""
    levels = shades.astype(np.float32)  # (n, SHADE_SIDE * SHADE_SIDE)
    n = len(levels)
    mean = levels.mean(axis=1)
    spread = np.maximum(np.linalg.norm(levels - mean[:, None], axis=1), LAYOUT_CONTRAST_FLOOR)
    cells = cell_means(levels.reshape(n, SHADE_SIDE, SHADE_SIDE).transpose(1, 2, 0), LAYOUT_CELLS, LAYOUT_CELLS)
    structure = (cells.reshape(LAYOUT_CELLS * LAYOUT_CELLS, n).T - mean[:, None]) / spread[:, None]
    tone = np.stack([mean / 255.0 - 0.5, chroma[:, 0] / 255.0, chroma[:, 1] / 255.0,
                     np.full(n, 0.25, np.float32)], axis=1)
    return np.concatenate([LAYOUT_STRUCTURE * structure, np.sqrt(0.2) * normalise(tone)], axis=1).astype(np.float32)


def chroma_change(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """(n,) float32: per token, how far its colour moved between two tokens' chroma (n, 2 each), in levels, once a
    change of saturation within [MIN_GAIN, MAX_GAIN] is taken out (the brightness and contrast changes
    shade_change forgives scale the chroma alike)."""
    old_f, new_f = old.astype(np.float32), new.astype(np.float32)
    norm = np.einsum("nc,nc->n", old_f, old_f)
    gain = np.divide(np.einsum("nc,nc->n", new_f, old_f), norm, out=np.ones(len(old_f), np.float32),
                     where=norm > 1.0)
    gain = np.clip(gain, MIN_GAIN, MAX_GAIN)
    return np.abs(new_f - gain[:, None] * old_f).max(axis=1, initial=0.0)


def shade_change(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """(n,) float32: per token, the most any cell's grey level moved between two tokens' shades (n, cells each),
    once a change of brightness and contrast is taken out: new is fitted as gain * old + offset (least squares,
    the gain held to [MIN_GAIN, MAX_GAIN], so that a glyph wiped off a token is not fitted by a gain of 0)."""
    old_f, new_f = old.astype(np.float32), new.astype(np.float32)
    old_d = old_f - old_f.mean(axis=1, keepdims=True)
    new_d = new_f - new_f.mean(axis=1, keepdims=True)
    spread = np.einsum("nc,nc->n", old_d, old_d)
    gain = np.divide(np.einsum("nc,nc->n", new_d, old_d), spread, out=np.ones(len(old_f), np.float32),
                     where=spread > 1.0)
    gain = np.clip(gain, MIN_GAIN, MAX_GAIN)
    return np.abs(new_d - gain[:, None] * old_d).max(axis=1, initial=0.0)


def cell_means(values: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """(rows, cols, channels) float32 means of values (H, W, channels) over a grid of equal cells when H and W
    divide (summed slice by slice: a strided multi-axis mean is several times slower), of nearly equal ones else."""
    height, width = values.shape[:2]
    if height % rows or width % cols:
        top = np.round(np.linspace(0, height, rows + 1)).astype(np.int64)[:-1]
        left = np.round(np.linspace(0, width, cols + 1)).astype(np.int64)[:-1]
        sums = np.add.reduceat(np.add.reduceat(values.astype(np.float32), top, axis=0), left, axis=1)
        areas = np.outer(np.diff(np.append(top, height)), np.diff(np.append(left, width)))
        return sums / areas[:, :, None]
    step_y, step_x = height // rows, width // cols
    if step_y * step_x > 16:  # large cells: one reduceat per axis beats step_y * step_x slice adds
        sums = np.add.reduceat(np.add.reduceat(values.astype(np.float32), np.arange(0, height, step_y), axis=0),
                               np.arange(0, width, step_x), axis=1)
        return sums / (step_y * step_x)
    # uint8 sums of at most 16 values fit in uint16, which adds several times faster than float32
    accumulator = np.uint16 if values.dtype == np.uint8 else np.float32
    sums = values[::step_y, ::step_x].astype(accumulator)
    for dy in range(step_y):
        for dx in range(step_x):
            if dy or dx:
                sums += values[dy::step_y, dx::step_x]
    return sums.astype(np.float32) / (step_y * step_x)


class Cells:
    """Means of one image's pixels (H, W, channels) over grids of equal cells, each grid's integer sums added up
    from the finest grid already summed whose cells tile its cells (the token features take three: 2 x 2, 4 x 4
    and 28 x 28 pixels a cell for a 28-pixel token, 14 ms as three cell_means and 6 ms so for an 896-px image).
    The same float32 means as :func:`cell_means` gives: every sum is exact. A grid whose cells do not divide the
    image, or values that are not uint8, go to cell_means."""

    def __init__(self, pixels: np.ndarray):
        self.pixels = pixels
        self._sums: dict[tuple[int, int], np.ndarray] = {}  # (cell height, cell width) -> integer sums

    def means(self, rows: int, cols: int) -> np.ndarray:
        """(rows, cols, channels) float32, as cell_means(self.pixels, rows, cols)."""
        pixels = self.pixels
        height, width = pixels.shape[:2]
        if pixels.dtype != np.uint8 or height % rows or width % cols:
            return cell_means(pixels, rows, cols)
        step = (height // rows, width // cols)
        return self._summed(step).astype(np.float32) / (step[0] * step[1])

    def _summed(self, step: tuple[int, int]) -> np.ndarray:
        if (known := self._sums.get(step)) is not None:
            return known
        # The coarsest grid summed already (or the pixels, at 1 x 1) whose cells tile these.
        base = max((s for s in self._sums if step[0] % s[0] == 0 and step[1] % s[1] == 0),
                   key=lambda s: s[0] * s[1], default=(1, 1))
        values = self.pixels if base == (1, 1) else self._sums[base]
        ky, kx = step[0] // base[0], step[1] // base[1]
        if base == (1, 1) and ky % 2 == 0 and kx % 2 == 0 and (ky, kx) != (2, 2):
            values, ky, kx = self._summed((2, 2)), ky // 2, kx // 2  # halve first: the next adds read a quarter
        # uint16 adds are several times faster than uint32; they hold a sum of up to 257 uint8 values
        wide: type[np.unsignedinteger] = np.uint16 if step[0] * step[1] <= 257 else np.uint32
        sums: np.ndarray
        if ky * kx <= 64:
            sums = values[::ky, ::kx].astype(wide)
            for dy in range(ky):
                for dx in range(kx):
                    if dy or dx:
                        sums += values[dy::ky, dx::kx]
        else:
            h, w, channels = values.shape
            sums = values.reshape(h, w // kx, kx, channels).sum(axis=2, dtype=wide)
            sums = sums.reshape(h // ky, ky, w // kx, channels).sum(axis=1, dtype=wide)
        self._sums[step] = sums
        return sums


def grey(rgb: np.ndarray) -> np.ndarray:
    """(...) float32 in [0, 1] from (..., 3) RGB in [0, 255] (ITU-R 601 luma)."""
    weights = np.array([0.299, 0.587, 0.114], np.float32) / 255.0
    return rgb.astype(np.float32, copy=False) @ weights


def token_entropy(luma: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """(n,) float32: Shannon entropy in bits of each token's grey-level histogram (HISTOGRAM_BINS levels), from
    luma in [0, 1] on a whole number of samples per token: the resized image's pixels, or (what the pixel
    extractor passes) the means of its 2 x 2-pixel cells, which count the same flat regions as flat."""
    rows, cols = grid
    height, width = luma.shape
    levels = np.minimum((luma * HISTOGRAM_BINS).astype(np.int32), HISTOGRAM_BINS - 1)  # (H, W)
    token_row = (np.arange(height, dtype=np.int32) // (height // rows)) * cols  # (H,)
    token_col = np.arange(width, dtype=np.int32) // (width // cols)  # (W,)
    codes = (token_row[:, None] + token_col[None, :]) * HISTOGRAM_BINS + levels  # (H, W): token * bins + level
    counts = np.bincount(codes.ravel(), minlength=rows * cols * HISTOGRAM_BINS).reshape(rows * cols, HISTOGRAM_BINS)
    p = counts / (height // rows * (width // cols))  # (n, bins)
    with np.errstate(divide="ignore", invalid="ignore"):
        bits = -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)
    return bits.astype(np.float32)
