"""How a request's end is counted: a stream whose last event went out was served, even if its client left before
the empty frame after it; one cut before it was not."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from gateway.metrics import CLIENT_LEFT, RequestMetrics, RequestTimer


def counted(*bodies: bytes) -> dict[str, float]:
    """Run one streamed chat request through the timer: the app sends ``bodies`` (more to come after each), then
    its client leaves. The requests counted, by status."""
    metrics = RequestMetrics(CollectorRegistry())

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for body in bodies:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        raise asyncio.CancelledError  # the client left: the empty last frame is never sent

    scope = {"type": "http", "path": "/v1/chat/completions", "state": {"stream": True, "reuse": "none"},
             "app": SimpleNamespace(state=SimpleNamespace(services=SimpleNamespace(requests=metrics)))}

    async def send(message: dict) -> None:
        return None

    async def run() -> None:
        with pytest.raises(asyncio.CancelledError):
            await RequestTimer(app)(scope, None, send)

    asyncio.run(run())
    return {sample.labels["code"]: sample.value for family in metrics.requests.collect() for sample in family.samples
            if sample.name.endswith("_total")}


def test_a_stream_whose_last_event_went_out_was_served() -> None:
    assert counted(b'data: {"choices": []}\n\n', b"data: [DONE]\n\n") == {"200": 1.0}


def test_a_stream_cut_before_its_last_event_was_not() -> None:
    assert counted(b'data: {"choices": []}\n\n') == {str(CLIENT_LEFT): 1.0}
