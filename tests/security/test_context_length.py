"""A prompt no worker could take is refused by the gateway (OpenAI's 400 ``context_length_exceeded``) before it
fetches or decodes an image and before a worker tokenizes it (gateway/prompt_size.py).

Before: 50 MB of text went to a worker, whose tokenizer spent seconds of the CPU every tenant of that worker shares
only to find it was past the context, and 16 images after it were fetched, decoded and keyed first. The refusal was
the worker's (no OpenAI code), after all of that.
"""

from __future__ import annotations

import json
import tracemalloc
from functools import partial
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from gateway.config import ProcessorSettings
from gateway.errors import InvalidRequest
from gateway.images import smart_resize
from gateway.prompt_size import (
    NOT_PROMPT_ALLOWANCE,
    PromptSize,
    body_chars_at_least,
    message_chars,
    prompt_tokens_at_least,
)
from gateway.protocol import parse_body
from plan.checkpoint import longest_token_chars
from tests.conftest import MODEL_ID
from tests.images_lib import data_url, encode, noise_image


def context_of(gateway) -> int:
    card = httpx.get(gateway.url + "/v1/models", timeout=30).json()["data"][0]
    return int(card["max_model_len"])


def chat(gateway, content, **fields) -> httpx.Response:
    body = {"model": MODEL_ID, "max_tokens": 1, "messages": [{"role": "user", "content": content}], **fields}
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=300)


def refused_by_the_gateway(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert error["param"] == param and "context length" in error["message"], error


# --- the bound ---

def test_no_token_of_the_bundled_vocabulary_stands_for_more_characters_than_the_bound(model_path: Path):
    longest = longest_token_chars(model_path)
    tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    decoded = [len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.get_vocab_size(True))]
    assert longest is not None and max(decoded) <= longest
    assert max(decoded) >= longest // 2  # and it is not so loose that it refuses nothing


def test_a_text_is_at_least_as_many_tokens_as_the_bound_says(model_path: Path):
    tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    size = PromptSize(longest_token_chars(model_path), context=lambda: None)
    for text in ("lorem ipsum " * 500, "x" * 5000, "<|vision_start|>" * 100, "€uro " * 300, "a"):
        assert size.text_tokens(len(text)) <= len(tokenizer.encode(text).ids)


def test_the_bound_counts_text_parts_token_ids_and_the_longest_of_a_batch():
    size = PromptSize(10, context=lambda: 100)
    messages = [{"role": "system", "content": "x" * 25},
                {"role": "user", "content": [{"type": "text", "text": "y" * 30},
                                             {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    assert message_chars(messages) == 55 and size.text_tokens(55) == 6
    assert prompt_tokens_at_least(list(range(40)), size) == 40
    assert prompt_tokens_at_least(["x" * 10, "y" * 995], size) == 100
    assert prompt_tokens_at_least([[1, 2], list(range(7))], size) == 7
    size.check(99, param="prompt")
    with pytest.raises(Exception, match="context length is 100 tokens"):
        size.check(100, param="prompt")
    PromptSize(None, context=lambda: 100).check(PromptSize(None, context=lambda: 100).text_tokens(10**9), param="x")
    PromptSize(10, context=lambda: None).check(10**9, param="x")  # no worker has told its context: nothing refused


def test_a_tokenizer_file_the_gateway_cannot_read_gives_no_bound(tmp_path: Path):
    assert longest_token_chars(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert longest_token_chars(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": [["▁hello", -1.0],
                                                                                                 ["x", -2.0]]},
                                                         "added_tokens": [{"content": "<|a-long-one|>"}]}))
    assert longest_token_chars(tmp_path) == len("<|a-long-one|>")


def _body(*parts: dict | str) -> bytes:
    content = list(parts) if len(parts) > 1 or not isinstance(parts[0], str) else parts[0]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


BASE64 = "data:image/png;base64," + "iVBORw0KGgo+/=" * 20_000  # 280 KB of an image's payload


@pytest.mark.parametrize("text", ["lorem ipsum " * 5000, "€uro \u2028 " * 3000, 'quoted "json": {"a": [1, 2]}\n' * 2000,
                                  "🙂" * 4000, "\\" * 3000])
def test_the_bound_from_raw_bytes_never_counts_more_text_than_the_body_holds(text):
    """Whatever the text's spelling in JSON (escapes, UTF-8 of 2 to 4 bytes, quotes), with or without images."""
    for raw in (_body(text), _body(_text(text), _image(BASE64)), json.dumps({"prompt": text}).encode(),
                json.dumps({"messages": [{"role": "user", "content": text}]}, ensure_ascii=False).encode()):
        keys_and_names = 100  # "model", "messages", "role", "user", ...: counted as text, and allowed for by callers
        assert body_chars_at_least(raw) <= len(text) + keys_and_names


def test_the_bound_from_raw_bytes_leaves_out_media_and_counts_text_that_looks_like_media():
    assert body_chars_at_least(_body(_text("hi"), *[_image(BASE64)] * 20)) < 1000  # 5.6 MB of images: keys only
    plain = body_chars_at_least(_body("lorem ipsum " * 10_000))
    assert plain >= 0.8 * 120_000  # not so loose that it refuses nothing (its spaces, 1 in 6, are not counted)
    # A text that begins like a data: URL, or spells out an image part inside it (its quotes escaped), is text.
    assert body_chars_at_least(_body(_text(BASE64))) >= 0.9 * len(BASE64)
    spelt = '{"url": "' + BASE64 + '"}'
    assert body_chars_at_least(_body(_text(spelt))) >= 0.9 * len(BASE64)
    assert body_chars_at_least(json.dumps({"text": "x", "url": BASE64[:22] + "a\\b" * 50_000}).encode()) >= 100_000


def _parse_unless_too_long(raw: bytearray, size: PromptSize):
    """As intake parses a body: refused from its bytes when they say its prompt is too long."""
    return parse_body(raw, partial(size.check_body, param="messages"))


def test_a_body_whose_text_cannot_fit_is_refused_before_it_is_parsed():
    """Refused from its bytes, holding nothing like the second copy a parse would make of its 24 MB text."""
    size = PromptSize(20, context=lambda: 32_768)
    images = [_image("data:image/png;base64,bm90") for _ in range(16)]
    raw = bytearray(_body(_text("lorem ipsum " * 2_000_000), *images))
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest) as refused:
            _parse_unless_too_long(raw, size)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
    assert peak < len(raw) // 10, peak
    # One that could fit is parsed as before; so is any body no larger than the allowance and the context's text.
    body, _ = _parse_unless_too_long(bytearray(_body("lorem ipsum " * 10_000)), size)
    assert body["messages"][0]["content"].startswith("lorem")
    near = "z" * (NOT_PROMPT_ALLOWANCE + 32_768 * 20 - 200)
    assert _parse_unless_too_long(bytearray(_body(near)), size)[0]["messages"][0]["content"] == near
    # The JSON's own counts come first: 16 MB of ["ab",...] is too many values (413), whatever its letters say.
    values = json.dumps({"model": "m", "messages": [], "stop_token_ids": ["ab"] * 3_000_000}).encode()
    with pytest.raises(Exception) as counted:
        _parse_unless_too_long(bytearray(values), size)
    assert getattr(counted.value, "code", None) == "too_many_json_values"


