"""Gateway overhead: the same requests straight to SGLang and through the gateway, side by side.

Starts one SGLang CPU worker on a bundled model and a gateway process in front of it,
then sends each request twice in alternation (direct, gateway, direct, gateway, ...),
so drift in machine load hits both paths alike. Prints p50/p95 latency per request
kind and path, the overhead (the p50s' difference, and ``paired``: the median of each
round's gateway minus direct, which drift between rounds moves less), worker start
time and peak memory.

    .venv/bin/python bench/gateway_overhead.py [--size tiny|bench] [--rounds 30] [--compare-with REF]

``--compare-with REF`` adds a third path: the gateway of commit REF (a git worktree of it, made for the run), in
the same alternation, so that a change's cost is measured side by side with what it replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import gateway_process, scratch_store  # noqa: E402
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
    parser.add_argument("--compare-with", metavar="REF", help="also measure the gateway of this git commit")
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
        # Open mode: one caller with no key, as a proxy measured beside it would be called.
        env = {"REVISIT_MODEL": MODEL_ID, "REVISIT_WORKERS": worker.url, "REVISIT_MODEL_DIR": str(model_path),
               "REVISIT_REUSE": "0", "REVISIT_AUTH": "open"}
        with contextlib.ExitStack() as running:
            gateways = {"gateway": running.enter_context(gateway_process(
                {**env, **scratch_store(logs / "store", "bench-overhead-")}, logs / "gateway.log"))}
            if args.compare_with:  # a store of its own: an older gateway may write another entry format
                code = running.enter_context(checkout(args.compare_with, logs))
                gateways[f"gateway@{args.compare_with}"] = running.enter_context(gateway_process(
                    {**env, **scratch_store(logs / "store-compared", "bench-overhead-")},
                    logs / "gateway-compared.log", code=code))
            measure(args, model_path.name, worker, gateways, worker_start_s)
    finally:
        worker.stop()


@contextlib.contextmanager
def checkout(ref: str, work: Path) -> Iterator[Path]:
    """A detached git worktree of ``ref`` for the length of the block."""
    folder = work / "compared"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(folder), ref], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)], check=False)


def measure(args, model_name: str, worker, gateways: dict, worker_start_s: float) -> None:
    worker_peak = PeakRss(worker.pid)
    gateway_peaks = {name: PeakRss(gateway.pid) for name, gateway in gateways.items()}
    paths = {"direct": worker.url + "/v1/chat/completions",
             **{name: gateway.url + "/v1/chat/completions" for name, gateway in gateways.items()}}
    kinds = request_kinds(args.image_side)
    results: dict[tuple[str, str], list[float]] = {(k, p): [] for k in kinds for p in paths}
    with httpx.Client(timeout=300) as client:
        serial = itertools.count(1)
        for build in kinds.values():  # warm-up: caches, connections, lazy imports
            for url in paths.values():
                timed(client, url, build(next(serial)))
        for round_index in range(args.rounds):
            for kind, build in kinds.items():
                order = list(paths.items())
                order = order[round_index % len(order):] + order[:round_index % len(order)]  # each path first in turn
                for name, url in order:
                    results[(kind, name)].append(timed(client, url, build(next(serial))))
            worker_peak.sample()
            for peak in gateway_peaks.values():
                peak.sample()

    print(f"\nmodel {model_name}, {args.rounds} rounds, image {args.image_side}x{args.image_side}, "
          f"max_completion_tokens=1, sequential, alternating paths")
    for gateway in gateways:
        print(f"\n{gateway}:")
        print(f"{'request':26} {'direct p50':>11} {'gateway p50':>12} {'direct p95':>11} {'gateway p95':>12}"
              f" {'overhead p50':>13} {'paired':>8} {'ratio p50':>10}")
        for kind in kinds:
            direct, via = results[(kind, "direct")], results[(kind, gateway)]
            d50, g50 = statistics.median(direct), statistics.median(via)
            paired = statistics.median(g - d for g, d in zip(via, direct, strict=True))
            print(f"{kind:26} {d50 * 1e3:9.1f}ms {g50 * 1e3:10.1f}ms {percentile(direct, 95) * 1e3:9.1f}ms "
                  f"{percentile(via, 95) * 1e3:10.1f}ms {(g50 - d50) * 1e3:+11.1f}ms {paired * 1e3:+6.1f}ms "
                  f"{g50 / d50:9.3f}x")
    print(f"\nworker start to /health 200: {worker_start_s:.1f} s")
    print(f"peak RSS: worker process tree {worker_peak.peak / 2**30:.2f} GiB, " + ", ".join(
        f"{name} {peak.peak / 2**20:.0f} MiB" for name, peak in gateway_peaks.items()))


if __name__ == "__main__":
    main()
