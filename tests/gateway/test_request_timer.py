"""How a request's end is counted: a stream whose last event went out was served, even if its client left before
the empty frame after it; one cut before it was not."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from gateway.metrics import CLIENT_LEFT, HOUR_MINUTES, LastHour, RequestMetrics, RequestTimer


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


def test_the_last_hour_keeps_a_minute_at_a_time_and_forgets_what_is_older() -> None:
    now = [3600.0 * 100 + 5]
    hour = LastHour(clock=lambda: now[0])
    hour.record(200, ("miss", "exact_same_prefix", "approximate"), "mixed", None)
    hour.record(200, ("exact_same_prefix",), "exact_same_prefix", 0.040)
    hour.record(200, ("exact_same_prefix",), "exact_same_prefix", 0.020)
    hour.record(200, ("exact_same_prefix",), "exact_same_prefix", 0.030)
    hour.record(CLIENT_LEFT, (), "none", None)
    now[0] += 120  # two minutes on: one without requests between
    hour.record(503, ("miss",), "miss", None)
    minutes = hour.snapshot()["minutes"]
    assert len(minutes) == HOUR_MINUTES and minutes[-1]["at"] == 3600 * 100 + 120
    first, quiet, last = minutes[-3:]
    assert (first["requests"], first["failed"], first["hit_rate"]) == (5, 1, 0.8333)  # 5 of 6 images reused
    assert first["images"] == {"miss": 1, "exact_same_prefix": 4, "exact_moved": 0, "approximate": 1}
    assert first["ttft_ms"] == {"exact_same_prefix": 30.0}  # the median; requests without a TTFT add none
    assert (quiet["requests"], quiet["hit_rate"], quiet["ttft_ms"]) == (0, None, {})
    assert (last["requests"], last["failed"], last["hit_rate"]) == (1, 1, 0.0)
    now[0] += 60 * (HOUR_MINUTES - 2)  # the first minute is now an hour old: gone; the quiet one is the oldest shown
    assert hour.snapshot()["minutes"][0]["at"] == quiet["at"]
    assert sum(m["requests"] for m in hour.snapshot()["minutes"]) == 1


def test_the_timer_records_a_chat_request_s_images_in_the_last_hour() -> None:
    metrics = RequestMetrics(CollectorRegistry())

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    scope = {"type": "http", "path": "/v1/chat/completions",
             "state": {"reuse": "approximate", "image_kinds": ("approximate", "miss")},
             "app": SimpleNamespace(state=SimpleNamespace(services=SimpleNamespace(requests=metrics)))}

    async def send(message: dict) -> None:
        return None

    asyncio.run(RequestTimer(app)(scope, None, send))
    now = metrics.last_hour.snapshot()["minutes"][-1]
    assert (now["requests"], now["images"]["approximate"], now["hit_rate"]) == (1, 1, 0.5)
