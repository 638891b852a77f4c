"""Bringing worker responses to the exact shape of OpenAI's published schema.

SGLang's answers are close to OpenAI's but not identical: it leaves out
``message.refusal`` (required, nullable) and sends ``null`` for usage detail objects
that the schema types as objects. Strict clients and schema validators reject those,
so the gateway mends them here; everything else passes through unchanged.
"""

from __future__ import annotations

import json
from typing import Any


def _clean_usage(usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    for key in [k for k, v in usage.items() if v is None]:
        del usage[key]
    for value in usage.values():
        if isinstance(value, dict):
            for key in [k for k, v in value.items() if v is None]:
                del value[key]


def completion(body: dict[str, Any]) -> dict[str, Any]:
    """Mend a non-streaming chat completion in place and return it."""
    for choice in body.get("choices") or ():
        message = choice.get("message")
        if isinstance(message, dict):
            message.setdefault("refusal", None)
    if "usage" in body:
        _clean_usage(body["usage"])
    return body


def stream_line(line: str) -> str:
    """Mend one SSE ``data:`` line of a chat completion stream."""
    # Only usage chunks need mending; the others pass without a JSON round trip.
    if not line.startswith("data: {") or '"usage"' not in line:
        return line
    try:
        chunk = json.loads(line[6:])
    except ValueError:
        return line
    if chunk.get("usage") is None:
        chunk.pop("usage", None)
    else:
        _clean_usage(chunk["usage"])
    return "data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
