"""Fixtures for engine_ext tests: tiny bundled models built into a private cache, real images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine_ext.bundled import ARCHS, TINY, build_model
from tests.conftest import free_port  # noqa: F401 (re-exported to this package's tests)
from tests.images_lib import data_url, encode


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
    return data_url(encode(image))


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



def noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
