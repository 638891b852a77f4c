"""HTTP clients for the gateway's completions, side by side: what each costs per request to a worker that answers at
once (a null worker in a process of its own: a raw asyncio server with canned answers).

    .venv/bin/python bench/upstream_client.py [--requests 2000] [--concurrency 1 64]

Each client sends the same chat body (about 300 bytes) and reads the same answer (about 250 bytes; a stream: five
events), in turn, a batch each, for several rounds, so drift in machine load hits them alike. Per client: the
median round trip with one request at a time, and requests per second with ``--concurrency`` requests in flight.
The clients: ``httpx`` (configured as gateway/services.py configures its health checks), ``aiohttp`` (when
installed), and ``revisit`` (gateway/upstream.py, the gateway's own).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.upstream import UpstreamClient  # noqa: E402

BODY = json.dumps({"model": "m", "rid": "0123456789abcdef", "max_completion_tokens": 1,
                   "messages": [{"role": "user", "content": "Say hi to me, please. " * 8}]}).encode()
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                                  "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}).encode()
EVENT = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
STREAM = EVENT * 4 + b"data: [DONE]\n\n"


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            body = await reader.readexactly(length)
            if b'"stream":true' in body:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                             b"\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(STREAM), STREAM))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(ANSWER), ANSWER))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _null_worker(port: int, ready: multiprocessing.synchronize.Event) -> None:
    async def main() -> None:
        server = await asyncio.start_server(_answer, "127.0.0.1", port, backlog=1024)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


Send = Callable[[bytes], Awaitable[None]]
Made = tuple[Send, Callable[[], Awaitable[None]]]  # a client's send, and what closes it


async def _revisit(url: str) -> Made:
    client = UpstreamClient(connections=256, timeout_s=60, connect_timeout_s=5, keepalive_s=2.0)

    async def send(body: bytes) -> None:
        response = await client.post(url, (body,), len(body), stream=b'"stream":true' in body)
        if response.status_code != 200:
            raise RuntimeError(response.status_code)
        if b'"stream":true' in body:
            async for _ in response.lines():
                pass
        else:
            json.loads(response.content)
        await response.aclose()

    return send, client.aclose


async def _httpx(url: str) -> Made:
    import httpx

    client = httpx.AsyncClient(timeout=httpx.Timeout(60, connect=5),
                               limits=httpx.Limits(max_connections=256, max_keepalive_connections=64,
                                                   keepalive_expiry=2.0))

    async def send(body: bytes) -> None:
        headers = {"content-type": "application/json"}
        if b'"stream":true' in body:
            async with client.stream("POST", url, content=body, headers=headers) as response:
                async for _ in response.aiter_lines():
                    pass
        else:
            response = await client.post(url, content=body, headers=headers)
            response.json()

    return send, client.aclose


async def _aiohttp(url: str) -> Made:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=2.0),
                                    timeout=aiohttp.ClientTimeout(total=60, sock_connect=5))

    async def send(body: bytes) -> None:
        headers = {"content-type": "application/json"}
        async with session.post(url, data=body, headers=headers) as response:
            if b'"stream":true' in body:
                async for _ in response.content:
                    pass
            else:
                json.loads(await response.read())

    return send, session.close


def _clients() -> dict[str, Callable[[str], Awaitable[Made]]]:
    clients: dict[str, Callable[[str], Awaitable[Made]]] = {"httpx": _httpx, "revisit": _revisit}
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        pass
    else:
        clients["aiohttp"] = _aiohttp
    return clients


async def _batch(send: Send, body: bytes, requests: int, concurrency: int) -> list[float]:
    """Each request's seconds, ``concurrency`` in flight at once."""
    seconds: list[float] = []
    left = iter(range(requests))

    async def one_client() -> None:
        for _ in left:
            started = time.perf_counter()
            await send(body)
            seconds.append(time.perf_counter() - started)

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return seconds


async def measure(url: str, requests: int, concurrencies: list[int], rounds: int) -> None:
    made = {name: await make(url) for name, make in _clients().items()}
    bodies = {"plain": BODY, "stream": BODY.replace(b'"rid"', b'"stream":true,"rid"')}
    try:
        for send, _ in made.values():  # connections made, code warm
            await _batch(send, bodies["plain"], 50, 8)
        print(f"{'kind':8} {'in flight':>9} {'client':8} {'p50 round trip':>15} {'req/s':>9}")
        for kind, body in bodies.items():
            for concurrency in concurrencies:
                times: dict[str, list[float]] = {name: [] for name in made}
                walls: dict[str, float] = dict.fromkeys(made, 0.0)
                for turn in range(rounds):
                    order = list(made)[turn % len(made):] + list(made)[:turn % len(made)]
                    for name in order:
                        started = time.perf_counter()
                        times[name] += await _batch(made[name][0], body, requests // rounds, concurrency)
                        walls[name] += time.perf_counter() - started
                for name in made:
                    print(f"{kind:8} {concurrency:9d} {name:8} {statistics.median(times[name]) * 1e6:13.0f}us "
                          f"{len(times[name]) / walls[name]:9.0f}")
    finally:
        for _, close in made.values():
            await close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per client, kind and concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    from tests.conftest import free_port

    port = free_port()
    ready = multiprocessing.Event()
    worker = multiprocessing.Process(target=_null_worker, args=(port, ready), daemon=True)
    worker.start()
    try:
        if not ready.wait(30):
            raise SystemExit("the null worker did not start")
        asyncio.run(measure(f"http://127.0.0.1:{port}/v1/chat/completions", args.requests, args.concurrency,
                            args.rounds))
    finally:
        worker.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
