"""The reader's committed training output: weights (bfloat16 safetensors), config, log and checksums.

``bundled/reader/trained/<name>/`` holds what ``python -m bundled.reader.train`` exported:

    model.safetensors   the trained weights, checkpoint names as SGLang loads them, stored as bfloat16
    config.json         the model's config, as the build writes it (a test keeps the two equal)
    SHA256SUMS          sha256 of every other file in the directory
    training-log.jsonl  one line per logged step: loss, accuracy, held-out accuracy, elapsed time
    training.json       the command, seed, steps and final held-out accuracy

The bundled-model build (``build_model("qwen2_5_vl", "reader")``) verifies the checksum and writes these weights,
cast to the recipe's dtype, next to the generated tokenizer, processor and config.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from bundled.errors import BuildError

TRAINED_ROOT = Path(__file__).parent / "trained"
WEIGHTS = "model.safetensors"
SUMS = "SHA256SUMS"
LOG = "training-log.jsonl"
SUMMARY = "training.json"
CONFIG = "config.json"


def trained_dir(name: str) -> Path:
    return TRAINED_ROOT / name


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_sums(directory: Path) -> dict[str, str]:
    sums = {}
    for line in (directory / SUMS).read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.lstrip("*")] = digest
    return sums


def write_sums(directory: Path) -> None:
    lines = [f"{file_sha256(path)}  {path.name}" for path in sorted(directory.iterdir())
             if path.is_file() and path.name != SUMS]
    (directory / SUMS).write_text("\n".join(lines) + "\n")


def trained_sha256(name: str) -> str:
    """The recorded checksum of the committed weights ``name``; BuildError if they are not there."""
    directory = trained_dir(name)
    if not (directory / SUMS).is_file():
        raise BuildError(f"no trained weights {name!r} in {TRAINED_ROOT}; train them with "
                         f"`python -m bundled.reader.train`")
    sums = read_sums(directory)
    if WEIGHTS not in sums:
        raise BuildError(f"{directory / SUMS} lists no {WEIGHTS}")
    return sums[WEIGHTS]


def load_trained(name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The committed weights, checked against their recorded checksum, cast to ``dtype``."""
    path = trained_dir(name) / WEIGHTS
    expected = trained_sha256(name)
    if not path.is_file() or file_sha256(path) != expected:
        raise BuildError(f"{path} is missing or does not match its checksum in {SUMS}")
    return {key: value.to(dtype).contiguous() for key, value in load_file(str(path)).items()}
