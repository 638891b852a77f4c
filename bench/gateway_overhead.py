"""Gateway overhead: the same requests straight to SGLang and through the gateway, side by side.

Starts one SGLang CPU worker on a bundled model and a gateway process in front of it,
then sends each request twice in alternation (direct, gateway, direct, gateway, ...),
so drift in machine load hits both paths alike. Prints p50/p95 latency per request
kind and path, the overhead, worker start time and peak memory.

    .venv/bin/python bench/gateway_overhead.py [--size tiny|bench] [--rounds 30]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import gateway_process  # noqa: E402
from bundled import DEFAULT_ARCH, build_model  # noqa: E402
from launcher import WorkerSpec, start_worker  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.images_lib import data_url, encode, small  # noqa: E402

MODEL_ID = "bench-model"




def tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        return 0


class PeakRss:
    def __init__(self, pid: int):
        self.pid, self.peak = pid, 0

    def sample(self) -> None:
        self.peak = max(self.peak, tree_rss(self.pid))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def request_kinds(size: int) -> dict[str, Callable[[int], dict]]:
    """Request builders by kind; each takes a serial number (distinct per call)."""
    photo, page = small("coffee.png", (size, size)), small("astronaut.png", (size, size))
    png, jpeg = data_url(encode(page)), data_url(encode(photo, "JPEG", quality=90), "image/jpeg")

    def variant(image, serial: int, fmt: str) -> str:
        # A picture never sent before: one pixel differs, so no cache anywhere knows it.
        fresh = image.copy()
        fresh.putpixel((serial % size, serial // size % size), (serial % 251, 7, 11))
        return data_url(encode(fresh, fmt, **({"quality": 90} if fmt == "JPEG" else {})),
                        "image/jpeg" if fmt == "JPEG" else "image/png")

    def body(*parts: dict, stream: bool = False) -> dict:
        return {"model": MODEL_ID, "messages": [{"role": "user", "content": list(parts)}],
                "max_completion_tokens": 1, "temperature": 0, "stream": stream}

    def image(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    text = {"type": "text", "text": "Describe the picture in one word."}
    return {
        "text only": lambda n: body(text),
        "png image, repeated": lambda n: body(image(png), text),
        "jpeg image, repeated": lambda n: body(image(jpeg), text),
        "png image, stream TTFT": lambda n: body(image(png), text, stream=True),
        "png image, first sight": lambda n: body(image(variant(page, n, "PNG")), text),
        "jpeg image, first sight": lambda n: body(image(variant(photo, n, "JPEG")), text),
    }


def timed(client: httpx.Client, url: str, body: dict) -> float:
    started = time.perf_counter()
    if body.get("stream"):
        with client.stream("POST", url, json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: {") and '"content":"' in line:
                    break  # first token
    else:
        response = client.post(url, json=body)
        response.raise_for_status()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "bench"))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--image-side", type=int, default=224)
    args = parser.parse_args()

    model_path = build_model(DEFAULT_ARCH, args.size, on_progress=print)
    logs = Path(tempfile.mkdtemp(prefix="bench-"))
    worker_port = free_port()
    started = time.monotonic()
    worker = start_worker(WorkerSpec(model_path=model_path, port=worker_port, served_model_name=MODEL_ID,
                                     log_file=logs / "worker.log"))
    try:
        worker.wait_ready(900)
        worker_start_s = time.monotonic() - started
        # Reuse planning off: this measures what the gateway adds, not what reuse saves (bench/reuse_ttft.py).
        env = {"REVISIT_MODEL": MODEL_ID, "REVISIT_WORKERS": worker.url, "REVISIT_MODEL_DIR": str(model_path),
               "REVISIT_REUSE": "0"}
        with gateway_process(env, logs / "gateway.log") as gateway:
            measure(args, model_path.name, worker, gateway, worker_start_s)
    finally:
        worker.stop()


def measure(args, model_name: str, worker, gateway, worker_start_s: float) -> None:
    worker_peak, gateway_peak = PeakRss(worker.pid), PeakRss(gateway.pid)
    paths = {"direct": worker.url + "/v1/chat/completions", "gateway": gateway.url + "/v1/chat/completions"}
    kinds = request_kinds(args.image_side)
    results: dict[tuple[str, str], list[float]] = {(k, p): [] for k in kinds for p in paths}
    with httpx.Client(timeout=300) as client:
        serial = itertools.count(1)
        for build in kinds.values():  # warm-up: caches, connections, lazy imports
            for url in paths.values():
                timed(client, url, build(next(serial)))
        for round_index in range(args.rounds):
            for kind, build in kinds.items():
                order = list(paths.items()) if round_index % 2 == 0 else list(paths.items())[::-1]
                for name, url in order:
                    results[(kind, name)].append(timed(client, url, build(next(serial))))
            worker_peak.sample()
            gateway_peak.sample()

    print(f"\nmodel {model_name}, {args.rounds} rounds, image {args.image_side}x{args.image_side}, "
          f"max_completion_tokens=1, sequential, alternating paths")
    print(f"{'request':26} {'direct p50':>11} {'gateway p50':>12} {'direct p95':>11} {'gateway p95':>12}"
          f" {'overhead p50':>13} {'ratio p50':>10}")
    for kind in kinds:
        direct, via = results[(kind, "direct")], results[(kind, "gateway")]
        d50, g50 = statistics.median(direct), statistics.median(via)
        print(f"{kind:26} {d50 * 1e3:9.1f}ms {g50 * 1e3:10.1f}ms {percentile(direct, 95) * 1e3:9.1f}ms "
              f"{percentile(via, 95) * 1e3:10.1f}ms {(g50 - d50) * 1e3:+11.1f}ms {g50 / d50:9.3f}x")
    print(f"\nworker start to /health 200: {worker_start_s:.1f} s")
    print(f"peak RSS: worker process tree {worker_peak.peak / 2**30:.2f} GiB, "
          f"gateway {gateway_peak.peak / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
