"""Sending a request to a worker and relaying its answer.

Failure rules:
- a worker that cannot be reached (refused, reset), or fails before the first streamed event, is marked
  down and the request is retried on another healthy worker;
- a worker that makes no connection within the connect timeout was sent nothing: the request is retried on
  another, but the worker stays up (on loopback or a LAN that is a worker too busy to accept, its HTTP loop held
  up, not a dead one, which refuses at once): its health checks judge whether it hung;
- a worker that took the request and then timed out is not retried (it may be running it): a 502;
- a worker taken out by its health checks (hung) while a request waits for its first answer gives the request
  back, and it is retried on another healthy worker (gateway/workers.py, ``WorkerPool.until_taken_out``);
- a worker's 4xx is the client's mistake and is relayed as an OpenAI error, not retried;
- a worker that fails after events were relayed ends the stream with an error event
  (``data: {"error": ...}``) and ``data: [DONE]``: the client's half answer cannot be
  taken back, and a retry would send a second, different answer.
Upstream streams are closed on every exit path, the client going away included, which
makes SGLang abort the request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import orjson

from gateway import openai_shape
from gateway.errors import NoHealthyWorker, UpstreamClientError, UpstreamError, error_body
from gateway.json_body import LONG_STRINGS_BODY, CutURL
from gateway.offload import off_loop
from gateway.upstream import AnswerTimedOut, ConnectTimedOut, TransportFailure, Upstream, UpstreamResponse
from gateway.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
_DONE_LINE = "data: [DONE]"  # the last event of an OpenAI stream, as the worker sends it
_TAKEN_OUT = "the worker was taken out by its health checks before it answered"


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    """A request as a worker gets it: the JSON body, serialised once (off the loop when large, see
    UpstreamRequest.encode) and sent as is to every worker tried; the request id it carries; the worker's path.

    ``cut``: where the payload holds a CutURL's placeholder (gateway/json_body.py), as (offset in the payload, the
    CutURL), in order. The worker gets the payload with each placeholder replaced by the base64 it stands for, read
    from the client's body as it lies there (:meth:`build`): a large body's data URLs are never made into strings,
    nor copied into one buffer (orjson writing 27 MB of them held the GIL as long as making the string did)."""

    payload: bytes
    rid: str
    path: str = CHAT_PATH
    cut: tuple[tuple[int, CutURL], ...] = ()

    @classmethod
    async def encode(cls, body: dict[str, Any], *, size_hint: int, path: str = CHAT_PATH) -> UpstreamRequest:
        """size_hint: about how many bytes the body holds (the client's request size will do)."""
        payload, cut = await off_loop(size_hint, _encoded, body, size_hint >= LONG_STRINGS_BODY)
        return cls(payload=payload, rid=str(body["rid"]), path=path, cut=cut)

    @property
    def size(self) -> int:
        """Bytes the worker gets."""
        return len(self.payload) + sum(url.end - url.payload_start - len(url.marker) for _, url in self.cut)

    def pieces(self) -> tuple[bytes | memoryview, ...]:
        """The body the worker gets, in pieces: the payload, with each placeholder replaced by its CutURL's base64 in
        pieces of at most _PIECE bytes, views of the payload and of the client's body (nothing is copied into one
        buffer). ``size`` bytes in all."""
        if not self.cut:
            return (self.payload,)
        payload, kept, pieces = memoryview(self.payload), 0, []
        for at, url in self.cut:
            pieces.append(payload[kept:at])
            base64 = url.payload
            pieces.extend(base64[start:start + _PIECE] for start in range(0, len(base64), _PIECE))
            kept = at + len(url.marker)
        pieces.append(payload[kept:])
        return tuple(pieces)


def _encoded(body: dict[str, Any], large: bool) -> tuple[bytes, tuple[tuple[int, CutURL], ...]]:
    """The body's JSON, and where its CutURLs' placeholders are in it (only a large body has any)."""
    payload = _dumps(body)
    return payload, _placed(payload, _cut_urls(body)) if large else ()


_CONTAINERS = {dict, list, CutURL}


def _cut_urls(body: dict[str, Any]) -> list[CutURL]:
    """Every CutURL in a body (the parse leaves one for each long data URL under a "url" name, wherever it is:
    gateway/json_body.py), each once. A node holding none of them and no container is passed over by its values'
    types, at C speed (a body may hold a list of millions of numbers)."""
    found: dict[int, CutURL] = {}
    stack: list[Any] = [body]
    while stack:
        node = stack.pop()
        values = node.values() if isinstance(node, dict) else node
        if _CONTAINERS.isdisjoint(map(type, values)):
            continue
        for value in values:
            if isinstance(value, CutURL):
                found[id(value)] = value
            elif isinstance(value, dict | list):
                stack.append(value)
    return list(found.values())


def _placed(payload: bytes, urls: list[CutURL]) -> tuple[tuple[int, CutURL], ...]:
    """Where each CutURL's placeholders are in the payload (a CutURL the body holds twice is written twice)."""
    placed = []
    for url in urls:
        marker, at = url.marker.encode(), 0
        while (at := payload.find(marker, at)) >= 0:
            placed.append((at, url))
            at += len(marker)
    return tuple(sorted(placed, key=lambda item: item[0]))


_PIECE = 1 << 18  # bytes written to a worker at a time from a CutURL


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request should go and what to do once it went well."""

    prefer: str | None = None  # a worker URL to try first (cache affinity)
    public_id: str | None = None  # the id clients see (the upstream one may carry a plan)
    shape: openai_shape.Shape = openai_shape.Shape()  # the response's shape (which endpoint's, extras or not)
    on_served: Callable[[Worker], None] | None = None  # called with the worker that answered
    # Called with the worker and the seconds from sending to its first event (a stream) or its answer (not a stream)
    # when nothing else was in flight there meanwhile: a sample of its costs (gateway/calibration.py).
    on_first: Callable[[Worker, float], None] | None = None


def _dumps(body: dict[str, Any]) -> bytes:
    return orjson.dumps(body)


def _client_error(response_status: int, payload: bytes) -> UpstreamClientError:
    message, param, code = payload.decode(errors="replace")[:2000] or f"HTTP {response_status}", None, None
    try:
        parsed = json.loads(payload)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        inner: dict = error if isinstance(error, dict) else parsed
        message = str(inner.get("message") or message)
        param = inner.get("param") if isinstance(inner.get("param"), str) else None
        code = inner.get("code") if isinstance(inner.get("code"), str) else None
    return UpstreamClientError(response_status, message, param=param, code=code)


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class Dispatcher:
    """Sends completions to the pool's workers over ``upstream`` (gateway/upstream.py's client)."""

    def __init__(self, pool: WorkerPool, upstream: Upstream):
        self._pool = pool
        self._upstream = upstream

    async def aclose(self) -> None:
        await self._upstream.aclose()

    def _next(self, tried: list[Worker], last_error: str | None, prefer: str | None = None) -> Worker:
        try:
            worker = self._pool.choose(exclude=tried, prefer=prefer)
        except NoHealthyWorker:
            if last_error is not None:
                raise UpstreamError(f"every worker tried failed; last error: {last_error}") from None
            raise
        tried.append(worker)
        return worker

    async def complete(self, request: UpstreamRequest, route: Route = Route()) -> dict[str, Any]:
        """A non-streaming completion, retried on another worker when one fails."""
        tried: list[Worker] = []
        last_error: str | None = None
        while True:
            worker = self._next(tried, last_error, route.prefer)
            async with self._pool.lease(worker):
                alone, sent = worker.inflight == 1, time.perf_counter()
                with self._pool.until_taken_out(worker) as waiting:
                    try:
                        response = await self._upstream.post(worker.url + request.path, request.pieces(),
                                                             request.size)
                        alone, took = alone and worker.inflight == 1, time.perf_counter() - sent
                    except TransportFailure as exc:
                        last_error = self._not_sent(worker, exc)
                        continue
                if waiting.taken_out:
                    last_error = _TAKEN_OUT
                    continue
            if response.status_code == 200:
                _first(route, worker, took, alone)
                worker.served += 1
                try:
                    result = route.shape.completion(orjson.loads(response.content), public_id=route.public_id)
                except ValueError as exc:
                    raise UpstreamError("worker returned a body that is not JSON") from exc
                if route.on_served is not None:
                    route.on_served(worker)
                return result
            if 400 <= response.status_code < 500:
                raise _client_error(response.status_code, response.content)
            said = response.content[:300].decode(errors="replace")
            last_error = f"worker returned HTTP {response.status_code}: {said}"
            log.warning("worker %s: %s", worker.url, last_error)

    async def open_stream(self, request: UpstreamRequest, route: Route = Route()) -> AsyncIterator[bytes]:
        """Start a streaming completion and return the SSE byte stream to relay.

        Waits for the worker's first event before returning, so that any failure up to
        that point is retried on another worker and a client error still gets its
        proper HTTP status instead of a 200 stream.
        """
        tried: list[Worker] = []
        last_error: str | None = None
        while True:
            worker = self._next(tried, last_error, route.prefer)
            lease = self._pool.lease(worker)
            await lease.__aenter__()
            response: UpstreamResponse | None = None
            try:
                with self._pool.until_taken_out(worker) as waiting:
                    alone, sent = worker.inflight == 1, time.perf_counter()
                    response = await self._upstream.post(worker.url + request.path, request.pieces(), request.size,
                                                         stream=True)
                    if response.status_code != 200:
                        payload = await response.aread()
                        if 400 <= response.status_code < 500:
                            raise _client_error(response.status_code, payload)
                        last_error = f"worker returned HTTP {response.status_code}: {payload[:300]!r}"
                        raise _Retry
                    lines = response.lines()
                    first = await _first_event(lines)
                    if first is None:
                        last_error = "worker closed the stream before sending anything"
                        self._pool.mark_failed(worker, last_error)
                        raise _Retry
                    _first(route, worker, time.perf_counter() - sent, alone and worker.inflight == 1)
                if waiting.taken_out:
                    last_error = _TAKEN_OUT
                    raise _Retry
                assert response is not None and first is not None  # the block ran to its end
            except _Retry:
                await _close(response, lease)
                continue
            except TransportFailure as exc:
                await _close(response, lease)
                last_error = self._not_sent(worker, exc)
                continue
            except BaseException:
                await _close(response, lease)
                raise
            shaper = route.shape.stream(public_id=route.public_id, upstream_id=request.rid)
            relay = self._relay(worker, response, lines, first, lease, shaper, route.on_served)
            # Start the relay now: a started async generator is closed by the event loop
            # when dropped, so the lease and the upstream stream are released even if the
            # client leaves before the response body is ever iterated.
            head = await relay.__anext__()
            return _prepend(head, relay)

    def _not_sent(self, worker: Worker, exc: TransportFailure) -> str:
        """A transport failure that sends the request to another worker: what to say of it, the worker marked down
        unless it only made no connection in time (the rules above). A timeout once the request was sent raises
        UpstreamError instead: the worker may be running it, and it is not sent twice."""
        if isinstance(exc, AnswerTimedOut):
            raise UpstreamError(f"worker timed out: {exc}") from exc
        error = str(exc)
        if not isinstance(exc, ConnectTimedOut):
            self._pool.mark_failed(worker, error)
        return error

    async def _relay(self, worker: Worker, response: UpstreamResponse, lines: AsyncIterator[str], first: str, lease,
                     shaper: openai_shape.StreamShaper,
                     on_served: Callable[[Worker], None] | None) -> AsyncGenerator[bytes, None]:
        served = False

        def serve() -> None:
            nonlocal served
            served = True
            worker.served += 1
            if on_served is not None:
                on_served(worker)

        try:
            yield (shaper.line(first) + "\n\n").encode()
            async for line in lines:
                if line:
                    # Served once the worker's last event is in: a client that leaves as soon as it reads it (and
                    # so cancels the relay here) was served all the same.
                    if line.rstrip() == _DONE_LINE:
                        serve()
                    yield (shaper.line(line) + "\n\n").encode()
            if not served:
                serve()
        except TransportFailure as exc:
            message = f"the worker failed mid-stream: {exc}"
            self._pool.mark_failed(worker, message)
            yield _sse(error_body(message, "upstream_error"))
            yield _sse("[DONE]")
        finally:
            await _close(response, lease)


def _first(route: Route, worker: Worker, seconds: float, alone: bool) -> None:
    """Report the worker's time to its first event to the route, if it served this request alone (this request's
    lease was the only one in flight there when it was sent and when the event came)."""
    if route.on_first is not None and alone:
        route.on_first(worker, seconds)


class _Retry(Exception):
    pass


async def _prepend(head: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    try:
        yield head
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def _first_event(lines: AsyncIterator[str]) -> str | None:
    async for line in lines:
        if line:
            return line
    return None


async def _close(response: UpstreamResponse | None, lease) -> None:
    # Shielded: this runs while the client's disconnect is cancelling the task, and the
    # upstream connection must still be closed so the worker stops generating.
    with anyio.CancelScope(shield=True):
        if response is not None:
            await response.aclose()
        await lease.__aexit__(None, None, None)
