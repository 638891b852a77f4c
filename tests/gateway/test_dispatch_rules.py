"""The dispatcher's failure rules (gateway/dispatch.py's docstring), each on its own, with an in-process transport
(httpx.MockTransport, behind an Upstream that says httpx's failures as gateway/upstream.py says them) standing in
for the workers: what a worker does to a request is one function of the request, so every way of failing is exact
and immediate. The same rules with real workers: tests/gateway/test_dispatch.py (loopback HTTP workers that hang,
on the gateway's own client), tests/gateway/test_upstream.py (which failure that client says, on real sockets) and
the soak (SGLang workers killed, hung and restarted)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from gateway.dispatch import Dispatcher, Route, UpstreamRequest
from gateway.errors import UpstreamClientError, UpstreamError
from gateway.upstream import AnswerTimedOut, ConnectTimedOut, TransportFailure, Unreachable
from gateway.workers import WorkerPool

A, B = "http://worker-a", "http://worker-b"
Behaviour = Callable[[httpx.Request], httpx.Response]


def chunk(name: str) -> bytes:
    event = {"id": "r1", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": name}}]}
    return f"data: {json.dumps(event)}\n\n".encode()


def answers(name: str) -> Behaviour:
    """A worker that answers at once, plainly or streamed, with its name as the content."""

    def behaviour(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, content=chunk(name) + b"data: [DONE]\n\n",
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"id": "r1", "object": "chat.completion", "created": 0, "model": "m",
                                         "choices": [{"index": 0, "finish_reason": "stop",
                                                      "message": {"role": "assistant", "content": name}}]})
    return behaviour


def raises(error: type[httpx.TransportError]) -> Behaviour:
    def behaviour(request: httpx.Request) -> httpx.Response:
        raise error("as told", request=request)
    return behaviour


class Events(httpx.AsyncByteStream):
    """A streamed body that yields ``events``, then raises ``then`` (if any); records whether it was closed."""

    def __init__(self, events: list[bytes], then: Exception | None = None, wait: bool = False) -> None:
        self.events, self.then, self.wait, self.closed = events, then, wait, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield event
        if self.then is not None:
            raise self.then
        if self.wait:  # a worker still generating: the client must leave, or the test ends it
            import asyncio

            await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed = True


class Workers:
    """Two workers, A and B, whose completions go to ``behaviours`` (by worker URL); /health answers 200. Records
    which worker each completion went to."""

    def __init__(self, a: Behaviour, b: Behaviour) -> None:
        self.behaviours = {A: a, B: b}
        self.sent: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        worker = f"{request.url.scheme}://{request.url.host}"
        if request.method == "GET":
            return httpx.Response(200, json={} if request.url.path != "/health" else None)
        self.sent.append(worker)
        return self.behaviours[worker](request)


def _said(exc: httpx.TransportError) -> TransportFailure:
    """httpx's failure as the gateway's client says it."""
    said = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, httpx.ConnectTimeout):
        return ConnectTimedOut(said)
    return AnswerTimedOut(said) if isinstance(exc, httpx.TimeoutException) else Unreachable(said)


class MockResponse:
    def __init__(self, response: httpx.Response) -> None:
        self.response, self.status_code, self.content = response, response.status_code, b""

    async def aread(self) -> bytes:
        self.content = await self.response.aread()
        return self.content

    async def lines(self) -> AsyncIterator[str]:
        try:
            async for line in self.response.aiter_lines():
                yield line
        except httpx.TransportError as exc:
            raise _said(exc) from exc

    async def aclose(self) -> None:
        await self.response.aclose()


class MockUpstream:
    """The dispatcher's Upstream on an httpx client (gateway.upstream.Upstream)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post(self, url: str, body, length: int, *, stream: bool = False) -> MockResponse:
        content = b"".join(bytes(piece) for piece in body)
        assert len(content) == length
        try:
            response = MockResponse(await self.client.send(self.client.build_request("POST", url, content=content),
                                                           stream=stream))
        except httpx.TransportError as exc:
            raise _said(exc) from exc
        if not stream:
            response.content = response.response.content
        return response

    async def aclose(self) -> None:
        await self.client.aclose()


