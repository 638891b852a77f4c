"""The gateway's HTTP/1.1 client to its workers: pooled keep-alive connections on asyncio's transports, responses
parsed by httptools (the C parser uvicorn serves the gateway's own side with).

Why not a general client: a completion is one POST of a JSON body to a worker on a network the gateway trusts, and
its answer is one JSON body or one stream of server-sent events. httpx (h11 and httpcore in pure Python) took about
two thirds of the gateway's time per text request against a worker that answers at once (bench/upstream_client.py
measures the clients side by side). This client does that one exchange and nothing else: no redirects, cookies,
proxies or HTTP/2; health checks and calibration keep httpx (gateway/services.py).

Workers behind TLS (``https://`` URLs) are verified against the system's certificate authorities and certifi's,
as httpx verified them.

What the dispatcher's failure rules need to know (gateway/dispatch.py) is said by the exception raised:

- :class:`Unreachable`: refused, reset or cut before the answer ended, or an answer that is not HTTP;
- :class:`ConnectTimedOut` (an Unreachable): no connection within the connect timeout, so nothing was sent;
- :class:`AnswerTimedOut`: sent, and the answer's head, or its next piece, did not come within the timeout.

A connection taken from the pool was idle; the worker may have closed it just as the request went out (it fails
at once, with nothing answered). Such a request is sent once more on a new connection before anything is said to
fail. A connection goes back to the pool only when its answer was read to its end; a response closed before that
closes its connection, which is how SGLang learns that the client left and aborts the request.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Protocol
from urllib.parse import urlsplit

import httptools

# Bytes of an answer held unread before the connection stops reading from the socket (a stream's events are
# read as the client takes them; the worker then waits on TCP).
_READ_AHEAD = 1 << 20
_ONE_WRITE = 1 << 16  # a body up to this many bytes is written with the request's head, copied into one buffer


class TransportFailure(Exception):
    """The exchange with a worker failed below HTTP."""


class Unreachable(TransportFailure):
    """Refused, reset or cut before the answer ended, or the answer is not HTTP."""


class ConnectTimedOut(Unreachable):
    """No connection within the connect timeout: nothing was sent."""


class AnswerTimedOut(TransportFailure):
    """Sent; the answer's head, or its next piece, did not come within the timeout."""


class UpstreamResponse(Protocol):
    """A worker's answer as the dispatcher reads it (PooledResponse here; the dispatcher's tests have their own)."""

    status_code: int
    content: bytes  # the whole body, once read (always, when not a stream)

    async def aread(self) -> bytes: ...

    def lines(self) -> AsyncIterator[str]: ...

    async def aclose(self) -> None: ...


class Upstream(Protocol):
    """What sends the dispatcher's requests (UpstreamClient here)."""

    async def post(self, url: str, body: Sequence[bytes | memoryview], length: int, *,
                   stream: bool = False) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


class _Origin:
    """Where connections go: host, port, whether over TLS, and the Host header."""

    __slots__ = ("host", "port", "tls", "header")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the upstream client speaks HTTP or HTTPS to a host: {url!r}")
        self.tls = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if self.tls else 80)
        self.header = parts.netloc.encode("idna")


