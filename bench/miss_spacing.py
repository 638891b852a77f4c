"""Misses back to back vs spaced out: what the worker's store write after a miss costs the requests behind it.

After a miss, the worker copies the image's K/V out of the pool and writes the entry (checksums, one shared-memory
file) on its store-writer thread, while the next request's forward runs. On a CPU worker both want the same cores.
This runs, on one worker each time, the same kind of sequence of new images (every one a miss):

    spaced        each request sent once the previous one's entry is stored (the write had the CPUs to itself)
    back to back  each request sent as soon as the previous answer came
    unstored      back to back, with plans that store nothing (no write at all)

straight to the worker (the gateway's plans in the request id) and through a gateway (which also decodes and keys
each new image; "unstored" is then a gateway with reuse off; approximate matching is off, since these images
differ by one pixel). Medians of the time to the first token, in one run.

    .venv/bin/python bench/miss_spacing.py [--size tiny] [--side 896] [--requests 12]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import gateway_process, scratch_store  # noqa: E402
from bench.reuse_ttft import MODEL_ID, body, ttft, variant  # noqa: E402
from bundled import DEFAULT_ARCH, build_model  # noqa: E402
from gateway.config import ProcessorSettings  # noqa: E402
from gateway.images import token_grid  # noqa: E402
from launcher import WorkerSpec, start_worker  # noqa: E402
from plan import MISS, PUBLIC_PLAN_KEY, ImagePlan, RequestPlan  # noqa: E402
from store import StoreConfig, open_store  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.images_lib import small  # noqa: E402

CASES = ("spaced", "back to back", "unstored")


def run(model_path: Path, args, shades, via_gateway: bool = False) -> dict[str, list[float]]:
    work = Path(tempfile.mkdtemp(prefix="bench-spacing-"))
    env = scratch_store(work, "bench-spacing-")
    worker = start_worker(WorkerSpec(model_path=model_path, port=free_port(), served_model_name=MODEL_ID,
                                     log_file=work / "worker.log", env=env))
    store = open_store(StoreConfig.from_env(env))
    g = token_grid(args.side, args.side, ProcessorSettings.from_model_dir(model_path))
    grid = (g.rows, g.cols)
    base = small("astronaut.png", (args.side, args.side))
    times: dict[str, list[float]] = {case: [] for case in CASES}
    client = httpx.Client(timeout=600)
    try:
        worker.wait_ready(900)
        for case in CASES:
            with contextlib.ExitStack() as stack:
                url = worker.url + "/v1/chat/completions"
                if via_gateway:
                    gateway_env = {**env, "REVISIT_MODEL": MODEL_ID, "REVISIT_WORKERS": worker.url,
                                   "REVISIT_MODEL_DIR": str(model_path), "REVISIT_REUSE": str(int(case != "unstored")),
                                   "REVISIT_MATCH_ENABLED": "0"}  # one pixel changed: a near-duplicate otherwise
                    gateway = stack.enter_context(gateway_process(gateway_env, work / f"gateway-{len(times)}.log"))
                    url = gateway.url + "/v1/chat/completions"
                keys: list[str] = []
                for _ in range(args.requests):
                    key = uuid.uuid4().hex * 2
                    plan = ImagePlan(key=key, kind=MISS, tokens=grid[0] * grid[1], grid=grid,
                                     store=case != "unstored")
                    rid = None if via_gateway else RequestPlan(images=(plan,)).to_rid(key[:32], key=PUBLIC_PLAN_KEY)
                    payload = body("Look:", variant(base, next(shades)), rid)
                    if case == "spaced" and keys:
                        wait_stored(store, keys[-1])
                    took, headers = ttft(client, url, payload)
                    times[case].append(took)
                    keys.append(headers.get("x-revisit-image-keys", key) if via_gateway else key)
                if case != "unstored":
                    wait_stored(store, keys[-1])  # the next case starts with no write pending
    finally:
        client.close()
        worker.stop()
        store.close()
    return times


def wait_stored(store, key: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not store.contains(key):
        if time.monotonic() > deadline:
            raise RuntimeError("the worker never stored the entry")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "bench"))
    parser.add_argument("--side", type=int, default=896)
    parser.add_argument("--requests", type=int, default=12)
    args = parser.parse_args()
    model_path = build_model(DEFAULT_ARCH, args.size, on_progress=print)
    shades = iter(range(1, 10_000))
    results = {"at the worker": run(model_path, args, shades), "through a gateway": run(model_path, args, shades, True)}
    print(f"\nmodel {model_path.name}, {args.side}px images, {args.requests} misses per case, max_tokens 1, "
          "TTFT, median (min-max)")
    print(f"{'':>18} " + " ".join(f"{case:>22}" for case in CASES) + f" {'b2b / spaced':>13}")
    for name, times in results.items():
        cells = " ".join(f"{statistics.median(v):8.3f}s ({min(v):.2f}-{max(v):.2f})" for v in times.values())
        ratio = statistics.median(times["back to back"]) / statistics.median(times["spaced"])
        print(f"{name:>18} {cells} {ratio:12.2f}x")


if __name__ == "__main__":
    main()
