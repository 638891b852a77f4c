"""Bounded work per request and per key (gateway/admission.py), through a real gateway server on loopback: a body
that drips is cut at its deadline, one key cannot hold more than its share of requests or body bytes (a declared
body past its share waits for room, unread, up to the body deadline), an image URL
that drips ends at the fetch deadline, and a client that leaves while its images are fetched cancels the fetch.
Before, each of these held the gateway's resources for as long as the client (or the image server) liked."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler

import httpx
import orjson
import pytest

from gateway.config import AdmissionLimits, ImageLimits, TenantSettings
from tests.conftest import GatewayServer, gateway_config, run_gateway
from tests.http_server import serve_handler

ALICE, BOB, CAROL = ("sk-" + name + "-" + "0" * 20 for name in ("alice", "bob", "carol"))
NO_WORKER = "http://127.0.0.1:9"  # nothing listens: a request admitted past intake answers 503


def gateway(model_path, **settings) -> GatewayServer:
    keys = TenantSettings.with_keys({ALICE: "a", BOB: "b", CAROL: "c"})
    return run_gateway(gateway_config(model_path, [NO_WORKER], tenants=keys, **settings))


@pytest.fixture
def server(request, model_path) -> Iterator[GatewayServer]:
    running = gateway(model_path, **request.param)
    try:
        yield running
    finally:
        running.stop()


def held_request(url: str, key: str, declared: int) -> socket.socket:
    """A chat request whose headers are sent and whose body is not (yet): it is admitted and waits for its body."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n".encode())
    return sock


def response_of(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), orjson.loads(body)


def holding(server: GatewayServer, body_bytes: int) -> None:
    """Wait until the requests in flight hold ``body_bytes`` (a held request is admitted once the server reads its
    headers, which a test's next request may overtake)."""
    deadline = time.monotonic() + 10
    while server.app.state.services.admission.stats()["body_bytes"] != body_bytes:
        assert time.monotonic() < deadline, server.app.state.services.admission.stats()
        time.sleep(0.01)


def post(url: str, key: str, **kwargs) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30, **kwargs)


@pytest.mark.parametrize("server", [{"admission": AdmissionLimits(body_timeout_s=1.5)}], indirect=True)
def test_a_body_that_drips_is_cut_at_its_deadline(server):
    sock = held_request(server.url, ALICE, declared=1000)
    started = time.monotonic()
    answered = False
    while not answered and time.monotonic() - started < 10:
        with contextlib.suppress(OSError):  # the gateway may stop reading once it has answered
            sock.sendall(b" ")  # one byte every 0.3 s: never a long enough gap for a per-read timeout
        answered = bool(select.select([sock], [], [], 0.3)[0])
    status, body = response_of(sock)
    assert status == 408 and body["error"]["code"] == "body_timeout"
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("server", [{"admission": AdmissionLimits(max_requests_per_key=2, max_requests=3)}],
                         indirect=True)
def test_one_key_cannot_hold_more_than_its_share_of_requests(server):
    held = [held_request(server.url, ALICE, declared=100) for _ in range(2)]
    try:
        refused = post(server.url, ALICE, json={})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"  # what OpenAI's clients retry on
        assert post(server.url, BOB, json={}).status_code == 400  # another key is served meanwhile
        held.append(held_request(server.url, BOB, declared=100))  # three in flight: as many as the gateway takes
        assert post(server.url, CAROL, json={}).status_code == 429
        stats = server.app.state.services.admission.stats()
        assert stats["requests"] == 3 and stats["refused"] == {"requests_per_key": 1, "requests": 1}
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while (status := post(server.url, ALICE, json={}).status_code) == 429 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status == 400  # released once the held requests ended


@pytest.mark.parametrize("server", [{"admission": AdmissionLimits(max_body_bytes_per_key=1 << 20,
                                                                  max_body_bytes=3 << 19)}], indirect=True)
def test_one_key_cannot_hold_more_than_its_share_of_body_bytes(server):
    big = b" " * (2 << 20)  # more than a key may ever hold: a 413, no retry would help
    declared = post(server.url, ALICE, content=big)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"
    chunked = post(server.url, ALICE, content=iter([big[: 1 << 19]] * 4))  # no Content-Length: counted as it comes
    assert chunked.status_code == 413
    held = held_request(server.url, ALICE, declared=700 << 10)  # within the key's budget
    try:
        holding(server, 700 << 10)
        # A second body the key's budget has no room for waits for room, unread ...
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post, server.url, ALICE, content=b" " * (400 << 10))
            admission = server.app.state.services.admission
            deadline = time.monotonic() + 10
            while admission.stats()["waiting_for_room"] != 1:
                assert time.monotonic() < deadline, admission.stats()
                time.sleep(0.01)
            assert post(server.url, BOB, json={}).status_code == 400  # ... while another key is served
            holding(server, 700 << 10)  # (BOB's 2 bytes are let go just after his answer)
            assert not waiting.done()
            held.close()  # room: it is read and answered (a 400: spaces are no JSON)
            assert waiting.result(timeout=20).status_code == 400
        assert admission.stats()["waited"] == 1
    finally:
        held.close()
    holding(server, 0)
    held = held_request(server.url, BOB, declared=1 << 20)  # BOB holds 1 MiB of the 1.5 MiB the gateway takes
    try:
        holding(server, 1 << 20)
        assert post(server.url, CAROL, content=b" " * (600 << 10)).status_code == 429
        assert post(server.url, CAROL, content=b" " * (100 << 10)).status_code == 400  # within what is left
    finally:
        held.close()


