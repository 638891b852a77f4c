"""Bundled models: they load and run in transformers, and builds are idempotent and reproducible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoModelForImageTextToText, AutoProcessor

from bundled import (
    ARCHS,
    BENCH,
    DEEP,
    DEFAULT_ARCH,
    QWEN2_5_VL,
    QWEN3_VL,
    RECIPE_FILE,
    TINY,
    build_model,
    get_recipe,
    model_dir,
)
from bundled.config import ENV_CACHE_DIR
from bundled.errors import BuildError
from tests.images_lib import noise_image


def _last_logits(model, processor, image: Image.Image, text: str) -> torch.Tensor:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits[0, -1]  # (vocab,)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_runs_in_transformers_and_sees_the_image(
    arch: str, tiny_models: dict[str, Path], astronaut: Image.Image, coffee: Image.Image
) -> None:
    path = tiny_models[arch]
    processor = AutoProcessor.from_pretrained(path)
    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32
    model.eval()
    on_astronaut = _last_logits(model, processor, astronaut, "What is in the picture?")
    on_coffee = _last_logits(model, processor, coffee, "What is in the picture?")
    assert torch.isfinite(on_astronaut).all()
    # Logits spread widely enough for clear greedy choices, and the image changes them.
    assert on_astronaut.std() > 1.0
    assert (on_astronaut - on_coffee).abs().max() > 0.5


@pytest.mark.parametrize("arch", ARCHS)
def test_processor_bounds_image_tokens_by_the_recipe(arch: str, tiny_models: dict[str, Path]) -> None:
    recipe = get_recipe(arch, TINY)
    processor = AutoProcessor.from_pretrained(tiny_models[arch])
    merge = recipe.vision.spatial_merge_size
    big = processor.image_processor(images=[noise_image(1400, 2000)], return_tensors="pt")
    tokens = int(big["image_grid_thw"].prod()) // merge**2
    assert recipe.max_image_tokens * 0.9 <= tokens <= recipe.max_image_tokens
    small = processor.image_processor(images=[noise_image(20, 30)], return_tensors="pt")
    assert int(small["image_grid_thw"].prod()) // merge**2 >= recipe.min_image_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_config_carries_what_sglang_reads(arch: str, tiny_models: dict[str, Path]) -> None:
    config = json.loads((tiny_models[arch] / "config.json").read_text())
    assert config["architectures"] == [
        {
            QWEN2_5_VL: "Qwen2_5_VLForConditionalGeneration",
            QWEN3_VL: "Qwen3VLForConditionalGeneration",
        }[arch]
    ]
    assert config["vision_config"]["in_chans"] == 3
    assert "mrope_section" in config["text_config"]["rope_parameters"]
    assert config["dtype"] == config["text_config"]["dtype"] == "float32"
    generation = json.loads((tiny_models[arch] / "generation_config.json").read_text())
    assert set(generation) == {"bos_token_id", "eos_token_id", "pad_token_id"}  # no sampling defaults


def test_checkpoint_names_match_the_released_checkpoints(tiny_models: dict[str, Path]) -> None:
    def names(arch: str) -> set[str]:
        with safe_open(tiny_models[arch] / "model.safetensors", "pt") as weights:
            return set(weights.keys())

    qwen2_5 = names(QWEN2_5_VL)
    assert "model.embed_tokens.weight" in qwen2_5 and "visual.patch_embed.proj.weight" in qwen2_5
    qwen3 = names(QWEN3_VL)
    assert "model.language_model.embed_tokens.weight" in qwen3
    assert "model.visual.pos_embed.weight" in qwen3
    assert not any(name.startswith("lm_head") for name in qwen2_5 | qwen3)  # tied to the embeddings


def test_rebuilding_the_same_recipe_gives_identical_files(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    original = tiny_models[DEFAULT_ARCH]
    rebuilt = build_model(DEFAULT_ARCH, TINY, cache_dir=tmp_path)
    assert rebuilt.name == original.name
    files = sorted(p.name for p in original.iterdir())
    assert files == sorted(p.name for p in rebuilt.iterdir())
    for name in files:
        assert (original / name).read_bytes() == (rebuilt / name).read_bytes(), name


def test_build_is_idempotent_and_leaves_no_scratch(
    model_cache: Path, tiny_models: dict[str, Path]
) -> None:
    path = tiny_models[DEFAULT_ARCH]
    weights_mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert build_model(DEFAULT_ARCH, TINY, cache_dir=model_cache) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == weights_mtime
    assert sorted(p.name for p in model_cache.iterdir()) == sorted(p.name for p in tiny_models.values())
    assert path.stat().st_mode & 0o777 == 0o755


def test_an_incomplete_directory_is_reported_not_reused(tmp_path: Path) -> None:
    target = model_dir(DEFAULT_ARCH, TINY, tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    with pytest.raises(BuildError, match="not a complete build"):
        build_model(DEFAULT_ARCH, TINY, cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # scratch removed


def test_default_cache_dir_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path))
    assert model_dir(QWEN3_VL, BENCH) == tmp_path / get_recipe(QWEN3_VL, BENCH).directory_name


def test_recipes_differ_in_digest_and_validate() -> None:
    digests = {get_recipe(arch, size).digest() for arch in ARCHS for size in (TINY, BENCH)}
    assert len(digests) == 4
    with pytest.raises(ValueError, match="no bundled model"):
        get_recipe("llava", TINY)
    with pytest.raises(ValueError, match="no bundled model"):
        build_model(QWEN2_5_VL, "huge")


def test_cli_builds_and_prints_the_path(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bundled"]
    where = ["--arch", QWEN3_VL, "--cache-dir", str(tmp_path)]
    result = subprocess.run([*command, "build", *where], capture_output=True, text=True, check=True)
    path = Path(result.stdout.strip())
    assert path == model_dir(QWEN3_VL, TINY, tmp_path)
    assert (path / RECIPE_FILE).is_file()
    assert "initialising" in result.stderr and "built" in result.stderr
    again = subprocess.run([*command, "path", *where], capture_output=True, text=True, check=True)
    assert Path(again.stdout.strip()) == path


def test_the_deep_recipe_has_a_real_models_depth_and_head_layout() -> None:
    """Qwen2.5-VL-7B's decoder layers and heads, and the 32-block tower, at a narrow width (bundled/recipes.py)."""
    deep = get_recipe(QWEN2_5_VL, DEEP)
    text, vision = deep.text, deep.vision
    assert (text.num_layers, text.num_heads, text.num_kv_heads) == (28, 28, 4)
    assert text.intermediate_size / text.hidden_size == pytest.approx(18944 / 3584, rel=0.01)
    assert (vision.depth, vision.fullatt_block_indexes, vision.window_size) == (32, (7, 15, 23, 31), 112)
    assert vision.intermediate_size / vision.hidden_size == pytest.approx(3420 / 1280, rel=0.02)
    assert vision.hidden_size // vision.num_heads == 32 and text.hidden_size < 1024  # narrow: seconds on a CPU
    assert deep.max_image_tokens == 2304
