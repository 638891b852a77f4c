"""The bundled byte-level BPE tokenizer with the Qwen special tokens.

It is trained on :mod:`bundled.corpus` with the same normaliser, pre-tokeniser and
decoder that transformers' ``Qwen2Tokenizer`` builds, so transformers and SGLang split text the
same way whether they read ``tokenizer.json`` directly or rebuild the pipeline from its vocabulary.
The special tokens come after the learned vocabulary, in Qwen's order.
"""

from __future__ import annotations

import json
import string
from importlib import resources
from pathlib import Path
from typing import NamedTuple

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from bundled.corpus import corpus_lines

# Upper bound of the learned vocabulary (256 byte symbols plus merges). The corpus's small word
# list runs out of merges first: the learned part ends up with 2,031 tokens, 2,057 in total.
LEARNED_VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 32768

# Qwen's pre-tokenisation pattern: contractions, letter runs, single digits, punctuation runs,
# newlines and other whitespace.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_PAD = "<|vision_pad|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"

SPECIAL_TOKENS = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    VISION_START,
    VISION_END,
    VISION_PAD,
    IMAGE_PAD,
    VIDEO_PAD,
)
# Tokens Qwen models know but that are ordinary (not stripped when decoding).
EXTRA_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)


class SpecialTokenIds(NamedTuple):
    """Ids of the tokens that model configs refer to."""

    endoftext: int
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    vision_pad: int
    image_pad: int
    video_pad: int
    vocab_size: int  # total, learned plus added tokens


def chat_template() -> str:
    """The Qwen-style chat template shipped with every bundled model."""
    return resources.files("bundled").joinpath("chat_template.jinja").read_text()


def train_tokenizer() -> Tokenizer:
    """Train the tokenizer from the deterministic corpus; the same code gives the same merges."""
    tokenizer = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix=""))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=LEARNED_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.add_tokens(list(EXTRA_TOKENS))
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> SpecialTokenIds:
    def token_id(token: str) -> int:
        value = tokenizer.token_to_id(token)
        assert value is not None, token
        return value

    return SpecialTokenIds(
        endoftext=token_id(ENDOFTEXT),
        im_start=token_id(IM_START),
        im_end=token_id(IM_END),
        vision_start=token_id(VISION_START),
        vision_end=token_id(VISION_END),
        vision_pad=token_id(VISION_PAD),
        image_pad=token_id(IMAGE_PAD),
        video_pad=token_id(VIDEO_PAD),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
    )


_VISIBLE = frozenset(string.ascii_letters + string.digits + string.punctuation + " \n")


def quiet_token_ids(tokenizer: Tokenizer, embedding_rows: int) -> list[int]:
    """Ids a test model should rarely emit: added tokens, pieces that do not decode to printable
    ASCII (partial UTF-8 sequences, control bytes) and embedding rows past the vocabulary."""
    added = set(tokenizer.get_added_tokens_decoder())
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    quiet = [
        token_id
        for token_id in range(vocab_size)
        if token_id in added or not set(tokenizer.decode([token_id])) <= _VISIBLE
    ]
    return quiet + list(range(vocab_size, embedding_rows))


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": MODEL_MAX_LENGTH,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_prefix_space": False,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> SpecialTokenIds:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into ``directory``."""
    tokenizer.save(str(directory / "tokenizer.json"), pretty=True)
    (directory / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(), indent=2, sort_keys=True) + "\n"
    )
    (directory / "chat_template.jinja").write_text(chat_template())
    return special_token_ids(tokenizer)
