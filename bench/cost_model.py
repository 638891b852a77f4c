"""The gateway's cost model on a real worker: what it measured when the worker came up, what it chose per request,
and what it predicted against what each request took.

Starts one SGLang CPU worker on a bundled model and a `revisit gateway` in front of it that measures its costs and
plans by them (REVISIT_PLAN_BY_COST=1, the deployment default), waits for the calibration, then sends each case in
turn, streamed, one token, one request at a time (so each is a sample: served alone), SGLang's prefix cache flushed
before each (so that a plan's time is its own), for each image side:

    text       a text-only prompt
    miss       a new image (one pixel changed per request), exact reuse only for it (x-revisit-reuse-mode: exact)
    same       the stored image after the same text
    moved      the stored image after another preamble
    approx     the stored image with a box redrawn (a new shade each request)

Prints the calibrated costs, per request the plan the gateway chose (x-revisit-reuse) and its TTFT at the client,
and the gateway's own accounting (/admin/stats worker_costs): per reuse label, the median of predicted / measured,
each prediction made before its request became a sample.

    .venv/bin/python bench/cost_model.py [--size deep|tiny] [--sides 448 896] [--rounds 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.approximate_ttft import redrawn  # noqa: E402
from bench.harness import gateway_process, scratch_store  # noqa: E402
from bench.reuse_ttft import MODEL_ID, body, ttft, variant  # noqa: E402
from bundled import DEFAULT_ARCH, build_model  # noqa: E402
from gateway.routes.openai_api import REUSE_MODE_HEADER  # noqa: E402
from launcher import WorkerSpec, start_worker  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.images_lib import data_url, encode, small  # noqa: E402

ADMIN = "bench-admin-token"
CASES = ("text", "miss", "same", "moved", "approx")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="deep", choices=("tiny", "deep", "bench"))
    parser.add_argument("--sides", type=int, nargs="+", default=[448, 896])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    model_path = build_model(DEFAULT_ARCH, args.size, on_progress=print)
    work = Path(tempfile.mkdtemp(prefix="bench-costs-"))
    store_env = scratch_store(work, "bench-costs-")
    worker = start_worker(WorkerSpec(model_path=model_path, port=free_port(), served_model_name=MODEL_ID,
                                     log_file=work / "worker.log", env=store_env))
    client = httpx.Client(timeout=1800)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        worker.wait_ready(900)
        env = {**store_env, "REVISIT_MODEL": MODEL_ID, "REVISIT_WORKERS": worker.url,
               "REVISIT_MODEL_DIR": str(model_path), "REVISIT_ADMIN_TOKEN": ADMIN, "REVISIT_PLAN_BY_COST": "1",
               "REVISIT_HEALTH_INTERVAL_S": "3600"}  # long prefills stall /health: poll it rarely
        with gateway_process(env, work / "gateway.log") as gateway:
            started = time.monotonic()
            while True:
                stats = client.get(gateway.url + "/admin/stats", headers=admin).json()["worker_costs"]
                measured = stats["workers"].get(worker.url, {})
                if "costs" in measured:
                    break
                if "error" in (measured.get("calibration") or {}):
                    raise SystemExit(f"calibration failed: {measured['calibration']}")
                time.sleep(1)
            print(f"calibrated in {time.monotonic() - started:.0f} s: {json.dumps(measured['costs'])}", flush=True)
            for probe in measured["calibration"]["probes"]:
                print(f"  probe {json.dumps(probe['work'])}: {probe['seconds']:.3f} s", flush=True)
            run(client, gateway.url + "/v1/chat/completions", worker.url, args)
            stats = client.get(gateway.url + "/admin/stats", headers=admin).json()
    finally:
        worker.stop()
    costs = stats["worker_costs"]
    print(f"\nmodel {model_path.name}; costs after the run: {json.dumps(costs['workers'][worker.url]['costs'])}")
    print(f"plans: {json.dumps({k: v for k, v in stats['plans'].items() if v})}")
    print(f"{'ran as':18} {'requests':>8} {'predicted / measured (median)':>30} {'|error| (median)':>17}")
    for kind, row in costs["predicted"].items():
        print(f"{kind:18} {row['requests']:8d} {row['predicted_over_measured']:30.3f} {row['relative_error']:17.3f}")


def run(client: httpx.Client, url: str, worker_url: str, args) -> None:
    serial = itertools.count(1)
    for side in args.sides:
        base = small("astronaut.png", (side, side))
        seen = data_url(encode(base))
        seconds, headers = ttft(client, url, body("Look:", seen), headers={REUSE_MODE_HEADER: "exact"})
        print(f"{side}px store: {headers.get('x-revisit-reuse')} {seconds:.2f} s", flush=True)
        time.sleep(5)  # the entry is written after the answer
        for round_index in range(args.rounds):
            for case in CASES:
                extra = None
                if case == "text":
                    payload = {"model": MODEL_ID, "max_tokens": 1, "temperature": 0, "stream": True,
                               "messages": [{"role": "user", "content": f"Tell me about topic {next(serial)}."}]}
                elif case == "miss":
                    payload, extra = body("Look:", variant(base, next(serial))), {REUSE_MODE_HEADER: "exact"}
                elif case == "same":
                    payload = body("Look:", seen)
                elif case == "moved":
                    payload = body(f"Earlier topic number {next(serial)}, now this. Look:", seen)
                else:
                    payload = body("Look:", data_url(encode(redrawn(base, next(serial) * 37 % 200 + 20))))
                client.post(worker_url + "/flush_cache")  # the plan's own time, not SGLang's prefix cache's
                seconds, headers = ttft(client, url, payload, headers=extra)
                print(f"{side}px round {round_index + 1} {case:7} ran {headers.get('x-revisit-reuse') or 'plain':45} "
                      f"{seconds:7.2f} s", flush=True)


if __name__ == "__main__":
    main()
