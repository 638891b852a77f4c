"""Model building and training: the project's bundled vision-language models, built offline from recipes.

Two architectures (Qwen2.5-VL and Qwen3-VL) in two sizes: ``tiny`` for tests and ``bench`` for
timing (and a Qwen2.5-VL ``deep``: a real model's depth and head layout at a narrow width, for timing reuse), with
a locally trained tokenizer and deterministic random weights; and two small Qwen2.5-VL readers whose weights were
trained here to read panels (bundled.reader) and are committed: ``reader``, ``oracle``, whose answers come from
late-layer image KV, and ``deep-reader``, 16 layers that also answer relational questions from notes its image
tokens took of their neighbours.
Nothing is downloaded. Neither the gateway nor the engine extension imports this package; the launcher's
worker command and ``revisit serve`` build a bundled model before starting workers on it.

    >>> from bundled import build_model
    >>> path = build_model("qwen2_5_vl", "tiny")   # idempotent; cached by recipe digest
"""

from bundled.build import RECIPE_FILE, build_model, is_built, model_dir
from bundled.recipes import (
    ARCHS,
    BENCH,
    DEEP,
    DEEP_READER,
    DEFAULT_ARCH,
    DEFAULT_SIZE,
    ORACLE,
    QWEN2_5_VL,
    QWEN3_VL,
    READER,
    SIZES,
    TINY,
    ModelRecipe,
    get_recipe,
)

__all__ = [
    "ARCHS",
    "BENCH",
    "DEEP",
    "DEEP_READER",
    "DEFAULT_ARCH",
    "DEFAULT_SIZE",
    "ORACLE",
    "QWEN2_5_VL",
    "QWEN3_VL",
    "READER",
    "RECIPE_FILE",
    "SIZES",
    "TINY",
    "ModelRecipe",
    "build_model",
    "get_recipe",
    "is_built",
    "model_dir",
]
