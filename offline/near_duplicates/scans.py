"""Sources from scikit-image's bundled data: photos (re-encoded, cropped, brightened; regions of one photo), and the
scanned text pages stacked into one tall document that is edited and scrolled."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache
from io import BytesIO
from pathlib import Path

import numpy as np
import skimage
from PIL import Image, ImageDraw, ImageEnhance, ImageFont
from skimage import filters, measure, morphology

from offline.near_duplicates.pairs import (
    DEFAULT_TOKENS,
    EDIT_WORDS,
    LARGE_TOKENS,
    MAX_TOKENS,
    TOKEN,
    Pair,
    changed_exact,
    fit,
    grid,
    shape_for,
    unchanged,
)

SKIMAGE_DATA = Path(skimage.__file__).parent / "data"
# Natural photos bundled with scikit-image (grey ones become RGB). motorcycle_right is the other eye of
# motorcycle_left (a stereo pair), so it is never an "unrelated" partner of it.
PHOTOS = ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "camera.png", "motorcycle_left.png",
          "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "ihc.png", "coins.png", "moon.png",
          "brick.png", "grass.png", "gravel.png", "cell.png", "clock_motion.png")
TWINS = frozenset({frozenset({"motorcycle_left.png", "motorcycle_right.png"})})
# Large photos whose non-overlapping regions look alike but show different things.
REGION_PHOTOS = ("hubble_deep_field.jpg", "retina.jpg", "gravel.png", "grass.png", "brick.png")
TEXT_SCANS = ("page.png", "text.png")


@lru_cache(maxsize=32)
def skimage_image(name: str) -> Image.Image:
    """A scikit-image data file as RGB (transparent ones on white)."""
    with Image.open(SKIMAGE_DATA / name) as image:
        if image.mode in ("RGBA", "LA", "P"):
            rgba = image.convert("RGBA")
            flat = Image.new("RGB", rgba.size, (255, 255, 255))
            flat.paste(rgba, mask=rgba.getchannel("A"))
            return flat
        return image.convert("RGB")


def photos() -> list[str]:
    return [name for name in PHOTOS if (SKIMAGE_DATA / name).exists()]


def photo_of(rng: random.Random, name: str, tokens: tuple[int, int]) -> Image.Image:
    source = skimage_image(name)
    rows, cols = shape_for(rng, source.width / source.height, tokens)
    return fit(source, rows, cols, rng)


@dataclass(frozen=True)
class _Scan:
    """The scanned text pages stacked into one tall document, and its words' boxes (x0, y0, x1, y1)."""

    image: Image.Image
    words: tuple[tuple[int, int, int, int], ...]


@lru_cache(maxsize=2)
def _scan(scale: int, height: int) -> _Scan:
    """page.png and text.png scaled up ``scale`` times (to about the size of text on a screen) and stacked, page,
    text, page, ..., until ``height`` pixels; words found as connected runs of ink."""
    page = skimage_image("page.png")
    width = (page.width * scale) // TOKEN * TOKEN
    blocks: list[Image.Image] = []
    printed: list[tuple[int, int]] = []  # rows of page.png blocks: the words to edit (text.png is handwriting)
    total = 0
    names = [name for name in TEXT_SCANS if (SKIMAGE_DATA / name).exists()]
    while total < height:
        name = names[len(blocks) % len(names)]
        source = skimage_image(name)
        block = source.resize((width, round(source.height * width / source.width)), Image.Resampling.LANCZOS)
        if name == "page.png":
            printed.append((total, total + block.height))
        blocks.append(block)
        total += block.height
    canvas = Image.new("RGB", (width, total))
    y = 0
    for block in blocks:
        canvas.paste(block, (0, y))
        y += block.height
    gray = np.asarray(canvas.convert("L"), dtype=np.float64) / 255
    ink = gray < filters.threshold_sauvola(gray, window_size=31, k=0.2) - 0.03
    joined = morphology.dilation(ink, morphology.footprint_rectangle((3, 4 * scale + 1)))
    words = []
    for region in measure.regionprops(measure.label(joined)):
        y0, x0, y1, x1 = region.bbox
        if not any(top <= y0 and y1 <= bottom for top, bottom in printed):
            continue
        if 6 * scale <= y1 - y0 <= 22 * scale and 8 * scale <= x1 - x0 <= 90 * scale and region.extent > 0.4:
            words.append((x0, y0, x1, y1))
    return _Scan(canvas, tuple(sorted(words, key=lambda box: (box[1], box[0]))))