# --- through a real gateway and a real SGLang worker ---

def test_text_past_the_context_is_refused_before_its_images_are_read(gateway):
    context = context_of(gateway)
    text = "lorem ipsum " * (context * 20 // 12 + 10)  # 20 characters per token at most: past the context
    images = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,not-an-image"}} for _ in range(16)]
    response = chat(gateway, [{"type": "text", "text": text}, *images])
    # The images are not even read: they would have been a 422 (not an image) otherwise.
    refused_by_the_gateway(response, "messages")


def test_images_that_take_a_prompt_past_the_context_are_refused(gateway, model_path: Path):
    context = context_of(gateway)
    height, width = smart_resize(1400, 1400, ProcessorSettings.from_model_dir(model_path))
    image_tokens = height * width // ProcessorSettings.from_model_dir(model_path).factor ** 2
    free = context - 8 * image_tokens  # 8 images leave this many tokens for text
    text = "z" * ((free + 10) * longest_token_chars(model_path))
    image = {"type": "image_url", "image_url": {"url": data_url(encode(noise_image(1400, 1400)))}}
    refused_by_the_gateway(chat(gateway, [{"type": "text", "text": text}, *[image] * 8]), "messages")
    # The same images with a short text fit, and are answered by the worker.
    answered = chat(gateway, [{"type": "text", "text": "what is this?"}, *[image] * 8])
    assert answered.status_code == 200, answered.text


def test_a_long_prompt_that_fits_is_still_answered(gateway):
    text = "the quick brown fox jumps over the lazy dog. " * 400  # ~18k characters, far under the context in tokens
    response = chat(gateway, text)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 1000


@pytest.mark.parametrize("prompt", ["text", "ids"])
def test_a_completion_prompt_past_the_context_is_refused(gateway, prompt):
    context = context_of(gateway)
    value = "lorem ipsum " * (context * 20 // 12 + 10) if prompt == "text" else [11] * context
    response = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL_ID, "prompt": value, "max_tokens": 1},
                          timeout=300)
    refused_by_the_gateway(response, "prompt")
    fits = httpx.post(gateway.url + "/v1/completions",
                      json={"model": MODEL_ID, "prompt": [11] * 100, "max_tokens": 1}, timeout=300)
    assert fits.status_code == 200, fits.text