@pytest.mark.parametrize("server", [{}], indirect=True)
def test_a_client_that_leaves_in_the_middle_of_its_body_is_no_error(server, caplog):
    sock = held_request(server.url, ALICE, declared=1000)
    sock.sendall(b'{"model": "revisit-tiny", "mess')
    holding(server, 1000)
    with caplog.at_level(logging.WARNING):
        sock.close()
        holding(server, 0)  # let go of at once
        deadline = time.monotonic() + 10
        while server.app.state.services.admission.stats()["requests"]:  # the handler has ended (and logged, if)
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []  # no traceback, no 500


class DripHandler(BaseHTTPRequestHandler):
    """An image server that sends a PNG's first bytes and then one byte every 0.2 s, for up to 20 s; it records
    when the gateway hung up on it."""

    hung_up: list[float] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", "1000")
        self.end_headers()
        try:
            self.wfile.write(b"\x89PNG\r\n\x1a\n")
            for _ in range(100):
                time.sleep(0.2)
                self.wfile.write(b"\0")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            DripHandler.hung_up.append(time.monotonic())

    def log_message(self, *args) -> None:
        pass


def image_request(image_url: str) -> bytes:
    return orjson.dumps({"model": "revisit-tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "What is it?"}]}]})


@pytest.mark.parametrize("server", [{"admission": AdmissionLimits(max_body_bytes_per_key=1 << 20, body_timeout_s=1),
                                     "images": ImageLimits(allow_private_urls=True)}], indirect=True)
def test_a_body_that_waits_for_room_longer_than_the_body_deadline_is_a_429(server):
    """A key's bytes are held by a request whose body is in and whose image drips: longer than the next one may wait."""
    with serve_handler(DripHandler) as images:
        body = orjson.loads(image_request(images + "/drip.png"))
        body["messages"][0]["content"].append({"type": "text", "text": " " * (700 << 10)})
        raw = orjson.dumps(body)
        held = held_request(server.url, ALICE, declared=len(raw))
        try:
            held.sendall(raw)
            holding(server, len(raw))
            started = time.monotonic()
            refused = post(server.url, ALICE, content=b" " * (400 << 10))
            waited = time.monotonic() - started
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert 0.9 < waited < 5, waited
            stats = server.app.state.services.admission.stats()
            assert stats["refused"] == {"body_bytes_per_key": 1} and stats["waiting_for_room"] == 0
        finally:
            held.close()
    holding(server, 0)


@pytest.mark.parametrize("server", [{"images": ImageLimits(allow_private_urls=True, fetch_deadline_s=1.5)}],
                         indirect=True)
def test_an_image_url_that_drips_ends_at_the_fetch_deadline(server):
    with serve_handler(DripHandler) as images:
        started = time.monotonic()
        response = post(server.url, ALICE, content=image_request(images + "/drip.png"))
    assert response.status_code == 400 and response.json()["error"]["code"] == "image_fetch_timeout"
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("server", [{"images": ImageLimits(allow_private_urls=True)}], indirect=True)
def test_a_client_that_leaves_while_its_image_is_fetched_cancels_the_fetch(server):
    DripHandler.hung_up.clear()
    with serve_handler(DripHandler) as images:
        body = image_request(images + "/drip.png")
        sock = held_request(server.url, ALICE, declared=len(body))
        sock.sendall(body)
        time.sleep(1.0)  # the gateway is fetching the image, a byte every 0.2 s
        left = time.monotonic()
        sock.close()
        deadline = time.monotonic() + 10
        while not DripHandler.hung_up and time.monotonic() < deadline:
            time.sleep(0.05)
    assert DripHandler.hung_up, "the gateway went on fetching for a client that had left"
    assert DripHandler.hung_up[0] - left < 2


def test_admission_limits_from_the_environment_and_bad_ones():
    from gateway.config import ConfigError

    limits = AdmissionLimits.from_env({"REVISIT_ADMISSION_MAX_REQUESTS_PER_KEY": "8",
                                       "REVISIT_ADMISSION_BODY_TIMEOUT_S": "2.5"})
    assert limits.max_requests_per_key == 8 and limits.body_timeout_s == 2.5
    with pytest.raises(ConfigError, match="MAX_REQUESTS"):
        AdmissionLimits.from_env({"REVISIT_ADMISSION_MAX_REQUESTS": "0"})
    with pytest.raises(ConfigError, match="per-key"):
        AdmissionLimits(max_requests=4, max_requests_per_key=8)
    with pytest.raises(ConfigError, match="unknown variable"):
        AdmissionLimits.from_env({"REVISIT_ADMISSION_MAX_REQUEST": "3"})


def test_many_callers_at_once_leave_nothing_held(model_path):
    running = gateway(model_path)
    try:
        threads = [threading.Thread(target=post, args=(running.url, key), kwargs={"json": {}})
                   for key in (ALICE, BOB, CAROL) * 10]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        admission = running.app.state.services.admission
        deadline = time.monotonic() + 5  # a ticket is given back just after its response went out
        while admission.stats()["requests"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = admission.stats()
        assert stats["requests"] == 0 and stats["body_bytes"] == 0 and stats["keys"] == 0
    finally:
        running.stop()