@contextlib.asynccontextmanager
async def dispatcher(workers: Workers) -> AsyncIterator[tuple[Dispatcher, WorkerPool]]:
    """A dispatcher over a pool of A and B (both found healthy), closed when the block ends."""
    client = httpx.AsyncClient(transport=httpx.MockTransport(workers.handle))
    pool = WorkerPool([A, B], client, interval_s=60, timeout_s=1)
    await pool.start()
    try:
        assert all(w.healthy for w in pool.workers)
        yield Dispatcher(pool, MockUpstream(client)), pool
    finally:
        await pool.stop()
        await client.aclose()


def request(stream: bool = False) -> UpstreamRequest:
    body = {"rid": "r1", "model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    return UpstreamRequest(payload=json.dumps(body).encode(), rid="r1")


async def ask(dispatcher: Dispatcher, stream: bool) -> str:
    """The content that answered a request preferring A."""
    if not stream:
        answer = await dispatcher.complete(request(), Route(prefer=A))
        return answer["choices"][0]["message"]["content"]
    events = await dispatcher.open_stream(request(stream=True), Route(prefer=A))
    text = b"".join([event async for event in events]).decode()
    return json.loads(text.split("\n\n")[0].removeprefix("data: "))["choices"][0]["delta"]["content"]


def health(pool: WorkerPool) -> dict[str, bool]:
    return {w.url: w.healthy for w in pool.workers}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("failure", [httpx.ConnectError, httpx.RemoteProtocolError])
async def test_a_worker_that_cannot_be_reached_is_marked_down_and_another_answers(failure, stream):
    workers = Workers(raises(failure), answers("B"))
    async with dispatcher(workers) as (dispatch, pool):
        assert await ask(dispatch, stream) == "B"
        assert workers.sent == [A, B] and health(pool) == {A: False, B: True}
        assert failure.__name__ in pool.workers[0].last_error
        assert [w.inflight for w in pool.workers] == [0, 0]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_no_connection_in_time_sends_the_request_to_another_and_leaves_the_worker_to_its_checks(stream):
    """A worker too busy to accept a connection (its HTTP loop held up) is alive: marking it down would leave no
    worker at all when the others are down too."""
    workers = Workers(raises(httpx.ConnectTimeout), answers("B"))
    async with dispatcher(workers) as (dispatch, pool):
        assert await ask(dispatch, stream) == "B"
        assert workers.sent == [A, B] and health(pool) == {A: True, B: True}
        workers.behaviours[B] = raises(httpx.ConnectError)  # B dies, A still accepts nothing
        with pytest.raises(UpstreamError, match="every worker tried failed; last error: ConnectError"):
            await ask(dispatch, stream)
        assert health(pool) == {A: True, B: False}
        workers.behaviours[A] = answers("A")  # A's loop is free again: it answers, as its checks would find
        assert await ask(dispatch, stream) == "A"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("failure", [httpx.ReadTimeout, httpx.WriteTimeout])
async def test_a_worker_that_times_out_once_sent_the_request_is_not_sent_it_again(failure, stream):
    workers = Workers(raises(failure), answers("B"))
    async with dispatcher(workers) as (dispatch, pool):
        with pytest.raises(UpstreamError, match=f"worker timed out: {failure.__name__}"):
            await ask(dispatch, stream)
        assert workers.sent == [A] and health(pool) == {A: True, B: True}
        assert [w.inflight for w in pool.workers] == [0, 0]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_server_error_is_retried_on_another_worker(stream):
    workers = Workers(lambda r: httpx.Response(503, text="overloaded"), answers("B"))
    async with dispatcher(workers) as (dispatch, pool):
        assert await ask(dispatch, stream) == "B"
        assert workers.sent == [A, B]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_client_error_is_relayed_as_it_came_and_not_retried(stream):
    error = {"error": {"message": "prompt is too long", "param": "messages", "code": "context_length_exceeded"}}
    workers = Workers(lambda r: httpx.Response(400, json=error), answers("B"))
    async with dispatcher(workers) as (dispatch, pool):
        with pytest.raises(UpstreamClientError) as info:
            await ask(dispatch, stream)
        assert (info.value.status_code, str(info.value), info.value.param, info.value.code) == \
            (400, "prompt is too long", "messages", "context_length_exceeded")
        assert workers.sent == [A] and health(pool) == {A: True, B: True}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_when_every_worker_fails_the_last_error_is_said(stream):
    workers = Workers(raises(httpx.ConnectError), lambda r: httpx.Response(500, text="engine died"))
    async with dispatcher(workers) as (dispatch, pool):
        with pytest.raises(UpstreamError, match="every worker tried failed; last error: worker returned HTTP 500"):
            await ask(dispatch, stream)
        assert workers.sent == [A, B]


async def test_a_stream_closed_before_its_first_event_is_retried_and_its_worker_marked_down():
    empty = Events([])
    workers = Workers(lambda r: httpx.Response(200, stream=empty), answers("B"))
    async with dispatcher(workers) as (dispatch, pool):
        assert await ask(dispatch, stream=True) == "B"
        assert workers.sent == [A, B] and health(pool) == {A: False, B: True} and empty.closed


async def test_a_stream_that_fails_after_its_first_event_ends_with_an_error_event_and_is_not_retried():
    failing = Events([chunk("A")], then=httpx.ReadError("connection reset"))
    workers = Workers(lambda r: httpx.Response(200, stream=failing), answers("B"))
    async with dispatcher(workers) as (dispatch, pool):
        events = await dispatch.open_stream(request(stream=True), Route(prefer=A))
        text = b"".join([event async for event in events]).decode()
        first, error, done, _ = text.split("\n\n")
        assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["content"] == "A"
        assert json.loads(error.removeprefix("data: "))["error"]["message"] == \
            "the worker failed mid-stream: ReadError: connection reset"
        assert done == "data: [DONE]"
        assert workers.sent == [A] and health(pool) == {A: False, B: True} and failing.closed
        assert [w.inflight for w in pool.workers] == [0, 0]


async def test_a_client_that_leaves_mid_stream_closes_the_workers_stream():
    endless = Events([chunk("A"), chunk("A")], wait=True)
    workers = Workers(lambda r: httpx.Response(200, stream=endless), answers("B"))
    async with dispatcher(workers) as (dispatch, pool):
        events = await dispatch.open_stream(request(stream=True), Route(prefer=A))
        assert b'"content":"A"' in await events.__anext__()
        assert pool.workers[0].inflight == 1
        await events.aclose()  # the client went away (Starlette closes the body iterator)
        assert endless.closed and [w.inflight for w in pool.workers] == [0, 0]
        assert health(pool) == {A: True, B: True}  # the client left: nothing the worker did wrong


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_large_bodys_data_urls_reach_the_worker_as_the_client_wrote_them(stream):
    """The parse leaves a part's long data URL in the client's body (a CutURL); the worker gets the JSON it stands
    for, byte for byte, with its length declared, and again on a retry."""
    import base64
    import os

    import orjson

    from gateway.json_body import CutURL, decode_json, full_text

    blobs = [base64.b64encode(os.urandom(n)).decode() for n in (3 << 20, 200_000)]
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{blobs[0]}"}},
               {"type": "text", "text": "and"},
               {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{blobs[1]}"}}]
    body = decode_json(json.dumps({"rid": "r1", "model": "m", "stream": stream,
                                   "messages": [{"role": "user", "content": content}],
                                   "elsewhere": [{"url": f"data:text/plain;base64,{blobs[1]}"}]}).encode())
    parts = body["messages"][0]["content"]
    assert isinstance(parts[0]["image_url"]["url"], CutURL) and isinstance(parts[2]["video_url"]["url"], CutURL)
    assert isinstance(body["elsewhere"][0]["url"], CutURL)  # a long data URL under any "url" name
    request = await UpstreamRequest.encode(body, size_hint=4 << 20)
    received: list[bytes] = []

    def keep(behaviour: Behaviour):
        async def kept(sent: httpx.Request) -> httpx.Response:
            received.append(await sent.aread())
            assert sent.headers["content-length"] == str(len(received[-1]))
            return behaviour(sent)
        return kept

    workers = Workers(keep(lambda r: httpx.Response(503)), keep(answers("B")))
    async with dispatcher(workers) as (dispatch, pool):
        assert await ask_with(dispatch, request, stream) == "B"
        assert received == [orjson.dumps(full_text(body))] * 2 and request.size == len(received[0])


async def ask_with(dispatcher: Dispatcher, upstream: UpstreamRequest, stream: bool) -> str:
    if not stream:
        return (await dispatcher.complete(upstream, Route(prefer=A)))["choices"][0]["message"]["content"]
    text = b"".join([event async for event in await dispatcher.open_stream(upstream, Route(prefer=A))]).decode()
    return json.loads(text.split("\n\n")[0].removeprefix("data: "))["choices"][0]["delta"]["content"]
