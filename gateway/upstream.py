"""The HTTP client completions go to the workers on: aiohttp, whose response parsing is C (llhttp) and whose
connection pool is a dict of idle connections per host.

Chosen by measurement: one request at a time to a worker that answers at once (a null upstream), httpx took 675 us
a round trip and aiohttp 271 us on the same loop (uvloop, 2-core machine), and httpx was on the stack of a third of
the gateway's samples for text requests (its HTTP/1.1 parsing is h11, pure Python). Health checks, metrics reads and
calibration keep httpx (gateway/workers.py, gateway/calibration.py): they are few and off the request path.

Errors come out as this module's own: ``SendTimedOut`` (no answer, or no next chunk, within the upstream timeout)
and ``SendFailed`` (the connection refused, not made within the connect timeout, reset or cut), so the dispatcher's
rules (gateway/dispatch.py) do not depend on the library: a worker that cannot be reached is tried no more, and the
request goes to another.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import aiohttp

_JSON = {"Content-Type": "application/json"}


class SendFailed(Exception):
    """The worker could not be reached, or the connection broke. ``cause``: the library's name for what happened."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


class SendTimedOut(SendFailed):
    """No connection, answer or next chunk within its timeout."""


def _failure(exc: BaseException) -> SendFailed:
    cause = type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # no connection made, so nothing sent: as if refused
        return SendFailed(f"{cause}: no connection within the connect timeout", cause)
    if isinstance(exc, TimeoutError):  # (aiohttp's own timeouts are ClientErrors too: checked first)
        return SendTimedOut(cause, cause)
    return SendFailed(f"{cause}: {exc}", cause)


class UpstreamStream:
    """A streamed answer: its status, its body read whole (an error's), or its lines as they come."""

    def __init__(self, response: aiohttp.ClientResponse):
        self._response = response
        self.status = response.status

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _failure(exc) from exc

    async def lines(self) -> AsyncIterator[str]:
        """Each line without its ending (\n or \r\n), as the worker sends it; an SSE event's blank line too. A line
        may be of any length (aiohttp's own readline refuses one past its buffer's high-water mark)."""
        chunks = self._response.content.iter_any()
        pending: list[bytes] = []  # the pieces of a line not yet ended
        while True:
            try:
                chunk = await anext(chunks, None)
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise _failure(exc) from exc
            if chunk is None:
                break
            if b"\n" not in chunk:
                pending.append(chunk)
                continue
            first, *complete, last = chunk.split(b"\n")
            for line in (b"".join([*pending, first]), *complete):
                yield line.decode(errors="replace").removesuffix("\r")
            pending = [last] if last else []
        if pending:
            yield b"".join(pending).decode(errors="replace").removesuffix("\r")

    async def aclose(self) -> None:
        """Give the connection back when the answer was read to its end; close it otherwise, which makes SGLang
        abort the request (the client left, or the relay failed)."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class UpstreamClient:
    """Pooled keep-alive connections to the workers. ``timeout_s`` bounds the wait for an answer and the gap between
    two streamed chunks; ``connect_timeout_s`` a new connection. The session is made on the running loop at first
    use (aiohttp binds it to a loop)."""

    def __init__(self, *, connections: int, timeout_s: float, connect_timeout_s: float, keepalive_s: float,
                 headers: Mapping[str, str] | None = None):
        self._connections = connections
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_connect=connect_timeout_s,
                                              sock_read=timeout_s)
        self._keepalive_s = keepalive_s
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._connections, keepalive_timeout=self._keepalive_s,
                                             use_dns_cache=True)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, headers=self._headers,
                                                  auto_decompress=True, skip_auto_headers=("User-Agent",))
        return self._session

    async def post(self, url: str, payload: bytes) -> tuple[int, bytes]:
        """A whole answer: its status and body."""
        try:
            async with self._open().post(url, data=payload, headers=_JSON) as response:
                return response.status, await response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _failure(exc) from exc

    async def open(self, url: str, payload: bytes) -> UpstreamStream:
        """A streamed answer, once its status and headers are in; the caller closes it (UpstreamStream.aclose)."""
        try:
            response = await self._open().post(url, data=payload, headers=_JSON)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _failure(exc) from exc
        return UpstreamStream(response)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
