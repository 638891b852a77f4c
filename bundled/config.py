"""Where bundled models are built: ``REVISIT_CACHE_DIR`` (default ~/.cache/revisit/models)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from settings import PREFIX, EnvReader

ENV_CACHE_DIR = PREFIX + "CACHE_DIR"


def default_model_cache_dir() -> Path:
    return Path.home() / ".cache" / "revisit" / "models"


def model_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The folder bundled models are built into (one subfolder per recipe digest)."""
    return EnvReader(environ).path(ENV_CACHE_DIR) or default_model_cache_dir()