class _Connection(asyncio.Protocol):
    """One TCP connection and the answer being read on it (one at a time)."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False  # it answered before: a failure before this answer's first byte may be the worker's close
        self._parser = httptools.HttpResponseParser(self)
        self._writable: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.keep_alive = False
        self.started = False  # any byte of the answer came
        self.complete = False
        self.failure: TransportFailure | None = None
        self._head_done = False
        self._pieces: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (a TCP connection's transport)

    def data_received(self, data: bytes) -> None:
        self.started = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Unreachable(f"the worker's answer is not HTTP: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        if not self.complete:
            self._fail(Unreachable("the worker closed the connection before its answer ended"))
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            reason = f": {type(exc).__name__}: {exc}" if exc is not None else ""
            self._fail(Unreachable(f"the connection to the worker was lost before its answer ended{reason}"))
        self.resume_writing()  # a send waiting for room sees the connection closed

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # httptools' callbacks
    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)
        self._buffered += len(body)
        if self._buffered > _READ_AHEAD and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
        self._wake()

    # the client's side
    def _fail(self, failure: TransportFailure) -> None:
        if self.failure is None:
            self.failure = failure
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self, timeout_s: float) -> None:
        """Until the parser says more, or the connection failed; AnswerTimedOut after ``timeout_s`` (a timer that
        fails the wait: half the time of an ``asyncio.timeout``, which cancels the task and takes it back)."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        expiry = loop.call_later(timeout_s, _expire, waiter, timeout_s)
        try:
            await waiter
        finally:
            expiry.cancel()
            self._waiter = None

    async def send(self, pieces: Iterable[bytes | memoryview]) -> None:
        """Write the request, waiting whenever the socket's buffer is full (a large body is never buffered whole)."""
        self._reset()
        assert self.transport is not None
        for piece in pieces:
            if self.closed:
                raise Unreachable("the connection to the worker was lost while sending")
            self.transport.write(piece)
            if self._writable is not None and not self._writable.done():
                await self._writable
        if self.closed:
            raise Unreachable("the connection to the worker was lost while sending")

    async def head(self, timeout_s: float) -> int:
        while not self._head_done:
            if self.failure is not None:
                raise self.failure
            await self._wait(timeout_s)
        return self.status

    async def piece(self, timeout_s: float) -> bytes | None:
        """The next piece of the body; None at its end."""
        while not self._pieces:
            if self.complete:
                return None
            if self.failure is not None:
                raise self.failure
            await self._wait(timeout_s)
        piece = self._pieces.popleft()
        self._buffered -= len(piece)
        if self._paused and self._buffered <= _READ_AHEAD // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return piece

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None], timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(AnswerTimedOut(f"no answer from the worker within {timeout_s:g} s"))


