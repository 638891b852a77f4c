"""Time to first token of an approximate hit, side by side with a miss and a decoder-only prefill.

Starts one SGLang CPU worker on a bundled model over a private store, stores an image (the alias), then, per
image size, rounds alternate (order rotating) requests sent straight to the worker:

    miss        a new image (one pixel changed per request): vision tower + full prefill
    llm         the seen image again, SGLang's encoder cache holding its encoder output and its prefix cache
                flushed: the decoder's full prefill alone (sent as the alias was, under an unstored miss's plan
                without a scope, so the encoder cache keys it as it keyed the alias: a request without a plan is
                keyed by its own id and shares nothing)
    approx/full     a near-duplicate (the alias with a box redrawn, a new shade each request, so that no cache of
                    the worker holds it) under the gateway's approximate plan with the full vision pass
    approx/partial  the same with the partial vision pass (the tower over the redrawn tokens and their margin);
                    as the gateway plans it, it leaves a derived entry (its K/V, stored after the forward)
    approx/partial, no entry
                    the same, leaving nothing (the plan's ``derive`` off): what storing the derived entry costs
    exact on derived
                    right after each approx/partial, once its derived entry is stored: the same image and prompt
                    again, an exact hit on that entry (what the image's next sight costs)

The plans are the gateway's own (its default pixel features, settings and selector; --selector picks another).
Prints p50 TTFT per case and its ratio to the miss and to llm, and the bytes each approximate hit reads from the
store against its alias' whole entry.

    .venv/bin/python bench/approximate_ttft.py [--size deep|bench|tiny] [--sides 896 1344] [--rounds 3]
        [--selector NAME]

896 px is 1,024 image tokens and 1344 px 2,304 on Qwen2.5-VL (bench/reuse_ttft.py says why not more on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import scratch_store  # noqa: E402
from bench.reuse_ttft import MODEL_ID, body, ttft, variant  # noqa: E402
from bundled import DEFAULT_ARCH, build_model  # noqa: E402
from engine_ext.selection import DEVIATION, score_kind  # noqa: E402
from gateway.config import MatchSettings, ProcessorSettings  # noqa: E402
from gateway.images import token_grid  # noqa: E402
from gateway.matching.pixel import PixelExtractor  # noqa: E402
from gateway.matching.plans import plan_against  # noqa: E402
from launcher import WorkerSpec, start_worker  # noqa: E402
from plan import EXACT, FULL_PASS, MISS, PARTIAL_PASS, PUBLIC_PLAN_KEY, ImagePlan, RequestPlan  # noqa: E402
from plan.checkpoint import text_layers  # noqa: E402
from store import StoreConfig, open_store  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.images_lib import data_url, encode, small  # noqa: E402

ROTATED = ("miss", "llm", "approx/full", "approx/partial", "approx/partial, no entry")
CASES = (*ROTATED, "exact on derived")
CELL = 28


def redrawn(base: Image.Image, shade: int) -> Image.Image:
    """The alias with a box (about 4 x 8 tokens) redrawn in a shade of its own."""
    out = base.copy()
    x, y = base.width // 3, base.height // 2
    ImageDraw.Draw(out).rectangle((x, y, x + 8 * CELL - 5, y + 4 * CELL - 5), fill=(shade, 40, 255 - shade))
    return out


def rid(*plans: ImagePlan) -> str:
    return RequestPlan(images=plans).to_rid(uuid.uuid4().hex, key=PUBLIC_PLAN_KEY)


def plan_for(alias_key: str, base: Image.Image, image: Image.Image, grid: tuple[int, int], selector: str,
             layers: int) -> ImagePlan:
    extractor = PixelExtractor()
    new, old = extractor.extract(image, grid, CELL), extractor.extract(base, grid, CELL)
    plan = plan_against(new, old, alias=alias_key, key=uuid.uuid4().hex * 2, settings=MatchSettings(),
                        selector=selector, layers=layers)
    if plan is None:
        raise RuntimeError("the guard planned a miss: the redrawn box is too large for this image")
    return plan


def wait_stored(store, key: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.contains(key):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker never stored {key[:16]}")
        time.sleep(0.05)


def read_share(plan: ImagePlan, layers: int) -> float:
    """The share of the alias entry's K/V bytes the plan reads: its candidates' layers from the first one read."""
    first = 0 if score_kind(plan) == DEVIATION else plan.warmup_layers
    alias_tokens = (plan.alias_grid or plan.grid)[0] * (plan.alias_grid or plan.grid)[1]
    return len(plan.reuse) * (layers - first) / (alias_tokens * layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="deep", choices=("tiny", "bench", "deep"))
    parser.add_argument("--sides", type=int, nargs="+", default=[896, 1344])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--selector", default=MatchSettings().selector)
    args = parser.parse_args()

    model_path = build_model(DEFAULT_ARCH, args.size, on_progress=print)
    layers = text_layers(model_path)
    assert layers is not None
    work = Path(tempfile.mkdtemp(prefix="bench-approx-"))
    store_env = scratch_store(work, "bench-approx-")
    worker = start_worker(WorkerSpec(model_path=model_path, port=free_port(), served_model_name=MODEL_ID,
                                     log_file=work / "worker.log", env=store_env))
    processor = ProcessorSettings.from_model_dir(model_path)
    store = open_store(StoreConfig.from_env(store_env))
    client = httpx.Client(timeout=1800)
    url = worker.url + "/v1/chat/completions"
    shades = itertools.count(1)
    report = []
    try:
        worker.wait_ready(900)
        for side in args.sides:
            base = small("astronaut.png", (side, side))
            seen = data_url(encode(base))
            g = token_grid(side, side, processor)
            grid = (g.rows, g.cols)
            alias = uuid.uuid4().hex * 2
            ttft(client, url, body("Look:", seen, rid(ImagePlan(key=alias, kind=MISS, tokens=grid[0] * grid[1],
                                                                 grid=grid))))
            wait_stored(store, alias)
            times: dict[str, list[float]] = {case: [] for case in CASES}
            shares: list[float] = []
            changed: list[float] = []
            for round_index in range(args.rounds):
                order = ROTATED[round_index % len(ROTATED):] + ROTATED[: round_index % len(ROTATED)]
                for case in order:
                    httpx.post(worker.url + "/flush_cache", timeout=60)
                    if case == "miss":
                        payload = body("Look:", variant(base, next(shades)))
                    elif case == "llm":
                        payload = body("Look:", seen, rid(ImagePlan(key=alias, kind=MISS, tokens=grid[0] * grid[1],
                                                                    grid=grid, store=False)))
                    else:
                        image = redrawn(base, next(shades) % 200 + 20)
                        plan = dataclasses.replace(plan_for(alias, base, image, grid, args.selector, layers),
                                                   vision=FULL_PASS if case == "approx/full" else PARTIAL_PASS,
                                                   derive=case != "approx/partial, no entry")
                        shares.append(read_share(plan, layers))
                        changed.append(1 - plan.change_map.count("=") / plan.tokens)
                        payload = body("Look:", data_url(encode(image)), rid(plan))
                    seconds, _ = ttft(client, url, payload)
                    times[case].append(seconds)
                    if case == "approx/partial":
                        wait_stored(store, plan.key)
                        httpx.post(worker.url + "/flush_cache", timeout=60)
                        exact = ImagePlan(key=plan.key, kind=EXACT, tokens=plan.tokens, grid=plan.grid)
                        seconds, _ = ttft(client, url, body("Look:", data_url(encode(image)), rid(exact)))
                        times["exact on derived"].append(seconds)
                print(f"  {side}px round {round_index + 1}/{args.rounds} done", flush=True)
            report.append((side, grid[0] * grid[1], times, shares, changed))
            print_table(side, grid[0] * grid[1], times, shares, changed)
    finally:
        worker.stop()
    log = (work / "worker.log").read_text()
    print(f"\nmodel {model_path.name}, {layers} layers, selector {args.selector}, max_tokens=1, worker-side streamed "
          f"TTFT p50 over {args.rounds} rounds, SGLang prefix cache flushed before each request; the worker ran "
          f"{log.count('revisit: approximate hit')} approximate hits and "
          f"{log.count('partial vision pass for')} partial vision passes")
    for row in report:
        print_table(*row)


def print_table(side: int, tokens: int, times: dict, shares: list[float], changed: list[float]) -> None:
    p50 = {case: statistics.median(values) for case, values in times.items()}
    print(f"{'image':>14} {'case':25} {'TTFT':>9} {'x miss':>7} {'x llm':>6}", flush=True)
    for case in CASES:
        print(f"{side}px/{tokens:>5}t {case:25} {p50[case]:8.2f}s {p50[case] / p50['miss']:6.3f}x "
              f"{p50[case] / p50['llm']:5.2f}x", flush=True)
    print(f"  changed or similar tokens {100 * statistics.mean(changed):.1f}%; an approximate hit reads "
          f"{100 * statistics.mean(shares):.1f}% of its alias entry's K/V bytes (sparse, late layers only)",
          flush=True)


if __name__ == "__main__":
    main()
