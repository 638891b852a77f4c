"""The gateway under load: many concurrent clients, through the gateway and straight to SGLang, in one run.

Starts one SGLang CPU worker on a bundled model and a gateway process in front of it (reuse planning off, as
bench/gateway_overhead.py: this measures what the gateway adds under concurrency, not what reuse saves). For each
number of clients and each request kind (text, a repeated PNG, a PNG never sent before, a streamed answer's first
token), each path gets ``--requests`` requests (at least one per client) sent by that many clients at once, each
client sending its next request when the last one is answered, in ``--rounds`` batches, the paths taking turns
going first (a machine's drift over the run falls on each path alike). Per row:

    throughput   requests answered per second of the batches' wall time
    p50 / p99    latency per request (for streams: to the first content token, i.e. TTFT)
    gateway CPU  the gateway process's CPU time (user + system) over the batch, per request

and per (clients, kind) the gateway's throughput over direct's (over all batches, and the least and most of a
round's) and its p99 added.

    .venv/bin/python bench/load.py [--size tiny] [--clients 1 8 32 64] [--requests 64] [--rounds 1]
                                   [--image-side 224] [--kinds text "repeated png" ...] [--compare-with REF]
                                   [--profile FILE]

``--compare-with REF`` adds the gateway of commit REF (a git worktree of it) as a third path, in the same turns.

``--profile FILE`` samples the gateway process with py-spy through the measured batches (collapsed stacks to FILE)
and prints where its time went: the functions of the project's own code, and the libraries under them, by the
share of samples they are on the stack of.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import MODEL_ID, checkout, percentile, request_kinds  # noqa: E402
from bench.harness import gateway_process, scratch_store  # noqa: E402
from bundled import DEFAULT_ARCH, build_model  # noqa: E402
from launcher import WorkerSpec, start_worker  # noqa: E402
from tests.conftest import free_port  # noqa: E402

KINDS = {"text": "text only", "repeated png": "png image, repeated", "first-sight png": "png image, first sight",
         "stream TTFT": "png image, stream TTFT"}


async def one(client: httpx.AsyncClient, url: str, body: dict) -> float:
    """Seconds to the answer (a stream: to its first content token)."""
    started = time.perf_counter()
    if body.get("stream"):
        async with client.stream("POST", url, json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"content":"' in line:
                    break
    else:
        response = await client.post(url, json=body)
        response.raise_for_status()
    return time.perf_counter() - started


async def batch(url: str, build, serial, clients: int, requests: int) -> tuple[list[float], float]:
    """``requests`` requests by ``clients`` clients at once: each request's latency, and the wall time."""
    latencies: list[float] = []
    left = itertools.count()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def client_loop() -> None:
            while next(left) < requests:
                latencies.append(await one(client, url, build(next(serial))))

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(clients)))
        return latencies, time.perf_counter() - started


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def measure(args, worker_url: str, gateways: dict) -> list[dict]:
    paths = {"direct": worker_url + "/v1/chat/completions",
             **{name: gateway.url + "/v1/chat/completions" for name, gateway in gateways.items()}}
    builders = request_kinds(args.image_side)
    serial = itertools.count(1)
    processes = {name: psutil.Process(gateway.pid) for name, gateway in gateways.items()}
    for name in KINDS.values():  # warm-up: connections, caches, lazy imports
        for url in paths.values():
            await batch(url, builders[name], serial, 2, 2)
    rows = []
    for clients in args.clients:
        requests = max(args.requests, clients)
        for turn, (kind, name) in enumerate((k, n) for k, n in KINDS.items() if k in args.kinds):
            runs: dict[str, list[tuple[list[float], float, float]]] = {path: [] for path in paths}
            for round_ in range(args.rounds):  # the paths take turns going first
                first = (turn + round_) % len(paths)
                for path, url in list(paths.items())[first:] + list(paths.items())[:first]:
                    process = processes.get(path)
                    cpu = cpu_seconds(process) if process is not None else 0.0
                    latencies, wall = await batch(url, builders[name], serial, clients, requests)
                    runs[path].append((latencies, wall, cpu_seconds(process) - cpu if process is not None else 0.0))
            for path, measured in runs.items():
                latencies = [latency for run in measured for latency in run[0]]
                rows.append({"clients": clients, "kind": kind, "path": path, "requests": requests * args.rounds,
                             "throughput": requests * args.rounds / sum(run[1] for run in measured),
                             "round_throughputs": [requests / run[1] for run in measured],
                             "p50": statistics.median(latencies), "p99": percentile(latencies, 99),
                             "gateway_cpu": sum(run[2] for run in measured) / (requests * args.rounds)})
            print(f"  {clients} clients, {kind}: done", file=sys.stderr, flush=True)
    return rows