class PooledResponse:
    """A worker's answer: its status, then its body whole (:meth:`aread`) or as lines (:meth:`lines`). Close it
    (:meth:`aclose`) on every path: read to its end, its connection goes back to the pool; otherwise it is closed."""

    def __init__(self, client: UpstreamClient, connection: _Connection, status_code: int) -> None:
        self._client, self._connection, self.status_code = client, connection, status_code
        self._released = False
        self.content = b""

    async def aread(self) -> bytes:
        parts = []
        while (piece := await self._connection.piece(self._client.timeout_s)) is not None:
            parts.append(piece)
        self.content = b"".join(parts)
        self._release()
        return self.content

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines without their endings (LF or CRLF), decoded as UTF-8; the last one even without one."""
        pending = bytearray()  # grown in place: a long line in many pieces is copied once, not once a piece
        while (piece := await self._connection.piece(self._client.timeout_s)) is not None:
            pending += piece
            if b"\n" not in piece:
                continue
            *complete, rest = pending.split(b"\n")
            pending = bytearray(rest)
            for line in complete:
                yield line.removesuffix(b"\r").decode("utf-8", errors="replace")
        self._release()
        if pending:
            yield pending.removesuffix(b"\r").decode("utf-8", errors="replace")

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._client._give_back(self._connection)

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._connection.close()
            self._client._gone(self._connection)


class UpstreamClient:
    """POSTs to workers over pooled keep-alive connections. ``connections``: at most this many open at once (a
    request past them waits for one, up to ``timeout_s``); ``timeout_s`` bounds the wait for an answer's head and
    for each next piece of it; ``connect_timeout_s`` a new connection; ``keepalive_s`` how long an idle connection
    is kept (less than the workers keep theirs: gateway/services.py); ``headers`` go with every request;
    ``tls``: how ``https://`` workers are verified (default: the system's authorities and certifi's)."""

    def __init__(self, *, connections: int, timeout_s: float, connect_timeout_s: float, keepalive_s: float,
                 headers: dict[str, str] | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.timeout_s, self.connect_timeout_s, self.keepalive_s = timeout_s, connect_timeout_s, keepalive_s
        self._tls = tls
        self._extra = b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in (headers or {}).items())
        self._slots = asyncio.Semaphore(connections)
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._origins: dict[str, _Origin] = {}
        self._open: set[_Connection] = set()
        self.closed = False

    async def post(self, url: str, body: Sequence[bytes | memoryview], length: int, *,
                   stream: bool = False) -> PooledResponse:
        """POST ``body`` (its pieces, ``length`` bytes in all, JSON) to ``url``. Not a stream: the answer is read
        whole before this returns (``content``)."""
        if self.closed:
            raise RuntimeError("the upstream client is closed")
        origin, path = self._origin(url)
        head = (b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
                % (path, origin.header, length, self._extra))
        # A small body goes in one write with its head (one system call); a large one in its pieces.
        pieces = (head + body[0],) if len(body) == 1 and length <= _ONE_WRITE else (head, *body)
        if self._slots.locked():  # every connection taken: wait for one (or none is waited for, nor timed)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise AnswerTimedOut(f"no connection to the workers free within {self.timeout_s:g} s") from None
        else:
            await self._slots.acquire()
        connection: _Connection | None = None
        try:
            while True:
                connection = await self._connection(origin)
                try:
                    await connection.send(pieces)
                    status = await connection.head(self.timeout_s)
                except Unreachable:
                    if connection.reused and not connection.started:
                        connection.close()  # the worker closed it as it was reused: once more on a new one
                        self._open.discard(connection)
                        continue
                    raise
                break
            response = PooledResponse(self, connection, status)
            connection = None  # the response holds it now, and the slot
            if not stream:
                try:
                    await response.aread()
                except BaseException:
                    await response.aclose()
                    raise
            return response
        except BaseException:
            if connection is not None:
                connection.close()
                self._gone(connection)
            raise

    def _origin(self, url: str) -> tuple[_Origin, bytes]:
        base, _, path = url.partition("://")[2].partition("/")
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = _Origin(url)
        return origin, b"/" + path.encode()

    async def _connection(self, origin: _Origin) -> _Connection:
        """An idle connection to ``origin`` still open and fresh, or a new one."""
        idle = self._idle.get((origin.host, origin.port))
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self.keepalive_s:
                return connection
            connection.close()
            self._open.discard(connection)
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if origin.tls else None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                transport, connection = await loop.create_connection(
                    lambda: _Connection(origin), origin.host, origin.port, ssl=tls,
                    server_hostname=origin.host if tls is not None else None)
        except TimeoutError:
            raise ConnectTimedOut(f"no connection to {origin.host}:{origin.port} within "
                                  f"{self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from exc
        connection.transport = transport  # (uvloop may call connection_made after create_connection returns)
        self._open.add(connection)
        return connection

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            import certifi

            self._tls = ssl.create_default_context()
            self._tls.load_verify_locations(certifi.where())
        return self._tls

    def _give_back(self, connection: _Connection) -> None:
        """An answer read to its end: its connection idles in the pool (if both sides keep it), its slot is free."""
        self._slots.release()
        if connection.closed or not connection.keep_alive or self.closed:
            connection.close()
            self._open.discard(connection)
            return
        connection.reused, connection.idle_since = True, time.monotonic()
        self._idle.setdefault((connection.origin.host, connection.origin.port), []).append(connection)

    def _gone(self, connection: _Connection) -> None:
        """A connection closed with its answer unread: its slot is free."""
        self._open.discard(connection)
        self._slots.release()

    async def aclose(self) -> None:
        self.closed = True
        for connection in list(self._open):
            connection.close()
        self._open.clear()
        self._idle.clear()
