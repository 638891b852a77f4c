"""The encoder extractor: the bundled oracle's own (trained) vision tower as the token descriptor."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.config import ConfigError, GatewayConfig, MatchSettings
from gateway.matching import extractor_for
from gateway.matching.align import CHANGED, align, find_shift
from tests.gateway.matching.pairs import CELL, aligned, edited, jpeg


@pytest.fixture(scope="module")
def encoder(model_cache):
    from bundled import build_model

    return extractor_for(MatchSettings(extractor="encoder",
                                       extractor_path=build_model("qwen2_5_vl", "oracle", cache_dir=model_cache)))


def test_vectors_are_the_towers_merged_tokens(encoder) -> None:
    image = aligned("page.png", 6, 8)
    f = encoder.extract(image, (6, 8), CELL)
    assert f.vectors.shape == (48, encoder.dim) and encoder.name.startswith("encoder-v1-")
    assert np.allclose(np.linalg.norm(f.vectors.astype(np.float32), axis=1), 1.0, atol=2e-3)
    again = encoder.extract(image.copy(), (6, 8), CELL)
    assert (again.vectors == f.vectors).all() and (again.digests == f.digests).all()


def test_it_tells_an_edit_from_a_reencode(encoder) -> None:
    a = aligned("page.png", 8, 10)
    fa = encoder.extract(a, (8, 10), CELL)
    fj = encoder.extract(jpeg(a), (8, 10), CELL)
    b = edited(a, (3 * CELL + 3, 2 * CELL + 3, 5 * CELL + 10, 2 * CELL + 24), "other")
    fb = encoder.extract(b, (8, 10), CELL)
    same = align(fj, fa, shift=find_shift(fj, fa), patch_threshold=0.0, max_shade_change=255, blank_entropy=0.5)
    edit = align(fb, fa, shift=(0, 0), patch_threshold=0.0, max_shade_change=255, blank_entropy=0.5)
    touched = fb.digests != fa.digests
    assert same.similarity > 0.9 and (edit.changes[~touched] != CHANGED).all()
    assert edit.cosine[touched].mean() < same.cosine[touched].mean()


def test_the_encoder_extractor_needs_a_model_folder(model_path) -> None:
    env = {"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://w", "REVISIT_MATCH_EXTRACTOR": "encoder",
           "REVISIT_AUTH": "open"}
    with pytest.raises(ConfigError, match="model folder"):
        GatewayConfig.from_env(env)
    config = GatewayConfig.from_env({**env, "REVISIT_MODEL_DIR": str(model_path)})
    assert config.reuse.match.extractor_path == model_path  # the served model's own tower by default
