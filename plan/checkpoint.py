"""What a model folder (Hugging Face layout) says that the gateway and the worker launcher both need.

The gateway plans by the language model's layer count and the image processor's resize settings; the launcher
starts SGLang with the checkpoint's dtype and image size bound. Both read the same files through these functions.
Each returns None (or an empty mapping) when the folder does not say, and never raises for a missing file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Where the image processor's settings live, newest layout first: (file, section or None for the whole file).
PROCESSOR_SOURCES = (("processor_config.json", "image_processor"), ("preprocessor_config.json", None))


def model_config(model_dir: Path | str) -> dict[str, Any] | None:
    """The folder's config.json, or None when it is missing or unreadable."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def text_layers(model_dir: Path | str) -> int | None:
    """The language model's layer count (text_config for VL models, else the top level)."""
    return _text_int(model_dir, "num_hidden_layers")


def vocab_size(model_dir: Path | str) -> int | None:
    """The language model's vocabulary size, the rows of its token embedding (text_config, then the top level)."""
    return _text_int(model_dir, "vocab_size")


def _text_int(model_dir: Path | str, name: str) -> int | None:
    config = model_config(model_dir)
    if config is None:
        return None
    for section in (config.get("text_config") or {}, config):
        if isinstance(section, dict) and isinstance(section.get(name), int):
            return section[name]
    return None


def weights_dtype(model_dir: Path | str) -> str | None:
    """The weights' dtype as config.json declares it (top level, then text_config)."""
    config = model_config(model_dir)
    if config is None:
        return None
    for section in (config, config.get("text_config") or {}):
        value = section.get("dtype") or section.get("torch_dtype")
        if value:
            return str(value)
    return None


class UnreadableProcessorConfig(ValueError):
    """A processor config file exists but is not JSON."""


def image_processor_config(model_dir: Path | str) -> tuple[Path, dict[str, Any]] | None:
    """The image processor's settings and the file they came from; None when no file holds them.

    Raises UnreadableProcessorConfig for a file that exists but cannot be parsed: a model folder with broken
    processor settings must not be served with guessed ones.
    """
    for name, section in PROCESSOR_SOURCES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UnreadableProcessorConfig(f"cannot read processor settings from {path}: {exc}") from exc
        raw = loaded.get(section) if section and isinstance(loaded, dict) else loaded
        if isinstance(raw, dict):
            return path, raw
    return None


def image_max_pixels(model_dir: Path | str) -> int | None:
    """The largest image, in pixels, the processor keeps before resizing down (``max_pixels`` or
    ``size.longest_edge``)."""
    found = image_processor_config(model_dir)
    if found is None:
        return None
    raw = found[1]
    value = raw.get("max_pixels") or (raw.get("size") or {}).get("longest_edge")
    return int(value) if value else None


def longest_token_chars(model_dir: Path | str) -> int | None:
    """The most characters of text one token can stand for: the longest entry of the tokenizer's vocabulary
    (tokenizer.json: its model's vocab, BPE's mapping or Unigram's list, and its added tokens, which a text that
    spells one out is tokenized to). An entry of byte-level BPE has one character per byte it stands for, and a
    SentencePiece one one per character; markers ("##", "<0x41>") only make entries longer than the text they stand
    for, so this never undercounts. None without a readable tokenizer.json."""
    try:
        tokenizer = json.loads((Path(model_dir) / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        entries = vocab.keys() if isinstance(vocab, dict) else (entry[0] for entry in vocab)
        lengths = [len(str(entry)) for entry in entries]
        lengths += [len(str(added["content"])) for added in tokenizer.get("added_tokens") or ()]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    return max(lengths, default=0) or None
