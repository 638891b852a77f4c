"""Idle keep-alive connections: on each side of the gateway, the side that sends requests closes them first.

A connection closed by the server while the client sends a request on it fails at once, with nothing the client
did wrong ("Server disconnected without sending a response"). The openai client keeps idle connections 5 s, as
uvicorn does by default, so a gateway on uvicorn's default closes them just when clients reuse them.
"""

from __future__ import annotations

import socket
import time

from gateway.config import GatewayConfig
from gateway.services import UPSTREAM_KEEP_ALIVE_S
from tests.conftest import free_port, start_gateway_process, terminate

REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\nConnection: keep-alive\r\n\r\n"


def answer(sock: socket.socket) -> bytes:
    """One response read off a raw socket (the head and a Content-Length body), or b"" if it was closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_the_gateway_keeps_an_idle_client_connection_longer_than_clients_do() -> None:
    port = free_port()
    env = {"REVISIT_MODEL": "revisit-tiny", "REVISIT_WORKERS": "http://127.0.0.1:9", "REVISIT_REUSE": "0",
           "REVISIT_HEALTH_INTERVAL_S": "30"}
    process = start_gateway_process(env, port, path="/v1/models", ready=lambda r: True)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(REQUEST)
            assert answer(sock).startswith(b"HTTP/1.1 200")
            time.sleep(6.5)  # past the openai client's 5 s (and uvicorn's default keep-alive)
            sock.sendall(REQUEST)
            assert answer(sock).startswith(b"HTTP/1.1 200"), "the gateway closed an idle connection a client keeps"
    finally:
        terminate(process)
    assert GatewayConfig(model="m", workers=("http://w",)).keep_alive_s > 60


def test_the_gateway_drops_idle_worker_connections_before_sglang_closes_them() -> None:
    from sglang.srt.environ import envs

    assert UPSTREAM_KEEP_ALIVE_S < envs.SGLANG_TIMEOUT_KEEP_ALIVE.get() / 2
