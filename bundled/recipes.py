"""Recipes of the bundled models: architecture, size, shapes, dtype, seed and image limits.

A recipe fully determines the files a build writes (together with the pinned torch, transformers
and tokenizers versions, which are part of its digest). Change any field and the model lands in a
new cache directory instead of silently replacing an old one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import tokenizers
import torch
import transformers

QWEN2_5_VL = "qwen2_5_vl"
QWEN3_VL = "qwen3_vl"
ARCHS = (QWEN2_5_VL, QWEN3_VL)
# Qwen2.5-VL is the default: SGLang's CPU path serves it with the fewest special cases
# (no deepstack, no learned position-embedding interpolation in the vision tower).
DEFAULT_ARCH = QWEN2_5_VL

TINY = "tiny"
BENCH = "bench"
# A small Qwen2.5-VL trained here to read panels of labelled fields (bundled.reader); it reads at
# its first layer.
READER = "reader"
# A deeper reader whose answers come from late-layer image KV (bundled.reader.swap): the oracle that can judge
# approximate reuse.
ORACLE = "oracle"
# A real model's depth at a narrow width: Qwen2.5-VL-7B's 28 decoder layers with its 28 query and 4 KV heads, and
# the 32-block vision tower, so that the shares of warmup layers, recomputed layers and vision in a prefill are a
# real model's, while a miss of a 1K-token image takes seconds on two cores (the reuse benches and the replay).
DEEP = "deep"
# A reader deep enough to take notes: the oracle's width at 16 decoder layers, trained on relational questions too
# (the value left of, or above, a named value), which a causal decoder answers from what a token noted about its
# neighbour during prefill. The judge of whether reuse keeps such notes right (bundled.reader, offline.layer_probe).
DEEP_READER = "deep-reader"
SIZES = (TINY, BENCH, READER, ORACLE, DEEP, DEEP_READER)
# Committed weights for the oracle's recipe fine-tuned on panels moved off the token grid (bundled.reader.train
# --moved): the judge of reusing moved content (bench/moved_quality.py). The recipe itself keeps the grid's oracle.
MOVED_ORACLE = "qwen2_5_vl-oracle-moved"
DEFAULT_SIZE = TINY

# Bumped whenever the build code changes what it writes for an unchanged recipe.
BUILD_FORMAT = 2


@dataclass(frozen=True, kw_only=True)
class TextSpec:
    """The language model's shapes."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    # M-RoPE split of head_dim / 2 rotary frequencies into (temporal, height, width).
    mrope_section: tuple[int, int, int]

    def __post_init__(self) -> None:
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim / 2")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")


@dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """The vision tower's shapes; the fields after ``temporal_patch_size`` are per architecture."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    # Qwen2.5-VL: window attention everywhere except these blocks.
    fullatt_block_indexes: tuple[int, ...] = ()
    window_size: int = 0
    # Qwen3-VL: blocks whose outputs are added to the first decoder layers, and the size of the
    # learned position-embedding grid (a square number).
    deepstack_visual_indexes: tuple[int, ...] = ()
    num_position_embeddings: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("vision hidden_size must be a multiple of num_heads")
        for index in self.fullatt_block_indexes + self.deepstack_visual_indexes:
            if not 0 <= index < self.depth:
                raise ValueError(f"vision block index {index} outside depth {self.depth}")


@dataclass(frozen=True, kw_only=True)
class ModelRecipe:
    """Everything a build needs to know about one bundled model."""

    arch: str
    size: str
    text: TextSpec
    vision: VisionSpec
    # float32 for the tiny models, so transformers and SGLang agree to ~1e-5 and tests can compare
    # logits exactly; bfloat16 for bench models, as real deployments serve them.
    dtype: str
    seed: int = 0
    # Image resize bounds in pixels, in units of (patch_size * merge_size) ** 2.
    min_image_tokens: int = 4
    max_image_tokens: int = 1024
    tie_word_embeddings: bool = True
    # Trained weights committed in bundled/reader/weights/<trained>/ replace the random ones; their checksum is
    # part of the digest, so retrained weights land in a new directory.
    trained: str = ""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {ARCHS}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")

    @property
    def pixels_per_token(self) -> int:
        side = self.vision.patch_size * self.vision.spatial_merge_size
        return side * side

    @property
    def min_pixels(self) -> int:
        return self.min_image_tokens * self.pixels_per_token

    @property
    def max_pixels(self) -> int:
        return self.max_image_tokens * self.pixels_per_token

    @property
    def name(self) -> str:
        return f"{self.arch}-{self.size}"

    def digest(self) -> str:
        """A short hash of the recipe and of the library versions that shape the files."""
        recipe = dataclasses.asdict(self)
        if not self.trained:
            del recipe["trained"]  # recipes from before the field keep their digests (and cached builds)
        payload = {
            "recipe": recipe,
            "build_format": BUILD_FORMAT,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "torch": torch.__version__.split("+")[0],  # the random streams; not the CUDA suffix
        }
        if self.trained:
            from bundled.reader.artifacts import trained_sha256

            payload["trained_sha256"] = trained_sha256(self.trained)
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @property
    def directory_name(self) -> str:
        return f"{self.name}-{self.digest()}"


_TINY_TEXT = TextSpec(
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=384,
    rope_theta=1_000_000.0,
    mrope_section=(4, 6, 6),
)
_BENCH_TEXT = TextSpec(
    hidden_size=1024,
    num_layers=12,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    intermediate_size=4096,
    rope_theta=1_000_000.0,
    mrope_section=(16, 24, 24),
)

# The reader: as small as reading needs. A low rope_theta gives tiny heads position resolution.
_READER_TEXT = TextSpec(
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=384,
    rope_theta=10_000.0,
    mrope_section=(4, 6, 6),
)

# The oracle: the reader's widths, twice its depth (a 3-layer warmup is a minority of 8 layers).
_ORACLE_TEXT = dataclasses.replace(_READER_TEXT, num_layers=8)
# The deep reader: the oracle's widths at 16 layers (grown from the oracle's 8: bundled.reader.train --grow-from).
_DEEP_READER_TEXT = dataclasses.replace(_READER_TEXT, num_layers=16)
_READER_VISION = VisionSpec(
    depth=4,
    hidden_size=96,
    num_heads=3,
    intermediate_size=256,
    patch_size=14,
    fullatt_block_indexes=(1, 3),
    window_size=112,
)

# Qwen2.5-VL-7B's decoder (hidden 3584 = 28 x 128, 4 KV heads, MLP 18944, 28 layers) at head_dim 16: the same
# layer count and head layout, an eighth of the width, the MLP the same multiple (5.29x) of it.
_DEEP_TEXT = TextSpec(
    hidden_size=448,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=16,
    intermediate_size=2368,
    rope_theta=1_000_000.0,
    mrope_section=(2, 3, 3),  # the 7B's (16, 24, 24) at an eighth
)
# The vision tower of every Qwen2.5-VL release (3B to 72B): 32 blocks of width 1280.
_QWEN2_5_VL_VISION = VisionSpec(
    depth=32,
    hidden_size=1280,
    num_heads=16,
    intermediate_size=3420,
    patch_size=14,
    fullatt_block_indexes=(7, 15, 23, 31),
    window_size=112,
)
# That tower at the width that keeps a real 7B's ratio of decoder to vision work per image token (about 2.6 : 1 in
# multiply-adds: 4 patches of a ~0.67B tower per token of a ~7B decoder); its MLP the same multiple (2.67x) of it.
_DEEP_VISION = dataclasses.replace(_QWEN2_5_VL_VISION, hidden_size=160, num_heads=5, intermediate_size=432)

RECIPES: dict[tuple[str, str], ModelRecipe] = {
    (QWEN2_5_VL, TINY): ModelRecipe(
        arch=QWEN2_5_VL,
        size=TINY,
        dtype="float32",
        text=_TINY_TEXT,
        vision=VisionSpec(
            depth=4,
            hidden_size=64,
            num_heads=2,
            intermediate_size=128,
            patch_size=14,
            fullatt_block_indexes=(1, 3),
            window_size=112,
        ),
    ),
    (QWEN2_5_VL, BENCH): ModelRecipe(
        arch=QWEN2_5_VL,
        size=BENCH,
        dtype="bfloat16",
        # Up to 1344x1344 (2,304 tokens): long prefills for the reuse bench; 4,096 tokens made SGLang's CPU vision
        # attention need more than 21 GB.
        max_image_tokens=2304,
        text=_BENCH_TEXT,
        vision=_QWEN2_5_VL_VISION,
    ),
    (QWEN2_5_VL, DEEP): ModelRecipe(
        arch=QWEN2_5_VL,
        size=DEEP,
        dtype="bfloat16",
        max_image_tokens=2304,
        text=_DEEP_TEXT,
        vision=_DEEP_VISION,
    ),
    (QWEN2_5_VL, READER): ModelRecipe(
        arch=QWEN2_5_VL,
        size=READER,
        dtype="float32",
        max_image_tokens=64,
        trained="qwen2_5_vl-reader",
        text=_READER_TEXT,
        vision=_READER_VISION,
    ),
    (QWEN2_5_VL, ORACLE): ModelRecipe(
        arch=QWEN2_5_VL,
        size=ORACLE,
        dtype="float32",
        # Two panels of up to 64 tokens each in one request.
        max_image_tokens=64,
        trained="qwen2_5_vl-oracle",
        text=_ORACLE_TEXT,
        vision=_READER_VISION,
    ),
    (QWEN2_5_VL, DEEP_READER): ModelRecipe(
        arch=QWEN2_5_VL,
        size=DEEP_READER,
        dtype="float32",
        max_image_tokens=64,
        trained="qwen2_5_vl-deep-reader",
        text=_DEEP_READER_TEXT,
        vision=_READER_VISION,
    ),
    (QWEN3_VL, TINY): ModelRecipe(
        arch=QWEN3_VL,
        size=TINY,
        dtype="float32",
        text=_TINY_TEXT,
        vision=VisionSpec(
            depth=4,
            hidden_size=64,
            num_heads=2,
            intermediate_size=128,
            patch_size=16,
            deepstack_visual_indexes=(1, 2, 3),
            num_position_embeddings=576,
        ),
    ),
    # The vision tower of Qwen3-VL-2B/4B: 24 blocks of width 1024, deepstack at 5, 11, 17.
    (QWEN3_VL, BENCH): ModelRecipe(
        arch=QWEN3_VL,
        size=BENCH,
        dtype="bfloat16",
        # Up to 1344x1344 (2,304 tokens): long prefills for the reuse bench; 4,096 tokens made SGLang's CPU vision
        # attention need more than 21 GB.
        max_image_tokens=2304,
        text=dataclasses.replace(
            _BENCH_TEXT,
            num_kv_heads=4,
            intermediate_size=3072,
            rope_theta=5_000_000.0,
            mrope_section=(24, 20, 20),
        ),
        vision=VisionSpec(
            depth=24,
            hidden_size=1024,
            num_heads=16,
            intermediate_size=4096,
            patch_size=16,
            deepstack_visual_indexes=(5, 11, 17),
            num_position_embeddings=2304,
        ),
    ),
}


def get_recipe(arch: str, size: str) -> ModelRecipe:
    """The recipe for ``arch`` and ``size``; ValueError names the valid choices."""
    try:
        return RECIPES[(arch, size)]
    except KeyError:
        raise ValueError(
            f"no bundled model {arch!r} of size {size!r}; archs: {ARCHS}, sizes: {SIZES}"
        ) from None
