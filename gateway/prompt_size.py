"""A prompt's size in tokens, bounded from below without tokenizing it, so that a prompt no worker could take is
refused before the gateway fetches, decodes or forwards anything (OpenAI's 400 ``context_length_exceeded``).

SGLang refuses a prompt of at least its context length in tokens, but only after tokenizing it: for 50 MB of text
that is seconds of the worker's CPU, which every tenant of that worker waits for. The gateway knows enough to
refuse it first:
- text: a token stands for at most ``max_token_chars`` characters (plan.checkpoint.longest_token_chars, the longest
  entry of the model's vocabulary), so C characters of text are at least ceil(C / max_token_chars) tokens;
- images: exactly their token grids (the processor's resize, gateway/images.py), known once their headers are read;
- token-id prompts (/v1/completions): their length.
The chat template's own tokens, tools and videos are not counted, so the bound only errs low: whatever it refuses,
the worker would have refused too (the context is the workers' own ``max_model_len``, from their model cards).

A body is checked once before it is parsed too (:meth:`PromptSize.check_body`), from its raw bytes: parsing holds a
large text twice (its bytes, then the string it parses to), so a 50 MB text, which no context holds, is refused
holding it once. What the bytes bound from below is the characters in the body's strings, less everything that
need not be prompt: its images' and videos' data: URLs, its whitespace and JSON punctuation, and
``NOT_PROMPT_ALLOWANCE`` bytes for the keys, numbers, http(s) URLs, grammars and the like a request may hold.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest


class ContextLengthExceeded(InvalidRequest):
    def __init__(self, at_least: int, context: int, param: str) -> None:
        super().__init__(f"this model's context length is {context} tokens, and this prompt is at least {at_least} "
                         "tokens; shorten it (its text, or its images' sizes)", param=param,
                         code="context_length_exceeded")


@dataclass(frozen=True, slots=True)
class PromptSize:
    """``max_token_chars``: the most characters one token stands for (None: no tokenizer known, text is not
    counted); ``context``: the workers' context length in tokens, when one has told it (None: nothing is refused)."""

    max_token_chars: int | None
    context: Callable[[], int | None]

    def text_tokens(self, chars: int) -> int:
        """The fewest tokens ``chars`` characters of text can be."""
        if not self.max_token_chars or chars <= 0:
            return 0
        return -(-chars // self.max_token_chars)

    def check_body(self, raw: bytes | bytearray, *, param: str) -> None:
        """Raise ContextLengthExceeded when a request body's raw bytes alone say its prompt cannot fit the context
        (before it is parsed: see the module's docstring). Cheap for any body that could fit: one comparison."""
        context = self.context()
        if not self.max_token_chars or context is None:
            return
        if len(raw) <= NOT_PROMPT_ALLOWANCE + context * self.max_token_chars:
            return  # however it is spelt, its text is too short to fill the context
        enough = NOT_PROMPT_ALLOWANCE + context * self.max_token_chars  # past it, the text alone is too long
        self.check(self.text_tokens(body_chars_at_least(raw, enough) - NOT_PROMPT_ALLOWANCE), param=param)

    def check(self, at_least: int, *, param: str) -> None:
        """Raise ContextLengthExceeded when a prompt of at least ``at_least`` tokens cannot fit the context."""
        context = self.context()
        if context is not None and at_least >= context:
            raise ContextLengthExceeded(at_least, context, param)


def message_chars(messages: Iterable[Any]) -> int:
    """The characters of text in chat messages: string contents and text parts (validated messages)."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str))
    return total


def prompt_tokens_at_least(prompt: Any, size: PromptSize) -> int:
    """A /v1/completions prompt's fewest tokens: the longest of a batch (each is one request to the worker)."""
    if isinstance(prompt, str):
        return size.text_tokens(len(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(item, int) for item in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        return max((prompt_tokens_at_least(item, size) for item in prompt), default=0)
    return 0


# What a request body may hold beside its prompt's text and its media's data: URLs: its keys, numbers and literals,
# http(s) URLs, grammars (16 KB each at most), logit_bias and stop_token_ids (2**18 values at most, ~3 MB), ...
NOT_PROMPT_ALLOWANCE = 4 << 20
_JSON_SYNTAX = tuple(bytes([c]) for c in b' \t\n\r{}[]:,"')  # whitespace and punctuation: the JSON's own, or text's
_URL_KEY = re.compile(rb'"url"\s*:\s*$')  # what precedes a data: URL that is an image's or video's url
_SLICE = 1 << 20  # bytes counted per call: no C call on a large body holds the GIL for long


def body_chars_at_least(raw: bytes | bytearray, enough: int | None = None) -> int:
    """The fewest characters of text the strings of a JSON body can hold, from its raw bytes, without parsing it:
    its bytes less the data: URLs that are ``url`` values (base64, no escapes: an image's or video's), its whitespace
    and punctuation (in strings too: it errs low), and what escapes spell beyond the characters they stand for (a
    ``\\uXXXX`` none of its 6 bytes, as two of them spell one character past U+FFFF; any other one 1 byte per
    backslash); a character is one byte of ASCII, up to 4 of other UTF-8. Keys, numbers and literals count as text
    (the caller allows for them). Counted in slices, from the start: once ``enough`` is reached, the count so far."""
    per_char = 1 if raw.isascii() else 4
    total, at = 0, 0
    for media_start, media_end in [*_data_urls(raw), (len(raw), len(raw))]:
        for start in range(at, media_start, _SLICE):
            end = min(media_start, start + _SLICE)
            other = sum(raw.count(byte, start, end) for byte in _JSON_SYNTAX)
            other += raw.count(b"\\", start, end) + 5 * raw.count(b"\\u", start, end)
            other += 5  # a \\u cut in two by the slice's end
            total += max(0, end - start - other) // per_char
            if enough is not None and total >= enough:
                return total
        at = media_end
    return total


def _data_urls(raw: bytes | bytearray) -> list[tuple[int, int]]:
    """Where the strings are that are a ``"url"``'s value, begin with ``data:`` and hold no escape (media payloads):
    (start, end) of each, its quotes included, in order. A string in text can spell ``"url": "data:`` only with its
    quotes escaped, so it is not taken for one."""
    found, at = [], 0
    for _ in range(1 << 18):  # more than any body's images and videos; past it the rest counts as text
        start = raw.find(b'"data:', at)
        if start < 0:
            break
        end = raw.find(b'"', start + 1)
        if end < 0:
            break
        at = end + 1
        if _URL_KEY.search(raw, max(0, start - 64), start) and _unescaped(raw, start) \
                and raw.find(b"\\", start, end) < 0:
            found.append((start, end + 1))
    return found


def _unescaped(raw: bytes | bytearray, quote: int) -> bool:
    """Whether the ``"`` at ``quote`` is the JSON's own (an even run of backslashes before it), not a string's."""
    run = 0
    while quote - run - 1 >= 0 and raw[quote - run - 1] == 0x5C:
        run += 1
    return run % 2 == 0
