"""The gateway's client to its workers (gateway/upstream.py) on real loopback sockets: answers read whole and as
lines however they are framed and cut, connections kept and reused, a connection the worker closed as it was
reused, and each failure said as the dispatcher's rules need it (refused, no connection in time, cut, timed out,
not HTTP)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest

from gateway.dispatch import UpstreamRequest
from gateway.json_body import decode_json, full_text
from gateway.upstream import AnswerTimedOut, ConnectTimedOut, Unreachable, UpstreamClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


class Server:
    """A loopback HTTP server whose connections go to ``handler``; counts connections, and whether each ended."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.connections, self.ended = handler, 0, 0
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.ended += 1


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Server]:
    server = Server(handler)
    listening = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
    try:
        yield server
    finally:
        listening.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    line, *fields = head[:-4].split(b"\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (f.partition(b":") for f in fields)}
    return line, headers, await reader.readexactly(int(headers[b"content-length"]))


def answer(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status.encode(), len(body), extra, body)


async def echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
    """Answers every request on the connection with its request line and body's digest, kept alive."""
    while True:
        line, headers, body = await read_request(reader)
        writer.write(answer(json.dumps({"line": line.decode(), "sha": hashlib.sha256(body).hexdigest(),
                                        "auth": headers.get(b"authorization", b"").decode()}).encode()))
        await writer.drain()


def client(**overrides) -> UpstreamClient:
    settings = {"connections": 8, "timeout_s": 5.0, "connect_timeout_s": 1.0, "keepalive_s": 2.0} | overrides
    return UpstreamClient(**settings)


@contextlib.asynccontextmanager
async def connected(handler: Handler, **overrides) -> AsyncIterator[tuple[Server, UpstreamClient]]:
    """A server on ``handler`` and a client (``overrides`` to its settings), the client closed when the block ends."""
    async with serving(handler) as server:
        upstream = client(**overrides)
        try:
            yield server, upstream
        finally:
            await upstream.aclose()


async def post(upstream: UpstreamClient, url: str, payload: bytes = b"{}", stream: bool = False):
    return await upstream.post(url + "/v1/chat/completions", (payload,), len(payload), stream=stream)


async def test_answers_are_read_whole_and_connections_kept_for_the_next_request():
    async with connected(echo_forever, headers={"Authorization": "Bearer k"}) as (server, upstream):
        for n in range(3):
            payload = json.dumps({"n": n}).encode()
            response = await post(upstream, server.url, payload)
            echoed = json.loads(response.content)
            assert response.status_code == 200
            assert echoed == {"line": "POST /v1/chat/completions HTTP/1.1",
                              "sha": hashlib.sha256(payload).hexdigest(), "auth": "Bearer k"}
            await response.aclose()  # read already: a no-op
    assert server.connections == 1


async def test_a_body_in_pieces_reaches_the_worker_byte_for_byte():
    """A large body's data URLs are sent from the client's body as it lies (views, never joined): what arrives is
    the JSON the body stands for, with its length declared."""
    blob = base64.b64encode(os.urandom(3 << 20)).decode()
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{blob}"}}]
    body = decode_json(json.dumps({"rid": "r1", "model": "m",
                                   "messages": [{"role": "user", "content": content}]}).encode())
    request = await UpstreamRequest.encode(body, size_hint=4 << 20)
    assert len(request.pieces()) > 3
    async with connected(echo_forever) as (server, upstream):
        response = await upstream.post(server.url + request.path, request.pieces(), request.size)
    assert json.loads(response.content)["sha"] == hashlib.sha256(orjson.dumps(full_text(body))).hexdigest()


async def test_a_stream_is_read_as_lines_however_it_is_framed_and_cut():
    long_line = "x" * 300_000
    events = (b"data: one\n\n" + f"data: {long_line}\r\n\r\n".encode() + b"data: [DONE]\n\n" + b"last, unended")

    async def chunked(reader, writer, server):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for start in range(0, len(events), 7001):
            piece = events[start:start + 7001]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client closes the connection

    async with connected(chunked) as (server, upstream):
        response = await post(upstream, server.url, stream=True)
        lines = [line async for line in response.lines()]
        await response.aclose()
    assert lines == ["data: one", "", f"data: {long_line}", "", "data: [DONE]", "", "last, unended"]


async def test_a_response_closed_before_its_end_closes_its_connection_and_frees_its_slot():
    """How SGLang learns that the client left: the connection closes."""
    left = asyncio.Event()

    async def endless(reader, writer, server):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"b\r\ndata: one\n\n\r\n")
        await writer.drain()
        await reader.read()  # EOF: the client left
        left.set()

    async with connected(endless, connections=1, timeout_s=1.0) as (server, upstream):
        response = await post(upstream, server.url, stream=True)
        lines = response.lines()
        assert await lines.__anext__() == "data: one"
        await response.aclose()
        await asyncio.wait_for(left.wait(), 5)
        second = await post(upstream, server.url, stream=True)  # the one slot is free again
        await second.aclose()
    assert server.connections == 2


