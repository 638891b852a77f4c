"""Time to first token: a miss vs an exact same-prefix hit vs a position-independent hit, side by side.

Starts one SGLang CPU worker on a bundled model and a gateway in front of it, both on a private store. For each
image size, rounds alternate the three cases (the order rotates every round), each measured twice:

    gateway  streamed through the gateway, which plans from the store (what a client sees)
    worker   the same request sent straight to the worker with the same plan in its request id (the worker's
             own time, without the gateway)

    plain      an image never seen (one pixel changed per request) with no plan: what plain SGLang does (through
               the gateway with reuse off for the request; at the worker without a plan)
    miss       an image never seen: vision tower + full prefill, and the entry stored after it (through the gateway
               planned as a miss; at the worker under a miss plan of a fresh key)
    llm        the seen image as a miss whose encoder output SGLang still caches: the decoder's full prefill
               alone (through the gateway with reuse off for the request, x-revisit-reuse-mode: off, so the same
               namespace's encoder cache entry serves it; at the worker under an unstored miss's plan without a
               scope, warmed once: a request without a plan is keyed by its own id and shares nothing)
    same       the seen image after the same text: encoder output and all image KV reused
    moved      the seen image after a different preamble: keys moved, uniform r = --ratio recomputed per layer
    text       the same preamble and question without the image: the text-only prefill, an exact hit's floor but
               for the read (through the gateway and at the worker alike: there is nothing to plan)

SGLang's own prefix cache is emptied before every request (POST /flush_cache), so the same-prefix case measures
this project's reuse, not SGLang's radix cache. Prints p50 TTFT per case and its ratio to the miss, to the
decoder-only prefill (llm) and to the text-only prefill (text).

    .venv/bin/python bench/reuse_ttft.py [--size deep|bench|tiny] [--sides 896 1344] [--rounds 3] [--ratio 0.05]

896 px is 1,024 image tokens and 1344 px 2,304 on Qwen2.5-VL. 1792 px (4,096 tokens) does not fit a 24 GiB CPU
host: SGLang's CPU vision attention materialises the full-attention blocks' score matrices (16 heads x 16,384
patches squared) and the worker was killed at 21.7 GB RSS.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import gateway_process, scratch_store  # noqa: E402
from bundled import DEFAULT_ARCH, build_model  # noqa: E402
from gateway.config import ProcessorSettings  # noqa: E402
from gateway.images import token_grid  # noqa: E402
from gateway.routes.openai_api import REUSE_MODE_HEADER  # noqa: E402
from launcher import WorkerSpec, start_worker  # noqa: E402
from plan import EXACT, MISS, PUBLIC_PLAN_KEY, ImagePlan, RequestPlan  # noqa: E402
from plan.checkpoint import text_layers  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.images_lib import data_url, encode, small  # noqa: E402

MODEL_ID = "bench-model"
QUESTION = "Describe the picture in one word."
CASES = ("plain", "miss", "llm", "same", "moved", "text")


def body(preamble: str, url: str | None, rid: str | None = None) -> dict:
    """A streamed one-token request: preamble, the image (None: none), the question."""
    image = [{"type": "image_url", "image_url": {"url": url}}] if url is not None else []
    content = [{"type": "text", "text": preamble}, *image, {"type": "text", "text": QUESTION}]
    out = {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
           "temperature": 0, "stream": True}
    if rid:
        out["rid"] = rid
    return out


def variant(base, n: int) -> str:
    """The image with one pixel changed: never seen by any cache."""
    image = base.copy()
    image.putpixel((n % image.width, n // image.width % image.height), (n % 251, 3, 5))
    return data_url(encode(image))


def exact_rid(key: str, grid: tuple[int, int], ratios: tuple[float, ...]) -> str:
    plan = ImagePlan(key=key, kind=EXACT, tokens=grid[0] * grid[1], grid=grid, ratios=ratios)
    return RequestPlan(images=(plan,)).to_rid(uuid.uuid4().hex, key=PUBLIC_PLAN_KEY)


def stored_miss_rid(grid: tuple[int, int]) -> str:
    """A miss plan under a key never used: the worker computes the image and stores its entry."""
    plan = ImagePlan(key=uuid.uuid4().hex * 2, kind=MISS, tokens=grid[0] * grid[1], grid=grid)
    return RequestPlan(images=(plan,)).to_rid(uuid.uuid4().hex, key=PUBLIC_PLAN_KEY)


def ttft(client: httpx.Client, url: str, payload: dict, api_key: str = "sk-bench",
         headers: dict[str, str] | None = None) -> tuple[float, httpx.Headers]:
    started = time.perf_counter()
    with client.stream("POST", url, json=payload,
                       headers={"Authorization": f"Bearer {api_key}", **(headers or {})}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                return time.perf_counter() - started, response.headers
    raise RuntimeError("the stream ended without a token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="deep", choices=("tiny", "bench", "deep"))
    parser.add_argument("--sides", type=int, nargs="+", default=[896, 1344], help="square image sides in pixels")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.05, help="recompute ratio of the moved case")
    args = parser.parse_args()

    model_path = build_model(DEFAULT_ARCH, args.size, on_progress=print)
    layers = text_layers(model_path)
    if layers is None:
        raise SystemExit(f"{model_path}/config.json names no layer count")
    work = Path(tempfile.mkdtemp(prefix="bench-reuse-"))
    store_env = scratch_store(work, "bench-reuse-")
    worker = start_worker(WorkerSpec(model_path=model_path, port=free_port(), served_model_name=MODEL_ID,
                                     log_file=work / "worker.log", env=store_env))
    try:
        worker.wait_ready(900)
        env = {**store_env, "REVISIT_MODEL": MODEL_ID, "REVISIT_WORKERS": worker.url,
               "REVISIT_MODEL_DIR": str(model_path), "REVISIT_RECOMPUTE_RATIO": str(args.ratio),
               # The bench also sends long prefills straight to the worker, which stall its /health for the
               # gateway (it has nothing in flight there): poll rarely, so the worker is not taken out.
               "REVISIT_HEALTH_INTERVAL_S": "3600"}
        with gateway_process(env, work / "gateway.log") as gateway:
            report = measure(args, worker, gateway.url, layers, store_env,
                             ProcessorSettings.from_model_dir(model_path))
    finally:
        worker.stop()
    print(f"\nmodel {model_path.name}, {layers} layers, max_tokens=1, streamed TTFT p50 over {args.rounds} "
          f"rounds, moved case r={args.ratio} at every layer, SGLang prefix cache flushed before each request")
    for side, tokens, times in report:
        print_table(side, tokens, times)


def print_table(side: int, tokens: int, times: dict) -> None:
    """Each case's p50, and its ratio to the miss, to the decoder-only prefill (llm) and to the text-only prefill
    (text), per side of the gateway."""
    print(f"{'image':>14} {'case':6} {'gateway':>10} {'x miss':>7} {'x llm':>6} {'x text':>6} {'worker':>10} "
          f"{'x miss':>7} {'x llm':>6} {'x text':>6}", flush=True)
    p50 = {(case, p): statistics.median(times[(case, p)]) for case in CASES for p in ("gateway", "worker")}
    for case in CASES:
        row = [f"{side}px/{tokens:>5}t {case:6}"]
        for p in ("gateway", "worker"):
            t = p50[(case, p)]
            row.append(f"{t:9.2f}s {t / p50[('miss', p)]:6.3f}x {t / p50[('llm', p)]:5.2f}x "
                       f"{t / p50[('text', p)]:5.2f}x")
        print(" ".join(row), flush=True)


def measure(args, worker, gateway_url: str, layers: int, store_env: dict[str, str], processor) -> list:
    client = httpx.Client(timeout=1800)
    serial = itertools.count()
    report = []
    for side in args.sides:
        base = small("astronaut.png", (side, side))
        seen = data_url(encode(base))

        # Make the entry, and learn its key and grid from the gateway.
        _, headers = ttft(client, gateway_url + "/v1/chat/completions", body("Look:", seen))
        key = headers["x-revisit-image-keys"]
        grid = token_grid(side, side, processor)
        rows, cols = grid.rows, grid.cols
        deadline = time.monotonic() + 300
        while not any(Path(store_env["REVISIT_STORE_DRAM_DIR"]).glob(f"{key}.kv")):
            if time.monotonic() > deadline:
                raise RuntimeError("the worker never stored the entry")
            time.sleep(0.2)

        # The worker-side llm case's plan: an unstored miss without a scope, so SGLang's encoder cache keys the image
        # by its pixels alone; seen once here, so its encoder output is cached.
        unstored = RequestPlan(images=(ImagePlan(key=key, kind=MISS, tokens=rows * cols, grid=(rows, cols),
                                                 store=False),)).to_rid(uuid.uuid4().hex, key=PUBLIC_PLAN_KEY)
        ttft(client, worker.url + "/v1/chat/completions", body("Look:", seen, unstored))

        times: dict[tuple[str, str], list[float]] = {(c, p): [] for c in CASES for p in ("gateway", "worker")}
        for round_index in range(args.rounds):
            shift = round_index % len(CASES)
            order = CASES[shift:] + CASES[:shift]
            for case in order:
                preamble = "Look:" if case != "moved" else f"Earlier topic number {round_index}, now this. Look:"
                for path in ("gateway", "worker"):
                    httpx.post(worker.url + "/flush_cache", timeout=60)
                    if path == "gateway":
                        url, payload = gateway_url + "/v1/chat/completions", body(
                            preamble, variant(base, next(serial)) if case == "miss" else seen)
                    else:
                        ratios = () if case == "same" else (args.ratio,) * layers
                        rid = None if case in ("plain", "text") else stored_miss_rid((rows, cols)) \
                            if case == "miss" else unstored if case == "llm" else exact_rid(key, (rows, cols), ratios)
                        url, payload = worker.url + "/v1/chat/completions", body(
                            preamble, variant(base, next(serial)) if case in ("plain", "miss") else seen, rid)
                    if case == "plain" and path == "gateway":
                        payload = body(preamble, variant(base, next(serial)))
                    if case == "text":
                        payload = body(preamble, None)
                    # Through the gateway, a miss's image (one pixel changed) is a near-duplicate of the stored one:
                    # exact reuse only, so that it is planned as the miss it is.
                    mode = {"llm": "off", "plain": "off", "miss": "exact"}.get(case) if path == "gateway" else None
                    seconds, headers = ttft(client, url, payload, headers={REUSE_MODE_HEADER: mode} if mode else None)
                    expected = {"plain": None, "llm": None, "miss": "miss", "same": "exact_same_prefix",
                                "moved": "exact_moved", "text": None}[case]  # plain, llm, text: nothing planned
                    if path == "gateway":
                        assert headers.get("x-revisit-reuse") == expected, (case, headers.get("x-revisit-reuse"))
                    times[(case, path)].append(seconds)
            print(f"  {side}px round {round_index + 1}/{args.rounds} done", flush=True)
        report.append((side, rows * cols, times))
        print_table(side, rows * cols, times)  # as soon as measured: a later size may not finish

    return report


if __name__ == "__main__":
    main()