def report(rows: list[dict]) -> None:
    print(f"\n{'clients':>7} {'kind':16} {'path':20} {'req/s':>8} {'p50':>9} {'p99':>9} {'gateway CPU/req':>16}")
    for row in rows:
        cpu = f"{row['gateway_cpu'] * 1e3:14.2f}ms" if row["path"] != "direct" else f"{'':16}"
        print(f"{row['clients']:7d} {row['kind']:16} {row['path']:20} {row['throughput']:8.1f} "
              f"{row['p50'] * 1e3:7.1f}ms {row['p99'] * 1e3:7.1f}ms {cpu}")
    print(f"\n{'clients':>7} {'kind':16} {'path':20} {'throughput /direct':>18} {'by round':>16} {'p50 added':>10} "
          f"{'p99 added':>10}")
    by = {(r["clients"], r["kind"], r["path"]): r for r in rows}
    for (clients, kind, path), via in by.items():
        if path == "direct":
            continue
        direct = by[(clients, kind, "direct")]
        rounds = [v / d for v, d in zip(via["round_throughputs"], direct["round_throughputs"], strict=True)]
        spread = f"{min(rounds):.2f}-{max(rounds):.2f}x" if len(rounds) > 1 else ""
        print(f"{clients:7d} {kind:16} {path:20} {via['throughput'] / direct['throughput']:17.3f}x {spread:>16} "
              f"{(via['p50'] - direct['p50']) * 1e3:+8.1f}ms {(via['p99'] - direct['p99']) * 1e3:+8.1f}ms")


def profile_summary(collapsed: Path, top: int = 25) -> str:
    """The frames most often on the gateway's stacks (each counted once per sample), from py-spy's collapsed
    output: what the time under load went to."""
    on_stack: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        for frame in dict.fromkeys(stack.split(";")):
            on_stack[frame] = on_stack.get(frame, 0) + count
    if not total:
        return "no samples"
    lines = [f"{total} samples; frames on the stack of the most of them:"]
    for frame, count in sorted(on_stack.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"  {100 * count / total:5.1f}%  {frame}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "bench"))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--requests", type=int, default=64, help="per clients, kind and path (at least the clients)")
    parser.add_argument("--image-side", type=int, default=224)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--rounds", type=int, default=1,
                        help="batches per clients, kind and path, the paths taking turns (throughput over all of them)")
    parser.add_argument("--compare-with", metavar="REF", help="also measure the gateway of this git commit")
    parser.add_argument("--profile", type=Path, help="py-spy's collapsed stacks of the gateway go here")
    args = parser.parse_args(argv)
    model_path = build_model(DEFAULT_ARCH, args.size, on_progress=print)
    logs = Path(tempfile.mkdtemp(prefix="bench-load-"))
    worker = start_worker(WorkerSpec(model_path=model_path, port=free_port(), served_model_name=MODEL_ID,
                                     log_file=logs / "worker.log"))
    try:
        worker.wait_ready(900)
        env = {"REVISIT_MODEL": MODEL_ID, "REVISIT_WORKERS": worker.url, "REVISIT_MODEL_DIR": str(model_path),
               "REVISIT_REUSE": "0", "REVISIT_AUTH": "open",
               # the load is one caller's: the per-key limits would queue it, as they should for a tenant
               "REVISIT_ADMISSION_MAX_REQUESTS_PER_KEY": "1024", "REVISIT_ADMISSION_WORKER_REQUESTS_PER_KEY": "1024",
               **scratch_store(logs / "store", "bench-load-")}
        with contextlib.ExitStack() as running:
            gateway = running.enter_context(gateway_process(env, logs / "gateway.log"))
            gateways = {"gateway": gateway}
            if args.compare_with:  # a store of its own: an older gateway may write another entry format
                code = running.enter_context(checkout(args.compare_with, logs))
                gateways[f"gateway@{args.compare_with}"] = running.enter_context(gateway_process(
                    {**env, **scratch_store(logs / "store-compared", "bench-load-")}, logs / "gateway-compared.log",
                    code=code))
            spy = None
            if args.profile is not None:
                spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                                        str(gateway.pid), "--rate", "250", "--format", "raw", "--output",
                                        str(args.profile), "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                rows = asyncio.run(measure(args, worker.url, gateways))
            finally:
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(60)
    finally:
        worker.stop()
    print(f"model {model_path.name}, image {args.image_side}x{args.image_side}, max_completion_tokens=1, "
          f"{args.requests} requests per batch (at least one per client), {args.rounds} batch(es) per row")
    report(rows)
    if args.profile is not None:
        print(f"\nthe gateway, sampled through every batch ({args.profile}):\n{profile_summary(args.profile)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
