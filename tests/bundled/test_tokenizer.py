"""The bundled tokenizer: deterministic, Qwen special tokens, same splits in transformers."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from bundled.tokenizer import (
    EXTRA_TOKENS,
    IMAGE_PAD,
    SPECIAL_TOKENS,
    VISION_END,
    VISION_START,
    quiet_token_ids,
    save_tokenizer,
    train_tokenizer,
)


def test_training_is_deterministic(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    save_tokenizer(train_tokenizer(), first)
    save_tokenizer(train_tokenizer(), second)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_special_tokens_follow_the_learned_vocabulary_in_qwen_order(tmp_path: Path) -> None:
    tokenizer = train_tokenizer()
    ids = save_tokenizer(tokenizer, tmp_path)
    added = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + EXTRA_TOKENS]
    assert added == list(range(added[0], added[0] + len(added)))
    assert added[-1] == ids.vocab_size - 1
    assert (ids.vision_start, ids.vision_end, ids.vision_pad, ids.image_pad, ids.video_pad) == tuple(
        range(ids.vision_start, ids.vision_start + 5)
    )


def test_transformers_tokenizer_matches_the_trained_one(tmp_path: Path) -> None:
    trained = train_tokenizer()
    save_tokenizer(trained, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    text = f"Describe the red astronaut in 3 words.\n{VISION_START}{IMAGE_PAD}{VISION_END} café 12345"
    assert loaded.encode(text) == trained.encode(text).ids
    assert loaded.decode(loaded.encode(text)) == text
    # Special tokens are single tokens and are stripped when asked to.
    assert loaded.encode(IMAGE_PAD) == [trained.token_to_id(IMAGE_PAD)]
    assert loaded.decode(loaded.encode(f"hi{IMAGE_PAD}"), skip_special_tokens=True) == "hi"
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"


def test_chat_template_places_vision_tokens_for_image_parts(tmp_path: Path) -> None:
    save_tokenizer(train_tokenizer(), tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:,"}},
                {"type": "text", "text": "What is this?"},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": None},
    ]
    rendered = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?"
        "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_quiet_tokens_cover_special_unprintable_and_padding_rows() -> None:
    tokenizer = train_tokenizer()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    quiet = set(quiet_token_ids(tokenizer, size + 10))
    assert tokenizer.token_to_id(IMAGE_PAD) in quiet
    assert set(range(size, size + 10)) <= quiet
    assert tokenizer.token_to_id("Ġpicture") not in quiet
    assert all(tokenizer.decode([i]).isascii() for i in range(size) if i not in quiet)
