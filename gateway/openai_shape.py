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


def completion(body: dict[str, Any], public_id: str | None = None) -> dict[str, Any]:
    """Mend a non-streaming chat completion in place and return it (with public_id as its id, when given)."""
    if public_id is not None:
        body["id"] = public_id
    for choice in body.get("choices") or ():
        message = choice.get("message")
        if isinstance(message, dict):
            message.setdefault("refusal", None)
    if "usage" in body:
        _clean_usage(body["usage"])
    return body


class StreamShaper:
    """Mends the ``data:`` lines of one chat completion stream, in order.

    Besides usage mending, it gives every chunk one id: public_id when given (the id
    the gateway sent upstream may carry a reuse plan, which clients never see), else the
    stream's first id. With ``n`` > 1 SGLang numbers each choice's chunks with an id of
    its own, while OpenAI's streams (and clients that group chunks by id) carry one id
    per completion.
    """

    def __init__(self, public_id: str | None = None, upstream_id: str | None = None) -> None:
        self._id: str | None = public_id
        # The upstream id as it appears in chunks, swapped for the public one without a JSON round trip.
        self._swap = (f'"id":"{upstream_id}"', f'"id":"{public_id}"') if public_id and upstream_id else None

    def line(self, line: str) -> str:
        if not line.startswith("data: {"):
            return line
        if self._swap is not None:
            line = line.replace(*self._swap, 1)
        if self._id is not None and f'"id":"{self._id}"' in line and '"usage"' not in line:
            return line  # the common case: nothing to mend, no JSON round trip
        try:
            chunk = json.loads(line[6:])
        except ValueError:
            return line
        if not isinstance(chunk, dict) or "error" in chunk:
            return line
        changed = False
        if self._id is None:
            self._id = chunk.get("id")
        elif "id" in chunk and chunk["id"] != self._id:
            chunk["id"], changed = self._id, True
        if "usage" in chunk:
            changed = True
            if chunk["usage"] is None:
                del chunk["usage"]
            else:
                _clean_usage(chunk["usage"])
        if not changed:
            return line
        return "data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
