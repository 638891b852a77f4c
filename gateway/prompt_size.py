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
"""

from __future__ import annotations

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
