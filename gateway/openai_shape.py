"""Bringing worker responses to the exact shape of OpenAI's published schema.

SGLang's answers are close to OpenAI's but not identical. It leaves out ``message.refusal`` (required, nullable),
sends ``null`` for usage detail objects that the schema types as objects, and adds fields of its own: a top-level
``usage.reasoning_tokens`` (OpenAI's place is ``usage.completion_tokens_details.reasoning_tokens``),
``usage.prompt_tokens_details.image_tokens``, ``choices[].matched_stop``, ``message.reasoning_content``,
``metadata`` and others. Clients that compare responses to OpenAI's schema fail on any of them.

So by default every response is cut to the fields OpenAI's schema names (the key sets below; the tests validate
against the published document with no extra property allowed), and reasoning tokens move to OpenAI's place.
With ``extras`` (``REVISIT_RESPONSE_EXTRAS=1``) SGLang's extra fields pass through, for clients written against
SGLang or vLLM that read them; only the mends a strict client needs are made then.

A :class:`Shape` says which endpoint's shape (``chat``: /v1/chat/completions, ``text``: /v1/completions) and
whether extras pass; it mends whole bodies and, through :class:`StreamShaper`, a stream's ``data:`` lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

CHAT, TEXT = "chat", "text"

# The properties OpenAI's schema gives each object (CreateChatCompletionResponse, CreateChatCompletionStreamResponse,
# CreateCompletionResponse and the objects inside them).
_TOP = {CHAT: frozenset({"id", "object", "created", "model", "choices", "usage", "system_fingerprint",
                         "service_tier"}),
        TEXT: frozenset({"id", "object", "created", "model", "choices", "usage", "system_fingerprint"})}
_CHOICE = {CHAT: frozenset({"index", "message", "delta", "finish_reason", "logprobs"}),
           TEXT: frozenset({"index", "text", "finish_reason", "logprobs"})}
_MESSAGE = frozenset({"role", "content", "refusal", "tool_calls", "annotations", "audio", "function_call"})
_USAGE = frozenset({"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details",
                    "completion_tokens_details"})
_USAGE_DETAILS = {"prompt_tokens_details": frozenset({"cached_tokens", "audio_tokens"}),
                  "completion_tokens_details": frozenset({"reasoning_tokens", "audio_tokens",
                                                          "accepted_prediction_tokens",
                                                          "rejected_prediction_tokens"})}


@dataclass(frozen=True, slots=True)
class Shape:
    endpoint: str = CHAT  # CHAT or TEXT
    extras: bool = False  # let the worker's fields beyond OpenAI's schema through

    def completion(self, body: dict[str, Any], public_id: str | None = None) -> dict[str, Any]:
        """Mend a non-streaming response in place and return it (with public_id as its id, when given)."""
        if public_id is not None:
            body["id"] = public_id
        self.mend(body)
        return body

    def stream(self, public_id: str | None = None, upstream_id: str | None = None) -> StreamShaper:
        return StreamShaper(self, public_id=public_id, upstream_id=upstream_id)

    def mend(self, body: dict[str, Any]) -> None:
        """Mend one response body or stream chunk in place."""
        if not self.extras:
            _keep(body, _TOP[self.endpoint])
        for choice in body.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if not self.extras:
                _keep(choice, _CHOICE[self.endpoint])
            message = choice.get("message")
            if isinstance(message, dict):
                message.setdefault("refusal", None)
            for part in ("message", "delta"):
                if not self.extras and isinstance(choice.get(part), dict):
                    _keep(choice[part], _MESSAGE)
        if "usage" in body:
            if body["usage"] is None:
                del body["usage"]
            else:
                self._mend_usage(body["usage"])

    def _mend_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        for key in [k for k, v in usage.items() if v is None]:
            del usage[key]
        if not self.extras:
            reasoning = usage.pop("reasoning_tokens", 0)
            if isinstance(reasoning, int) and reasoning > 0:
                details = usage.setdefault("completion_tokens_details", {})
                if isinstance(details, dict):
                    details.setdefault("reasoning_tokens", reasoning)
            _keep(usage, _USAGE)
        for name, value in usage.items():
            if isinstance(value, dict):
                for key in [k for k, v in value.items() if v is None]:
                    del value[key]
                if not self.extras and name in _USAGE_DETAILS:
                    _keep(value, _USAGE_DETAILS[name])


def _keep(obj: dict[str, Any], allowed: frozenset[str]) -> None:
    for key in [k for k in obj if k not in allowed]:
        del obj[key]


class StreamShaper:
    """Mends the ``data:`` lines of one completion stream, in order.

    Besides the shape's mends, it gives every chunk one id: public_id when given (the id the gateway sent upstream
    may carry a reuse plan, which clients never see), else the stream's first id. With ``n`` > 1 SGLang numbers
    each choice's chunks with an id of its own, while OpenAI's streams (and clients that group chunks by id) carry
    one id per completion.
    """

    def __init__(self, shape: Shape = Shape(), public_id: str | None = None, upstream_id: str | None = None) -> None:
        self._shape = shape
        self._id: str | None = public_id
        # The upstream id as it appears in chunks, swapped for the public one without a JSON round trip.
        self._swap = (f'"id":"{upstream_id}"', f'"id":"{public_id}"') if public_id and upstream_id else None

    def line(self, line: str) -> str:
        if not line.startswith("data: {"):
            return line
        if self._swap is not None:
            line = line.replace(*self._swap, 1)
        if self._shape.extras and self._id is not None and f'"id":"{self._id}"' in line and '"usage"' not in line:
            return line  # with extras, the common case has nothing to mend: no JSON round trip
        try:
            chunk = orjson.loads(line[6:])  # a fifth of the stdlib's time: ~3 us a chunk of a token
        except orjson.JSONDecodeError:
            return line
        if not isinstance(chunk, dict) or "error" in chunk:
            return line
        if self._id is None:
            self._id = chunk.get("id")
        elif "id" in chunk:
            chunk["id"] = self._id
        self._shape.mend(chunk)
        try:
            return "data: " + orjson.dumps(chunk).decode()
        except orjson.JSONEncodeError:  # an integer past 64 bits, say: the chunk goes as it came
            return line