async def test_a_connection_the_worker_closed_as_it_was_reused_is_sent_again_on_a_new_one():
    async def once_per_connection(reader, writer, server):
        await read_request(reader)
        writer.write(answer(b'{"n": %d}' % server.connections))
        await writer.drain()
        await read_request(reader)  # the next request on it arrives: closed without a word (its idle timeout hit)

    async with connected(once_per_connection) as (server, upstream):
        first = await post(upstream, server.url)
        second = await post(upstream, server.url)
    assert (json.loads(first.content), json.loads(second.content)) == ({"n": 1}, {"n": 2})


async def test_an_idle_connection_past_its_keepalive_is_not_reused():
    async with connected(echo_forever, keepalive_s=0.0) as (server, upstream):  # any idle time is past it
        await post(upstream, server.url)
        await post(upstream, server.url)
    assert server.connections == 2


async def test_a_refused_connection_is_unreachable():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        upstream = client()
        with pytest.raises(Unreachable, match="ConnectionRefusedError") as info:
            await post(upstream, f"http://127.0.0.1:{port}")
        assert not isinstance(info.value, ConnectTimedOut)
        await upstream.aclose()


async def test_no_connection_within_the_connect_timeout_is_said_as_such():
    """A listener whose accept queue is full (a worker whose HTTP loop accepts nothing) drops new connections'
    handshakes: the connection is not made in time, and nothing was sent."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        queued = []
        while True:  # fill the accept queue (connections not yet taken by accept()) until one is not answered
            held = socket.socket()
            held.settimeout(0.5)
            queued.append(held)
            try:
                held.connect(address)
            except TimeoutError:
                break
        upstream = client(connect_timeout_s=0.5)
        try:
            with pytest.raises(ConnectTimedOut, match="no connection"):
                await post(upstream, f"http://127.0.0.1:{address[1]}")
        finally:
            await upstream.aclose()
            for held in queued:
                held.close()


@pytest.mark.parametrize("when", ["before its head", "mid-body"])
async def test_a_connection_cut_before_the_answer_ended_is_unreachable(when):
    async def cut(reader, writer, server):
        await read_request(reader)
        if when == "mid-body":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"half\":")
            await writer.drain()

    async with connected(cut) as (server, upstream):
        with pytest.raises(Unreachable, match="before its answer ended"):
            await post(upstream, server.url)


async def test_an_answer_that_does_not_come_in_time_times_out_and_its_connection_is_closed():
    gone = asyncio.Event()

    async def silent(reader, writer, server):
        await read_request(reader)
        await reader.read()  # nothing said; EOF when the client gives up
        gone.set()

    async with connected(silent, timeout_s=0.3) as (server, upstream):
        with pytest.raises(AnswerTimedOut, match="no answer from the worker within 0.3 s"):
            await post(upstream, server.url)
        await asyncio.wait_for(gone.wait(), 5)


async def test_an_answer_that_is_not_http_is_unreachable():
    async def garbage(reader, writer, server):
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with connected(garbage) as (server, upstream):
        with pytest.raises(Unreachable, match="not HTTP"):
            await post(upstream, server.url)


async def test_requests_past_the_connections_wait_for_one_and_time_out_as_answers_do():
    async def streaming(reader, writer, server):
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"b\r\ndata: one\n\n\r\n0\r\n\r\n")
            await writer.drain()

    async with connected(streaming, connections=1, timeout_s=0.3) as (server, upstream):
        first = await post(upstream, server.url, stream=True)  # holds the one connection until read or closed
        with pytest.raises(AnswerTimedOut, match="no connection to the workers free"):
            await post(upstream, server.url, stream=True)
        assert [line async for line in first.lines()] == ["data: one", ""]
        second = await post(upstream, server.url, stream=True)  # the slot given back, the connection kept
        await second.aclose()
    assert server.connections == 1


async def test_an_answer_larger_than_the_read_ahead_is_read_whole_when_read_slowly():
    big = os.urandom(3 << 20)

    async def large(reader, writer, server):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)
        await writer.drain()
        await reader.read()

    async with connected(large) as (server, upstream):
        response = await post(upstream, server.url, stream=True)
        connection = response._connection
        async with asyncio.timeout(5):
            while not connection._paused:  # past the read-ahead, unread: the socket is no longer read
                await asyncio.sleep(0.01)
        read = await response.aread()
    assert read == big


@pytest.fixture
def certificate(tmp_path):
    """A self-signed certificate for 127.0.0.1, and its key."""
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=worker",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


async def test_a_worker_behind_tls_is_verified_and_answers(certificate):
    import ssl

    cert, key = certificate
    served = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    served.load_cert_chain(cert, key)
    listening = await asyncio.start_server(lambda r, w: echo_forever(r, w, None), "127.0.0.1", 0, ssl=served)
    url = f"https://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
    try:
        trusting = client(tls=ssl.create_default_context(cafile=str(cert)))
        try:
            assert (await post(trusting, url)).status_code == 200
        finally:
            await trusting.aclose()
        default = client()  # the system's and certifi's authorities: a self-signed certificate is refused
        try:
            with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
                await post(default, url)
        finally:
            await default.aclose()
    finally:
        listening.close()
