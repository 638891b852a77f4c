"""Fixtures for engine_ext tests: tiny bundled models built into a private cache, real images."""

from __future__ import annotations

import base64
import io
import socket
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine_ext.bundled import ARCHS, TINY, build_model


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_models(model_cache: Path) -> dict[str, Path]:
    """arch -> directory of its tiny bundled model."""
    return {arch: build_model(arch, TINY, cache_dir=model_cache) for arch in ARCHS}


@pytest.fixture(scope="session")
def astronaut() -> Image.Image:
    from skimage import data

    return Image.fromarray(data.astronaut())


@pytest.fixture(scope="session")
def coffee() -> Image.Image:
    from skimage import data

    return Image.fromarray(data.coffee())


def png_data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(image: Image.Image, text: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(image)}},
                {"type": "text", "text": text},
            ],
        }
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
