"""Real test images (scikit-image's bundled data) and ways to encode them."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import skimage
from PIL import Image

DATA_DIR = Path(skimage.__file__).parent / "data"


def load(name: str) -> Image.Image:
    """A bundled image by file name, e.g. ``astronaut.png``, ``coffee.png``, ``rocket.jpg``."""
    image = Image.open(DATA_DIR / name)
    image.load()
    return image


def encode(image: Image.Image, fmt: str = "PNG", **save_args) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save_args)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def small(name: str, size: tuple[int, int] = (112, 112)) -> Image.Image:
    """A bundled image resized down, to keep CPU prefill short in end-to-end tests."""
    return load(name).convert("RGB").resize(size, Image.Resampling.BICUBIC)


def png_data_url(image: Image.Image) -> str:
    return data_url(encode(image))


def image_message(image: Image.Image, text: str) -> list[dict]:
    """One user message: the image, then the text."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                         {"type": "text", "text": text}]}]


def noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
