"""The dispatcher against real HTTP workers on loopback: a worker that hangs (stopped: it answers nothing, /health
and /metrics included) while a request waits for its answer gives the request back once its health checks take it
out, and the request is answered by another worker, long before the upstream timeout."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import httpx

from gateway.dispatch import Dispatcher, Route, UpstreamRequest
from gateway.upstream import UpstreamClient
from gateway.workers import WorkerPool
from tests.http_server import serve_handler

UPSTREAM_TIMEOUT_S = 20.0  # what a request at a hung worker would wait without the pool giving it back


def upstream(timeout_s: float) -> UpstreamClient:
    """The gateway's client to its workers (gateway/upstream.py)."""
    return UpstreamClient(connections=16, timeout_s=timeout_s, connect_timeout_s=2.0, keepalive_s=2.0)


class Worker(BaseHTTPRequestHandler):
    """A worker named ``name`` that answers /health and completions (plain and streamed) at once, or, while
    ``thawed`` is clear, nothing at all until it is set (a process stopped with SIGSTOP)."""

    name = "?"
    thawed: threading.Event  # clear while frozen
    posted: threading.Event  # set when a completion arrives

    def _wait_while_frozen(self) -> None:
        type(self).thawed.wait(timeout=60)

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._wait_while_frozen()
        self._send(200 if self.path == "/health" else 404, b"")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).posted.set()
        self._wait_while_frozen()
        chunk = {"id": body["rid"], "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": self.name}}]}
        if body.get("stream"):
            events = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            self._send(200, events, "text/event-stream")
            return
        answer = {"id": body["rid"], "object": "chat.completion", "created": 0, "model": "m",
                  "choices": [{"index": 0, "finish_reason": "stop",
                               "message": {"role": "assistant", "content": self.name}}]}
        self._send(200, json.dumps(answer).encode())

    def log_message(self, *args) -> None:
        pass


def worker(name: str) -> type[Worker]:
    thawed = threading.Event()
    thawed.set()
    return type(name, (Worker,), {"name": name, "thawed": thawed, "posted": threading.Event()})


async def _with_one_hanging(stream: bool) -> tuple[str, float, WorkerPool]:
    """A request sent to worker A (preferred), which freezes as the request arrives; returns what answered it, the
    seconds it took, and the pool."""
    a, b = worker("A"), worker("B")
    with serve_handler(a) as url_a, serve_handler(b) as url_b:
        async with httpx.AsyncClient(timeout=httpx.Timeout(UPSTREAM_TIMEOUT_S, connect=2.0)) as client:
            pool = WorkerPool([url_a, url_b], client, interval_s=0.1, timeout_s=0.2, misses_allowed=2)
            await pool.start()
            try:
                assert all(w.healthy for w in pool.workers)
                a.thawed.clear()  # (the POST handler waits while frozen, so "as the request arrives" holds)
                dispatcher = Dispatcher(pool, upstream(UPSTREAM_TIMEOUT_S))
                body = {"rid": "r1", "model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
                request = UpstreamRequest(payload=json.dumps(body).encode(), rid="r1")
                started = time.monotonic()
                try:
                    if stream:
                        events = await dispatcher.open_stream(request, Route(prefer=url_a))
                        text = b"".join([event async for event in events]).decode()
                        answered_by = json.loads(text.split("\n\n")[0].removeprefix("data: "))
                        answered_by = answered_by["choices"][0]["delta"]["content"]
                    else:
                        answer = await dispatcher.complete(request, Route(prefer=url_a))
                        answered_by = answer["choices"][0]["message"]["content"]
                finally:
                    a.thawed.set()
                    await dispatcher.aclose()
                assert a.posted.is_set(), "the request never reached the worker that hung"
                return answered_by, time.monotonic() - started, pool
            finally:
                await pool.stop()


async def test_a_request_at_a_worker_that_hangs_is_answered_by_another():
    answered_by, seconds, pool = await _with_one_hanging(stream=False)
    assert answered_by == "B"
    assert seconds < UPSTREAM_TIMEOUT_S / 2
    assert not pool.workers[0].healthy and pool.workers[0].inflight == 0 and not pool.workers[0]._awaited


async def test_a_stream_at_a_worker_that_hangs_before_its_first_event_is_answered_by_another():
    answered_by, seconds, pool = await _with_one_hanging(stream=True)
    assert answered_by == "B"
    assert seconds < UPSTREAM_TIMEOUT_S / 2
    assert pool.workers[0].inflight == 0 and not pool.workers[0]._awaited


async def test_a_stream_s_events_are_relayed_whole_however_long_and_however_split():
    """An event of 300 KB, events split across writes, CRLF endings: each relayed whole, in order."""
    long_text = "x" * 300_000

    class Splitting(worker("A")):  # type: ignore[misc, valid-type]
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            events = b""
            for n, text in enumerate(["one", long_text, "three"]):
                chunk = {"id": body["rid"], "object": "chat.completion.chunk", "created": 0, "model": "m",
                         "choices": [{"index": 0, "delta": {"content": text}}]}
                events += f"data: {json.dumps(chunk)}".encode() + (b"\r\n\r\n" if n == 1 else b"\n\n")
            events += b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(events)))
            self.end_headers()
            for start in range(0, len(events), 7001):  # written in pieces that cut events anywhere
                self.wfile.write(events[start:start + 7001])
                self.wfile.flush()

    with serve_handler(Splitting) as url:
        async with httpx.AsyncClient(timeout=10) as health:
            pool = WorkerPool([url], health, interval_s=0.1, timeout_s=1.0)
            await pool.start()
            dispatcher = Dispatcher(pool, upstream(10))
            try:
                body = {"rid": "r", "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
                events = await dispatcher.open_stream(UpstreamRequest(payload=json.dumps(body).encode(), rid="r"))
                relayed = b"".join([event async for event in events]).decode().split("\n\n")
            finally:
                await dispatcher.aclose()
                await pool.stop()
    contents = [json.loads(e.removeprefix("data: "))["choices"][0]["delta"]["content"]
                for e in relayed if e.startswith("data: {")]
    assert contents == ["one", long_text, "three"] and relayed[-2:] == ["data: [DONE]", ""]
