"""The response cache: answers served without running the model, in front of planning.

Three levels, looked up cheapest and strictest first; the first hit answers (MLC's L0.5, L1 and L2):

    exact       the same request again: the same messages (text normalised), the same images and videos by key,
                the same answer-changing fields (asked.py). A dictionary lookup.
    paraphrase  the same conversation and images, the last question worded otherwise: its sentence embedding
                (embedder.py) within ``paraphrase_threshold`` of a cached question's, and the guard (guard.py)
                finding no negation, number, name or contrast word that differs.
    similar     as paraphrase, with each image replaced by a near-duplicate the approximate-match index finds
                (gateway/matching) with at most ``similar_max_changed`` tokens changed (default none: a re-encode
                or a re-upload of the same picture), and ``similar_text_threshold``.

Safe by construction: off unless settings name the namespace, and then per request by the
``x-revisit-response-cache`` header (or the namespace's default level); only deterministic requests (temperature 0
or a seed); never across namespaces (every key names one); a conversation's earlier turns must be equal, so no
reply is served after another history. Responses say what served them in the same header; /admin/stats and
/metrics count hits, misses, vetoes and false-hit reports per level (POST /admin/response-cache/false-hits);
DELETE /admin/response-cache flushes. Streamed requests get their hit replayed as a stream, and a streamed miss
is recorded from its chunks (:func:`recorded`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import orjson

from gateway.response_cache.asked import Asked, asked
from gateway.response_cache.cache import (
    EXACT,
    NOT_LOOKED_UP,
    PARAPHRASE,
    SIMILAR,
    Answer,
    Entry,
    Found,
    ResponseCache,
)
from gateway.response_cache.embedder import TextEmbedder

__all__ = ["EXACT", "NOT_LOOKED_UP", "PARAPHRASE", "SIMILAR", "Answer", "Asked", "Entry", "Found", "ResponseCache",
           "StreamRecorder", "TextEmbedder", "asked", "recorded", "replay_stream"]


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return f"data: {data}\n\n".encode()


async def replay_stream(answer: Answer, public_id: str, *, include_usage: bool) -> AsyncIterator[bytes]:
    """A cached answer as the SSE stream a worker would have sent (gateway/openai_shape.py's shape)."""
    for chunk in answer.chunks(public_id, include_usage=include_usage):
        yield sse(chunk)
    yield sse("[DONE]")


async def recorded(stream: AsyncIterator[bytes], on_answer: Callable[[Answer], Awaitable[object]]) -> \
        AsyncIterator[bytes]:
    """``stream`` (a relayed completion stream) passed through unchanged, its answer put together from the chunks
    (:class:`StreamRecorder`); when it ends well, ``on_answer`` gets the answer before ``[DONE]`` goes out, so a
    request sent once the stream ended finds it."""
    recorder = StreamRecorder()
    try:
        async for item in stream:
            if item.startswith(b"data: [DONE]"):
                if (answer := recorder.answer()) is not None:
                    await on_answer(answer)
            else:
                recorder.read(item)
            yield item
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


class StreamRecorder:
    """A completion's answer, from its stream's ``data:`` chunks in order; None unless the stream ended well (a
    finish reason, no error, one choice of text and nothing else)."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._model = ""
        self._finish: str | None = None
        self._usage: dict | None = None
        self._fingerprint: str | None = None
        self._usable = True

    def read(self, item: bytes) -> None:
        if self._usable:
            self._read(item)

    def _read(self, item: bytes) -> None:
        try:
            chunk = orjson.loads(item.removeprefix(b"data: "))
        except orjson.JSONDecodeError:
            self._usable = False
            return
        if not isinstance(chunk, dict) or "error" in chunk:
            self._usable = False
            return
        self._model = chunk.get("model") or self._model
        self._fingerprint = chunk.get("system_fingerprint") or self._fingerprint
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if choice.get("index", 0) != 0 or not isinstance(delta, dict) or choice.get("logprobs") is not None or \
                    any(v not in (None, [], {}, "") for k, v in delta.items() if k not in ("role", "content")):
                self._usable = False
                return
            if isinstance(delta.get("content"), str):
                self._content.append(delta["content"])
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]

    def answer(self) -> Answer | None:
        if not self._usable or self._finish is None:
            return None
        return Answer(model=self._model, message={"role": "assistant", "content": "".join(self._content),
                                                  "refusal": None},
                      finish_reason=self._finish, usage=self._usage, system_fingerprint=self._fingerprint)
