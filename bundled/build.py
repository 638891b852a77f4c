"""Build a bundled model into the cache, once, atomically."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bundled.config import model_cache_dir
from bundled.configs import (
    config_json,
    generation_config_json,
    hf_config,
    padded_vocab_size,
    processor_config_json,
)
from bundled.errors import BuildError
from bundled.recipes import DEFAULT_ARCH, DEFAULT_SIZE, ModelRecipe, get_recipe
from bundled.tokenizer import quiet_token_ids, save_tokenizer, train_tokenizer
from bundled.weights import write_weights

# Written last: a directory holding it is complete.
RECIPE_FILE = "revisit-recipe.json"

ProgressCallback = Callable[[str], None]


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def _make_readable(directory: Path) -> None:
    # mkdtemp and safetensors create private files; the cache may be shared between users.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def is_built(directory: Path) -> bool:
    return (directory / RECIPE_FILE).is_file()


def model_dir(arch: str = DEFAULT_ARCH, size: str = DEFAULT_SIZE, cache_dir: Path | None = None) -> Path:
    """Where ``build_model`` puts (or has put) this model; nothing is built."""
    root = cache_dir if cache_dir is not None else model_cache_dir()
    return root / get_recipe(arch, size).directory_name


def _build_into(recipe: ModelRecipe, directory: Path, on_progress: ProgressCallback) -> None:
    on_progress("training tokenizer")
    trained = train_tokenizer()
    ids = save_tokenizer(trained, directory)
    config = hf_config(recipe, ids)
    _write_json(directory / "config.json", config_json(recipe, ids))
    _write_json(directory / "generation_config.json", generation_config_json(ids))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    _write_json(directory / "processor_config.json", processor_config_json(recipe, tokenizer))
    quiet = quiet_token_ids(trained, padded_vocab_size(ids))
    n_params = write_weights(recipe, config, directory, quiet, on_progress)
    record = {
        "name": recipe.name,
        "digest": recipe.digest(),
        "parameters": n_params,
        "recipe": dataclasses.asdict(recipe),
    }
    _write_json(directory / RECIPE_FILE, record)


def build_model(
    arch: str = DEFAULT_ARCH,
    size: str = DEFAULT_SIZE,
    cache_dir: Path | None = None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """Return the directory of the bundled model ``arch``/``size``, building it first if needed.

    The model lands in ``<cache_dir>/<arch>-<size>-<recipe digest>/`` (``cache_dir`` defaults to
    ``REVISIT_CACHE_DIR``, else ~/.cache/revisit/models). The build happens in a temporary
    sibling directory that is renamed into place, so a reader never sees a half-written model
    and concurrent builders of the same recipe both return the same complete directory. The
    same recipe always produces byte-identical files. ``on_progress`` receives one line per
    slow step.
    """
    return build_recipe(get_recipe(arch, size), cache_dir, on_progress)


def build_recipe(recipe: ModelRecipe, cache_dir: Path | None = None,
                 on_progress: ProgressCallback | None = None) -> Path:
    """``build_model`` for a recipe object (the reader's trainer builds its untrained starting point with it)."""
    root = cache_dir if cache_dir is not None else model_cache_dir()
    target = root / recipe.directory_name
    if is_built(target):
        return target
    report = on_progress or (lambda _: None)
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        report(f"building {recipe.name} into {target}")
        _build_into(recipe, scratch, report)
        _make_readable(scratch)
        try:
            os.rename(scratch, target)
        except OSError as exc:
            if not is_built(target):  # not a lost race: a stale or foreign directory
                raise BuildError(f"{target} exists but is not a complete build; remove it") from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(f"built {recipe.name} in {time.perf_counter() - started:.1f} s")
    return target
