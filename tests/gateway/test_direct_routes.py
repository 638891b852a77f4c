"""gateway/routes/direct.py: the completion endpoints called from the middleware stack, everything else passed on."""

from __future__ import annotations

import socket
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import InvalidRequest
from gateway.routes.direct import ROUTES, DirectRoutes
from tests.http_server import serve_handler
from tests.waiting import wait_until


class Inner:
    """The app behind: records what reached it."""

    def __init__(self) -> None:
        self.paths: list[tuple[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.paths.append((scope["method"], scope["path"]))
        await JSONResponse({"from": "app"}, status_code=405)(scope, receive, send)


async def call(app: DirectRoutes, method: str, path: str, root_path: str = "") -> tuple[int, Any]:
    scope = {"type": "http", "method": method, "path": path, "root_path": root_path, "headers": [],
             "query_string": b""}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    body = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return sent[0]["status"], orjson.loads(body)


def endpoints(raises: Exception | None = None) -> dict[str, Any]:
    async def answer(request: Request) -> Response:
        if raises is not None:
            raise raises
        return JSONResponse({"from": "endpoint", "path": request.url.path, "body": (await request.body()).decode()})

    return {path: answer for path in ROUTES}


async def test_a_post_to_a_completion_route_runs_its_endpoint_and_nothing_behind() -> None:
    inner = Inner()
    app = DirectRoutes(inner, endpoints())
    for path in ROUTES:
        status, body = await call(app, "POST", path)
        assert (status, body["from"], body["path"], body["body"]) == (200, "endpoint", path, "{}")
    assert inner.paths == []


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/chat/completions"), ("POST", "/v1/models"),
                                              ("POST", "/v1/chat/completions/"), ("POST", "/admin/stats")])
async def test_other_methods_and_paths_go_on_to_the_app(method: str, path: str) -> None:
    inner = Inner()
    status, body = await call(DirectRoutes(inner, endpoints()), method, path)
    assert (status, body) == (405, {"from": "app"}) and inner.paths == [(method, path)]


async def test_a_root_path_is_taken_off_as_fastapis_router_does() -> None:
    inner = Inner()
    status, body = await call(DirectRoutes(inner, endpoints()), "POST", "/api/v1/chat/completions", root_path="/api")
    assert (status, body["from"]) == (200, "endpoint") and inner.paths == []


async def test_a_gateway_error_is_answered_as_through_fastapi() -> None:
    error = InvalidRequest("messages: must not be empty", param="messages", code="empty")
    status, body = await call(DirectRoutes(Inner(), endpoints(error)), "POST", "/v1/chat/completions")
    assert status == 400 and body == error.body()
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "messages"


async def test_any_other_error_goes_on_to_the_server_error_handler_outside() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        await call(DirectRoutes(Inner(), endpoints(RuntimeError("boom"))), "POST", "/v1/completions")


async def test_the_app_routes_completions_through_it_and_still_lists_them() -> None:
    from gateway.app import create_app
    from gateway.config import GatewayConfig, TenantSettings

    app = create_app(GatewayConfig(model="m", workers=("http://127.0.0.1:9",), tenants=TenantSettings.open()))
    assert any(middleware.cls is DirectRoutes for middleware in app.user_middleware)
    listed = app.openapi()["paths"]
    assert all("post" in listed[path] for path in ROUTES)


class _SlowStream(BaseHTTPRequestHandler):
    """A worker whose streams send an event every 50 ms for 10 s; when a stream's connection was found closed."""

    protocol_version = "HTTP/1.1"
    closed_at: list[float] = []
    EVENT = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
             b'"delta":{"content":"a"},"finish_reason":null}]}\n\n')

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        body = b'{"data":[{"id":"m","root":"m","max_model_len":4096}]}' if self.path == "/v1/models" else b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for _ in range(200):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(self.EVENT), self.EVENT))
                self.wfile.flush()
                time.sleep(0.05)  # the worker's pace: a token every 50 ms
            self.wfile.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        except OSError:
            type(self).closed_at.append(time.monotonic())
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


def test_a_client_that_leaves_a_stream_closes_the_workers_stream_through_the_whole_gateway() -> None:
    """The stream is sent by the request's own task (EventStream): admission's watch, not a task of the response's,
    notices the client leaving, and the upstream stream ends within a few of the worker's events."""
    from gateway.config import GatewayConfig, TenantSettings
    from tests.conftest import run_gateway

    _SlowStream.closed_at.clear()
    with serve_handler(_SlowStream) as worker:
        gateway = run_gateway(GatewayConfig(model="m", workers=(worker,), calibrate=False, health_interval_s=0.5,
                                            tenants=TenantSettings.open()))
        try:
            body = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
            port = int(gateway.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                seen = b""
                while b"data: {" not in seen:
                    seen += sock.recv(65536)
                assert seen.startswith(b"HTTP/1.1 200") and b"text/event-stream" in seen
            left = time.monotonic()
            wait_until(lambda: _SlowStream.closed_at, "the worker's stream closed after the client left", timeout=5)
            assert _SlowStream.closed_at[0] - left < 2.0
            assert httpx.get(gateway.url + "/health").status_code == 200
        finally:
            gateway.stop()
