"""Deterministic random weights for a bundled model, written as safetensors.

Every tensor is drawn from its own generator, seeded from the recipe seed and the tensor's name,
so the values do not depend on module construction order or on transformers' init code. Scales
are chosen so that the untrained model is still a useful test subject: every linear layer keeps
activations at unit scale (std 1/sqrt(fan_in)), attention therefore mixes tokens visibly, the
image changes the output, and tied embeddings give logits with a standard deviation of about 3,
so greedy decoding has clear margins instead of near-ties. Norm weights and biases are random
too, so code that mishandles them changes the output instead of hiding behind ones and zeros.

Embedding rows of "quiet" tokens (special tokens, byte pieces that are not printable ASCII, and
the padding rows past the tokenizer's vocabulary) are scaled down, so greedy decoding produces
printable text that never ends early by chance: a completion runs until ``max_tokens`` or a stop
string, which makes engine behaviour easy to predict in tests.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

from bundled.recipes import QWEN2_5_VL, QWEN3_VL, ModelRecipe

WEIGHTS_FILE = "model.safetensors"
LOGIT_STD = 3.0
NORM_WEIGHT_STD = 0.1
BIAS_STD = 0.02
QUIET_ROW_SCALE = 0.1

_MODEL_CLASS = {
    QWEN2_5_VL: Qwen2_5_VLForConditionalGeneration,
    QWEN3_VL: Qwen3VLForConditionalGeneration,
}
# Checkpoint names as the released checkpoints spell them (SGLang skips names it does not know
# without an error, so these must match its loaders exactly). transformers' in-memory names on
# the left; Qwen2.5-VL checkpoints predate the language_model/visual split.
_CHECKPOINT_PREFIXES = {
    QWEN2_5_VL: (("model.language_model.", "model."), ("model.visual.", "visual.")),
    QWEN3_VL: (),
}


def checkpoint_name(arch: str, name: str) -> str:
    for old, new in _CHECKPOINT_PREFIXES[arch]:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def parameter_shapes(recipe: ModelRecipe, config: PretrainedConfig) -> dict[str, torch.Size]:
    """transformers' parameter names and shapes, without allocating the weights."""
    with torch.device("meta"):
        model = _MODEL_CLASS[recipe.arch](config)
    # remove_duplicate drops the tied lm_head, which shares the embedding's storage.
    return {name: param.shape for name, param in model.named_parameters()}


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _std(name: str, shape: torch.Size) -> tuple[float, float]:
    """(mean, std) of the tensor called ``name``."""
    if name.endswith(".bias"):
        return 0.0, BIAS_STD
    if len(shape) == 1:  # RMSNorm / LayerNorm weights
        return 1.0, NORM_WEIGHT_STD
    if name.endswith("embed_tokens.weight"):
        # Tied with lm_head: logits = rmsnorm(h) @ E.T has std LOGIT_STD * |norm weight|.
        return 0.0, LOGIT_STD / math.sqrt(shape[1])
    if name.endswith("pos_embed.weight"):
        return 0.0, 1.0 / math.sqrt(shape[1])
    return 0.0, 1.0 / math.sqrt(math.prod(shape[1:]))


def init_tensor(
    seed: int,
    name: str,
    shape: torch.Size,
    dtype: torch.dtype,
    quiet_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    mean, std = _std(name, shape)
    values = torch.randn(shape, generator=_generator(seed, name), dtype=torch.float32)
    values = values * std + mean
    if name.endswith("embed_tokens.weight") and quiet_token_ids:
        values[torch.tensor(quiet_token_ids)] *= QUIET_ROW_SCALE  # (vocab, hidden)
    return values.to(dtype).contiguous()


def write_weights(
    recipe: ModelRecipe,
    config: PretrainedConfig,
    directory: Path,
    quiet_token_ids: Sequence[int] = (),
    on_progress: Callable[[str], None] = lambda _: None,
) -> int:
    """Write ``model.safetensors`` into ``directory``; returns the number of parameters."""
    dtype = getattr(torch, recipe.dtype)
    shapes = parameter_shapes(recipe, config)
    if recipe.trained:
        return _write_trained(recipe, shapes, dtype, directory, on_progress)
    tensors: dict[str, torch.Tensor] = {}
    total = sum(math.prod(shape) for shape in shapes.values())
    on_progress(f"initialising {total / 1e6:.1f}M parameters ({len(shapes)} tensors)")
    for name in sorted(shapes):
        tensors[checkpoint_name(recipe.arch, name)] = init_tensor(
            recipe.seed, name, shapes[name], dtype, quiet_token_ids
        )
    on_progress(f"writing {WEIGHTS_FILE}")
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return total


def _write_trained(recipe: ModelRecipe, shapes: dict[str, torch.Size], dtype: torch.dtype, directory: Path,
                   on_progress: Callable[[str], None]) -> int:
    """The committed trained weights instead of random ones, after checking that they fit the recipe."""
    from bundled.errors import BuildError
    from bundled.reader.artifacts import load_trained

    on_progress(f"loading the trained weights {recipe.trained}")
    tensors = load_trained(recipe.trained, dtype)
    expected = {checkpoint_name(recipe.arch, name): shape for name, shape in shapes.items()}
    found = {name: tensor.shape for name, tensor in tensors.items()}
    if found != expected:
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        raise BuildError(f"trained weights {recipe.trained!r} do not fit recipe {recipe.name}: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}, or shapes differ")
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return sum(math.prod(shape) for shape in expected.values())
