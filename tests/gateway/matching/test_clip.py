"""The clip extractor: an open_clip tower from a local folder only (here bundled.clip's random-weight one)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from gateway.config import ConfigError, GatewayConfig, MatchSettings
from gateway.matching import extractor_for
from tests.gateway.matching.pairs import CELL, aligned, jpeg


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    from bundled.clip import build_clip

    return build_clip(tmp_path_factory.mktemp("clip") / "tiny")


@pytest.fixture(scope="module")
def clip(clip_folder):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # any attempt to reach a hub fails instead of downloading
        return extractor_for(MatchSettings(extractor="clip", extractor_path=clip_folder))


def test_tiles_give_one_unit_vector_per_token(clip) -> None:
    image = aligned("astronaut.png", 11, 13)  # not a whole number of 8 x 8-token tiles: padded
    f = clip.extract(image, (11, 13), CELL)
    assert f.vectors.shape == (143, clip.dim) and clip.name.startswith("clip-v1-")
    assert np.allclose(np.linalg.norm(f.vectors.astype(np.float32), axis=1), 1.0, atol=2e-3)
    again = clip.extract(image.copy(), (11, 13), CELL)
    assert (again.vectors == f.vectors).all()
    reencoded = clip.extract(jpeg(image, 90), (11, 13), CELL)
    other = clip.extract(aligned("coffee.png", 11, 13), (11, 13), CELL)

    def mean_cosine(a, b) -> float:
        return float(np.einsum("nd,nd->n", a.vectors.astype(np.float32), b.vectors.astype(np.float32)).mean())

    assert mean_cosine(f, reencoded) > mean_cosine(f, other)


def test_a_folder_without_weights_or_config_is_refused(clip_folder, tmp_path) -> None:
    empty = tmp_path / "no-config"
    empty.mkdir()
    with pytest.raises(ConfigError, match="open_clip_config.json"):
        extractor_for(MatchSettings(extractor="clip", extractor_path=empty))
    unweighted = tmp_path / "no-weights"
    unweighted.mkdir()
    shutil.copy(clip_folder / "open_clip_config.json", unweighted)
    with pytest.raises(ConfigError, match="cannot load"):
        extractor_for(MatchSettings(extractor="clip", extractor_path=unweighted))
    with pytest.raises(ConfigError, match="open_clip model folder"):
        GatewayConfig.from_env({"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://w", "REVISIT_MATCH_EXTRACTOR": "clip"})
