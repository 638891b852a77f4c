"""Large request bodies and the event loop: how long the loop waits while a body is parsed on a thread.

    .venv/bin/python bench/body_lag.py [--sizes 8 28] [--repeats 5]

A thread that runs one long C call (a JSON parse of 28 MB, a 28 MB string made) holds the GIL for all of it, and
the event loop, which serves every other request and stream, waits as long. For each body (a chat request with one
PNG-sized base64 data URL of SIZE MB, and the same bytes in four images), the gateway's parse (gateway.protocol's
parse_body) runs on a thread while a task on the loop sleeps 0.5 ms again and again: the worst lag it sees (how much
later than asked it woke) and the parse's time, medians over the repeats. Side by side in one run: the body parsed
whole (as before long data URLs were cut out: gateway/json_body.py's LONG_STRINGS_BODY set past the body) and with
them cut out. The rest of intake (base64 decoding, hashing, the image's decode) is sliced or releases the GIL
already; this is the parse alone.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import time
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[8, 28], help="MB of base64 a body holds")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
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
