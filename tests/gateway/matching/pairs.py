"""Small near-duplicate pairs from scikit-image's bundled images, token-aligned (28-pixel tokens, no resize)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw

from gateway.matching.features import TokenFeatures
from gateway.matching.pixel import PixelExtractor
from tests.images_lib import load

CELL = 28
EXTRACTOR = PixelExtractor()


def aligned(name: str, rows: int, cols: int) -> Image.Image:
    return load(name).convert("RGB").resize((cols * CELL, rows * CELL), Image.Resampling.BICUBIC)


def features(image: Image.Image) -> TokenFeatures:
    return EXTRACTOR.extract(image, (image.height // CELL, image.width // CELL), CELL)


def jpeg(image: Image.Image, quality: int = 75) -> Image.Image:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return Image.open(io.BytesIO(out.getvalue())).convert("RGB")


def edited(image: Image.Image, box: tuple[int, int, int, int], text: str = "edit") -> Image.Image:
    """A copy with one box painted over and written in."""
    copy = image.copy()
    draw = ImageDraw.Draw(copy)
    draw.rectangle(box, fill=(250, 250, 250))
    draw.text((box[0] + 2, box[1] + 2), text, fill=(0, 0, 0))
    return copy


def changed_tokens(a: Image.Image, b: Image.Image) -> np.ndarray:
    """(n,) bool: tokens whose pixels differ between two images of one size."""
    diff = np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max(axis=2)  # (H, W)
    rows, cols = a.height // CELL, a.width // CELL
    return (diff.reshape(rows, CELL, cols, CELL).max(axis=(1, 3)) > 0).reshape(-1)


def encode_png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()