def scan_for(large: bool) -> _Scan:
    return _scan(4, 3200) if large else _scan(2, 1400)


def replace_word(image: Image.Image, box: tuple[int, int, int, int], word: str) -> Image.Image:
    """The image with the word in ``box`` painted over with its surrounding background and ``word`` drawn in its
    place, in the old word's ink and about its size (what an edit of the document would show)."""
    x0, y0, x1, y1 = box
    pixels = np.asarray(image.convert("L"))
    margin = pixels[max(0, y0 - 3):y1 + 3, max(0, x0 - 3):x1 + 3]
    background = int(np.percentile(margin, 80))
    ink = int(np.percentile(pixels[y0:y1, x0:x1], 5))
    edited = image.copy()
    draw = ImageDraw.Draw(edited)
    draw.rectangle((x0 - 1, y0 - 1, x1, y1), fill=(background,) * 3)
    font = ImageFont.load_default(size=max(8, round((y1 - y0) * 1.05)))
    left, top, _, bottom = font.getbbox(word)
    draw.text((x0 - left, y0 + ((y1 - y0) - (bottom - top)) // 2 - top), word, font=font, fill=(ink,) * 3)
    return edited


def window(image: Image.Image, y: int, rows: int, cols: int, x: int = 0) -> Image.Image:
    return image.crop((x, y, x + cols * TOKEN, y + rows * TOKEN))


def scan_rows(rng: random.Random, cols: int, tokens: tuple[int, int]) -> int:
    return max(2, min(rng.randint(*tokens) // cols, MAX_TOKENS // cols))


def scan_edits(rng: random.Random, count: int, large: bool) -> list[Pair]:
    scan = scan_for(large)
    cols = scan.image.width // TOKEN
    tokens = LARGE_TOKENS if large else DEFAULT_TOKENS
    pairs: list[Pair] = []
    for attempt in range(count * 20):
        if len(pairs) == count:
            break
        rows = scan_rows(rng, cols, tokens)
        y = rng.randint(0, scan.image.height - rows * TOKEN)
        inside = [box for box in scan.words if box[1] >= y + 4 and box[3] <= y + rows * TOKEN - 4]
        if not inside:
            continue
        box = rng.choice(inside)
        edited = replace_word(scan.image, box, rng.choice(EDIT_WORDS))
        a, b = window(scan.image, y, rows, cols), window(edited, y, rows, cols)
        changed = changed_exact(a, b)
        if changed.any():
            pairs.append(Pair(f"doc-edit/page.png/word-{attempt}", "doc_edit", a, b, True, changed, (0, 0)))
    return pairs


def scrolls(rng: random.Random, image: Image.Image, count: int, source: str, tokens: tuple[int, int],
             whole: bool, max_rows: int = 6) -> list[Pair]:
    """Windows of one tall image before and after a scroll: down (new content at the bottom) three times in four,
    else up. Whole scrolls move by whole tokens; partial ones by a number of pixels that is not a multiple of 28."""
    cols = image.width // TOKEN
    pairs: list[Pair] = []
    for index in range(count):
        rows = scan_rows(rng, cols, tokens)
        steps = rng.randint(1, max_rows) if whole else rng.randint(0, max_rows - 1)
        offset = steps * TOKEN + (0 if whole else rng.randint(1, TOKEN - 1))
        room = image.height - rows * TOKEN - offset
        if room < 0:
            rows = (image.height - offset) // TOKEN
            room = image.height - rows * TOKEN - offset
        y = rng.randint(0, room)
        down = rng.random() < 0.75
        top_a, top_b = (y, y + offset) if down else (y + offset, y)
        a, b = window(image, top_a, rows, cols), window(image, top_b, rows, cols)
        direction = "down" if down else "up"
        if whole:
            shift = (-steps, 0) if down else (steps, 0)
            pairs.append(Pair(f"doc-scroll-whole/{source}/{direction}-{steps}-rows-{index}", "doc_scroll_whole", a, b,
                              True, changed_exact(a, b, shift), shift))
        else:
            pairs.append(Pair(f"doc-scroll-partial/{source}/{direction}-{offset}-px-{index}", "doc_scroll_partial",
                              a, b, True, None, None, motion=(-offset if down else offset, 0)))
    return pairs


def scan_scrolls(rng: random.Random, count: int, large: bool, whole: bool) -> list[Pair]:
    return scrolls(rng, scan_for(large).image, count, "page.png", LARGE_TOKENS if large else DEFAULT_TOKENS,
                    whole)


def photo_pairs(rng: random.Random, count: int, large: bool, family: str) -> list[Pair]:
    """Photos re-encoded, cropped by whole tokens, or brightened: B shows A's content unchanged."""
    tokens = LARGE_TOKENS if large else DEFAULT_TOKENS
    names = photos()
    pairs: list[Pair] = []
    for index in range(count):
        name = names[index % len(names)]
        a = photo_of(rng, name, tokens)
        if family == "photo_jpeg":
            quality = rng.randint(60, 90)
            buffer = BytesIO()
            a.save(buffer, format="JPEG", quality=quality)
            b = Image.open(BytesIO(buffer.getvalue())).convert("RGB")
            pairs.append(Pair(f"photo-jpeg/{name}/q{quality}-{index}", family, a, b, True, unchanged(b), (0, 0)))
        elif family == "photo_bright":
            factor = rng.choice((-1, 1)) * rng.uniform(0.05, 0.15) + 1
            b = ImageEnhance.Brightness(a).enhance(factor)
            pairs.append(Pair(f"photo-bright/{name}/x{factor:.2f}-{index}", family, a, b, True, unchanged(b),
                              (0, 0)))
        else:
            rows, cols = grid(a)
            while True:
                top, bottom, left, right = (rng.randint(0, max(1, n // 6)) for n in (rows, rows, cols, cols))
                if top + bottom + left + right and (rows - top - bottom) * (cols - left - right) >= 4:
                    break
            box = (left * TOKEN, top * TOKEN, (cols - right) * TOKEN, (rows - bottom) * TOKEN)
            b = a.crop(box)
            pairs.append(Pair(f"photo-crop/{name}/t{top}-b{bottom}-l{left}-r{right}-{index}", family, a, b, True,
                              unchanged(b), (-top, -left)))
    return pairs


def region_pairs(rng: random.Random, count: int, large: bool) -> list[Pair]:
    """Two non-overlapping regions of one large photo: the same look (a star field, a retina, gravel), different
    content."""
    tokens = LARGE_TOKENS if large else (DEFAULT_TOKENS[0], 600)
    names = [name for name in REGION_PHOTOS if (SKIMAGE_DATA / name).exists()]
    pairs: list[Pair] = []
    for index in range(count):
        name = names[index % len(names)]
        source = skimage_image(name)
        rows, cols = shape_for(rng, 1.0, tokens)
        width, height = cols * TOKEN, rows * TOKEN
        scale = 2.1 * max(width, height) / min(source.width, source.height)
        if scale > 1:  # room for two regions
            source = source.resize((math.ceil(source.width * scale), math.ceil(source.height * scale)),
                                   Image.Resampling.LANCZOS)
        if source.width >= 2 * width:  # side by side, else one above the other
            xa, xb = rng.randint(0, source.width - 2 * width), 0
            xb = rng.randint(xa + width, source.width - width)
            ya, yb = rng.randint(0, source.height - height), rng.randint(0, source.height - height)
        else:
            rows = min(rows, source.height // (2 * TOKEN))
            height = rows * TOKEN
            xa, xb = rng.randint(0, source.width - width), rng.randint(0, source.width - width)
            ya = rng.randint(0, source.height - 2 * height)
            yb = rng.randint(ya + height, source.height - height)
        a = source.crop((xa, ya, xa + width, ya + height))
        b = source.crop((xb, yb, xb + width, yb + height))
        pairs.append(Pair(f"unrelated-same-site/{name}/regions-{index}", "unrelated_same_site", a, b, False, None,
                          None))
    return pairs
