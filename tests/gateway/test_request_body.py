"""What a request's body costs the gateway's memory while it is read and taken in: one copy as it arrives, one more
while it is parsed, and no copy beside its parse once parsed (a 50 MB body read as chunks joined at the end, then
held through the whole request, was three copies at its peak: the chunks, the joined body and its parse; parsed by
orjson, it was three too: the body, orjson's own copy and the parse)."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

from starlette.requests import Request

from gateway.config import GatewayConfig
from gateway.image_fetch import ImageFetcher
from gateway.intake import Intake
from gateway.protocol import parse_body
from gateway.routes.openai_api import _read_body
from tests.images_lib import data_url, encode, noise_image

CHUNK = 64 * 1024  # what uvicorn hands the app at a time


def arriving(size: int) -> Request:
    """A request whose body of ``size`` bytes arrives as a server delivers it: a new chunk at a time, which the
    server lets go once handed over."""
    sent = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        chunk = b"x" * min(CHUNK, size - sent)
        sent += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": sent < size}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [
        (b"content-length", str(size).encode())]}
    return Request(scope, receive)


async def test_a_body_is_read_into_one_buffer_not_chunks_joined_at_the_end() -> None:
    size = 32 * 1024 * 1024
    request = arriving(size)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        body = await _read_body(request, limit=2 * size)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert len(body) == size and body[:1] == b"x" and body[-1:] == b"x"
    # Grown in place: its last resize is at most an eighth over (joining the chunks held the body twice: 2.0x).
    assert peak < 1.3 * size, f"reading {size} bytes peaked at {peak / size:.2f}x"


async def test_intake_lets_the_body_go_once_it_is_parsed() -> None:
    """Measured while the request's image is fetched, after parsing: what the gateway holds then is the parse, not
    the parse and the body beside it."""
    text = "word " * (24 * 1024 * 1024 // 5)
    image = data_url(encode(noise_image(32, 32)))
    config = GatewayConfig(model="m", workers=("http://127.0.0.1:1",))
    fetcher = ImageFetcher(config.images)
    intake = Intake(config, fetcher)
    held: list[int] = []
    fetch = fetcher.fetch

    async def measured_fetch(*args: Any, **kwargs: Any) -> bytes:
        held.append(tracemalloc.get_traced_memory()[0])
        return await fetch(*args, **kwargs)

    fetcher.fetch = measured_fetch  # type: ignore[method-assign]

    def body() -> bytearray:
        return bytearray(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image}}]}]}).encode())

    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        result = await intake.process(body(), namespace="n")  # handed over: the test keeps no reference
    finally:
        tracemalloc.stop()
        await intake.aclose()
    assert len(result.images) == 1 and result.body_bytes > len(text)
    # The parse is one copy of the text; the body beside it would be a second.
    assert held and held[0] - start < 1.5 * len(text), f"{(held[0] - start) / len(text):.2f}x the text held"


def test_a_body_is_parsed_beside_one_copy_of_itself_and_emptied_once_read() -> None:
    """Parsing a large body holds its text and what it parses to, not the body beside them: it is emptied once
    decoded (orjson's parse traced 13x the body here: its own buffers beside the body and the parse)."""
    text = "word " * (16 * 1024 * 1024 // 5)
    tracemalloc.start()
    try:
        raw = bytearray(json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode())
        size = len(raw)
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        body, _ = parse_body(raw)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert body["messages"][0]["content"] == text
    assert len(raw) == 0  # consumed
    # Over what was held before (the body): the text while the body is let go, then the parse beside the text.
    assert peak < 1.2 * size, f"parsing {size} bytes peaked at {peak / size:.2f}x more"
