"""Large request bodies and the event loop: how long the loop waits while a body is parsed on a thread.

    .venv/bin/python bench/body_lag.py [--sizes 8 28] [--repeats 5] [--through-gateway]

A thread that runs one long C call (a JSON parse of 28 MB, a 28 MB string made) holds the GIL for all of it, and
the event loop, which serves every other request and stream, waits as long. For each body (a chat request with one
PNG-sized base64 data URL of SIZE MB, and the same bytes in four images), the gateway's parse (gateway.protocol's
parse_body) runs on a thread while a task on the loop sleeps 0.5 ms again and again: the worst lag it sees (how much
later than asked it woke) and the parse's time, medians over the repeats. Side by side in one run: the body parsed
whole (as before long data URLs were cut out: gateway/json_body.py's LONG_STRINGS_BODY set past the body) and with
them cut out. This is the parse alone.

``--through-gateway``: the whole request instead, as a client sends it: a gateway in this process (uvicorn on
loopback, reuse off, its own loop-lag sampler at 1 ms: gateway/loop_lag.py) in front of a stub worker that answers
at once, and the body (real PNGs of noise, SIZE MB of base64 in one image, then in four) posted by curl from another
process; the loop's worst lag over each request, and the request's time, medians over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gateway.json_body  # noqa: E402
from gateway.protocol import parse_body  # noqa: E402

TICK_S = 0.0005


def body_of(size_mb: float, images: int) -> bytes:
    blob = base64.b64encode(os.urandom(int(size_mb * 1024 * 1024 * 3 / 4 / images))).decode()
    parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{blob}"}} for _ in range(images)]
    return json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        *parts, {"type": "text", "text": "What is in the picture?"}]}]}).encode()


async def lag_while(work) -> tuple[float, float]:
    """(worst loop lag, seconds the work took) while ``work()`` runs on a thread."""
    lags: list[float] = []
    done = False

    async def tick() -> None:
        while not done:
            asked = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append(time.perf_counter() - asked - TICK_S)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    lags.clear()
    started = time.perf_counter()
    await asyncio.to_thread(work)
    took = time.perf_counter() - started
    await asyncio.sleep(0.01)
    done = True
    await ticker
    return max(lags), took


def measure(raw: bytes, cut: bool, repeats: int) -> tuple[float, float]:
    limit = gateway.json_body.LONG_STRINGS_BODY
    gateway.json_body.LONG_STRINGS_BODY = limit if cut else 1 << 62
    try:
        runs = [asyncio.run(lag_while(lambda: parse_body(bytearray(raw)))) for _ in range(repeats)]
    finally:
        gateway.json_body.LONG_STRINGS_BODY = limit
    return statistics.median(lag for lag, _ in runs), statistics.median(took for _, took in runs)


class _StubWorker(BaseHTTPRequestHandler):
    """Answers /health, the model card and any completion at once."""

    protocol_version = "HTTP/1.1"

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._send(b'{"data":[{"id":"m","root":"m","max_model_len":32768}]}' if self.path == "/v1/models" else b"{}")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode())

    def log_message(self, *args: object) -> None:
        pass


def png_body(size_mb: float, images: int, seed: int) -> bytes:
    """A chat request with ``images`` PNGs of noise (stored uncompressed), SIZE MB of base64 in all."""
    rng = np.random.default_rng(seed)
    side = int((size_mb * 1e6 * 3 / 4 / images / 3) ** 0.5)
    parts = []
    for _ in range(images):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(out, "PNG", compress_level=0)
        parts.append({"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()}})
    return json.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
        *parts, {"type": "text", "text": "What is in the picture?"}]}]}).encode()


def through_gateway(sizes: list[float], repeats: int) -> None:
    import uvicorn

    from gateway.app import create_app
    from gateway.config import GatewayConfig, TenantSettings

    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubWorker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = GatewayConfig(model="m", workers=(f"http://127.0.0.1:{server.server_address[1]}",),
                           loop_lag_interval_s=0.001, calibrate=False, health_interval_s=0.5,
                           tenants=TenantSettings.open())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = create_app(config)
    gateway = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=gateway.run, daemon=True).start()
    while not gateway.started:
        time.sleep(0.05)
    time.sleep(1.0)  # the first health checks
    lag = app.state.services.loop_lag
    print(f"{'body, through the gateway':>32s} {'worst lag':>10s} {'request':>8s}")
    with tempfile.NamedTemporaryFile(suffix=".json") as body_file:
        for size in sizes:
            for images in (1, 4):
                runs = []
                for repeat in range(repeats):
                    Path(body_file.name).write_bytes(png_body(size, images, repeat))
                    time.sleep(0.3)
                    with lag.window():
                        started = time.perf_counter()
                        status = subprocess.run(
                            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H",
                             "content-type: application/json", "--data-binary", f"@{body_file.name}",
                             f"http://127.0.0.1:{port}/v1/chat/completions"], capture_output=True, text=True).stdout
                        took = time.perf_counter() - started
                    if status != "200":
                        raise SystemExit(f"the gateway answered HTTP {status}")
                    runs.append((lag.max_lag_s, took))
                worst, request = (statistics.median(run[i] for run in runs) for i in (0, 1))
                print(f"{Path(body_file.name).stat().st_size / 1e6:6.1f} MB, {images} image"
                      f"{'s' if images > 1 else ' '} of PNG        {1e3 * worst:7.1f} ms {1e3 * request:5.0f} ms",
                      flush=True)
    gateway.should_exit = True
    server.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[8, 28], help="MB of base64 a body holds")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--through-gateway", action="store_true", help="the whole request, not the parse alone")
    args = parser.parse_args(argv)
    if args.through_gateway:
        through_gateway(args.sizes, args.repeats)
        return 0
    print(f"{'body':>24s} {'whole: worst lag':>17s} {'parse':>8s} {'cut: worst lag':>15s} {'parse':>8s}")
    for size in args.sizes:
        for images in (1, 4):
            raw = body_of(size, images)
            whole, cut = measure(raw, False, args.repeats), measure(raw, True, args.repeats)
            print(f"{len(raw) / 1e6:6.1f} MB, {images} image{'s' if images > 1 else ' '}      "
                  f"{1e3 * whole[0]:14.1f} ms {1e3 * whole[1]:5.0f} ms {1e3 * cut[0]:12.1f} ms {1e3 * cut[1]:5.0f} ms",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
