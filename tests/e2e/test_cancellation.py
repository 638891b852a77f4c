"""A client that goes away stops the work on the worker, streaming or not."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time

import httpx
import pytest

from tests.images_lib import data_url, encode, small

pytestmark = pytest.mark.sglang

IMAGE = data_url(encode(small("rocket.jpg", (84, 84))))
LONG = 4000  # tokens: tens of seconds of decoding on a CPU worker, unless cancelled


def running_requests(worker_url: str) -> int:
    loads = httpx.get(worker_url + "/v1/loads", params={"include": "core"}, timeout=10).json()["loads"]
    return sum(load["num_running_reqs"] + load.get("num_waiting_reqs", 0) for load in loads)


def body(stream: bool) -> dict:
    return {
        "model": "revisit-tiny",
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                                  {"type": "text", "text": "Talk."}]}],
        "max_completion_tokens": LONG, "ignore_eos": True, "temperature": 0, "stream": stream,
    }


def wait_for(predicate, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "condition not reached in time"
        time.sleep(0.2)
    return time.monotonic() - started


def busy_worker(gateway):
    busy = [w for w in gateway.app.state.services.pool.workers if w.inflight]
    assert len(busy) == 1
    return busy[0]


def test_stream_closed_by_the_client_aborts_the_upstream_request(gateway):
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body(True), timeout=60) as response:
        # Keep the line iterator referenced: closing it (even by garbage collection) closes
        # the connection, which is the disconnect this test makes on purpose further down.
        lines = response.iter_lines()
        received = [line for line in itertools.islice(lines, 6) if line.startswith("data: ")]
        assert received
        worker = busy_worker(gateway)
        assert running_requests(worker.url) == 1
        del lines
    # The client hung up: the gateway lets go of the worker and the worker stops decoding.
    wait_for(lambda: worker.inflight == 0, timeout=10)
    wait_for(lambda: running_requests(worker.url) == 0, timeout=20)


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def left(gateway) -> float:
    """revisit_requests_total of chat completions whose client left (code 499)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(gateway.url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "revisit_requests_total" and s.labels.get("code") == "499"
               and s.labels.get("endpoint") == "/v1/chat/completions")


def test_non_streaming_client_gone_aborts_the_upstream_request(gateway):
    errors, before = Errors(), left(gateway)
    logging.getLogger("uvicorn.error").addHandler(errors)  # where uvicorn reports an application's exception

    def doomed() -> None:
        try:
            httpx.post(gateway.url + "/v1/chat/completions", json=body(False), timeout=3)
        except httpx.TimeoutException:
            pass  # the client gives up and closes its connection

    thread = threading.Thread(target=doomed)
    thread.start()
    wait_for(lambda: any(w.inflight for w in gateway.app.state.services.pool.workers), timeout=10)
    worker = busy_worker(gateway)
    thread.join()
    try:
        wait_for(lambda: worker.inflight == 0, timeout=10)
        wait_for(lambda: running_requests(worker.url) == 0, timeout=20)
        # An ordinary event, not an application error: counted, and no traceback in the log.
        wait_for(lambda: left(gateway) == before + 1, timeout=10)
        assert errors.messages == []
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)


def test_stream_client_gone_before_the_first_token_aborts_the_upstream_request(gateway):
    """The client leaves while the worker is still prefilling: nothing was sent back yet (a stream's response
    starts with the worker's first event), and the worker stops all the same."""
    import select
    import socket

    from tests.images_lib import noise_image

    # A 1,024-token image and a long text: a prefill of a second or more on a CPU worker, during which the gateway
    # has sent the request and the client nothing back.
    big = data_url(encode(noise_image(1400, 1400, seed=int(time.time()))))
    payload = body(True)
    payload["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": big}},
                                         {"type": "text", "text": "describe " * 2000}]
    raw = json.dumps(payload).encode()
    host, port = gateway.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    deadline = time.monotonic() + 60
    while not any(w.inflight for w in gateway.app.state.services.pool.workers):  # sent to the worker
        assert time.monotonic() < deadline
        time.sleep(0.002)
    worker = busy_worker(gateway)
    readable, _, _ = select.select([sock], [], [], 0)
    assert not readable, "the first token came before the client could leave; make the prefill longer"
    sock.close()
    wait_for(lambda: worker.inflight == 0, timeout=10)
    wait_for(lambda: running_requests(worker.url) == 0, timeout=20)
