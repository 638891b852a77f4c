"""The response cache's latency section (bench/response_cache.py latency): a gateway with the response cache in
front of one SGLang CPU worker; end-to-end times of a miss, a KV-reuse hit and a response-cache hit at each level,
side by side in one run, and the lookup cost per level inside the gateway (its histogram in /metrics).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bundled import build_model

# Paraphrases of "What is shown in this picture?" (cosines 0.87 to 0.98 with all-MiniLM-L6-v2), one per round.
PARAPHRASES = ("What does this picture show?", "What is shown in this image?", "What is in this picture?",
               "What is being shown in this picture?", "What exactly is shown in this picture?")
SIMILAR_WORDINGS = ("What is shown on this picture?", "What is shown here in this picture?",
                    "What is shown in this picture?", "What is shown in the picture?", "What is shown in this image?")


def latency(args: argparse.Namespace) -> int:
    import httpx

    from bench.harness import gateway_process, scratch_store
    from bundled import DEFAULT_ARCH
    from launcher import WorkerSpec, start_worker
    from tests.conftest import free_port
    from tests.images_lib import data_url, encode, small

    model_path = build_model(DEFAULT_ARCH, args.size, on_progress=print)
    work = Path(tempfile.mkdtemp(prefix="bench-responses-"))
    store_env = scratch_store(work, "bench-responses-")
    model_id = "revisit-bench"
    worker = start_worker(WorkerSpec(model_path=model_path, port=free_port(), served_model_name=model_id,
                                     log_file=work / "worker.log", env=store_env))
    pictures = ["astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "motorcycle_left.png",
                "hubble_deep_field.jpg", "immunohistochemistry.png", "retina.jpg", "logo.png", "page.png", "text.png",
                "camera.png"]
    side = args.side
    times: dict[str, list[float]] = defaultdict(list)
    try:
        worker.wait_ready(900)
        env = {**store_env, "REVISIT_MODEL": model_id, "REVISIT_WORKERS": worker.url,
               "REVISIT_MODEL_DIR": str(model_path), "REVISIT_RESPONSE_CACHE_NAMESPACES": "*",
               "REVISIT_HEALTH_INTERVAL_S": "3600", "REVISIT_ADMIN_TOKEN": "bench-response-cache"}
        with gateway_process(env, work / "gateway.log", timeout_s=120) as gateway, \
                httpx.Client(base_url=gateway.url, timeout=600) as client:
            admin = {"Authorization": "Bearer bench-response-cache"}
            while client.get("/admin/stats", headers=admin).json()["response_cache"]["embedder"] != "ready":
                time.sleep(0.2)  # until then the paraphrase and similar levels are skipped

            def timed(kind: str, image_url: str, text: str, level: str | None, expect: str) -> None:
                body = {"model": model_id, "temperature": 0, "max_tokens": args.max_tokens,
                        "messages": [{"role": "user", "content": [
                            {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": text}]}]}
                headers = {"Authorization": "Bearer sk-bench", **({"x-revisit-response-cache": level} if level else {})}
                started = time.perf_counter()
                response = client.post("/v1/chat/completions", json=body, headers=headers)
                elapsed = time.perf_counter() - started
                response.raise_for_status()
                got = response.headers.get("x-revisit-response-cache") or response.headers.get("x-revisit-reuse", "")
                if not got.startswith(expect):
                    raise SystemExit(f"{kind}: expected {expect}, the gateway said {got!r}")
                times[kind].append(elapsed)

            for round_ in range(args.rounds):
                name = pictures[round_ % len(pictures)]
                picture = small(name, (side, side)).rotate(round_ * 7)  # a new image each round
                png = data_url(encode(picture))
                jpeg = data_url(encode(picture, "JPEG", quality=95), "image/jpeg")
                timed("miss", png, "What is shown in this picture?", "similar", "miss")
                timed("kv_reuse_hit (exact_same_prefix)", png, "Which colours dominate?", None, "exact_same_prefix")
                timed("response_cache exact", png, "What is shown in this picture?", "similar", "exact")
                # A wording not seen before each round: the lookup embeds it (the embedder remembers known ones).
                timed("response_cache paraphrase", png, PARAPHRASES[round_ % len(PARAPHRASES)], "similar",
                      "paraphrase")
                timed("response_cache similar", jpeg, SIMILAR_WORDINGS[round_ % len(SIMILAR_WORDINGS)], "similar",
                      "similar")
            metrics = client.get("/metrics").text
    finally:
        worker.stop()
    miss = statistics.median(times["miss"])
    print(f"\nmodel {model_path.name}, {side} x {side} images, max_tokens={args.max_tokens}, {args.rounds} rounds, "
          "end-to-end non-streamed request time, p50:")
    for kind, values in times.items():
        p50 = statistics.median(values)
        print(f"  {kind:36} {1000 * p50:9.1f} ms   {p50 / miss:6.3f}x of a miss")
    print("\nlookup cost inside the gateway (revisit_response_cache_lookup_seconds, mean):")
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, dict[str, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(metrics):
        if family.name == "revisit_response_cache_lookup_seconds":
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):
                    sums[sample.labels["level"]][sample.name.rsplit("_", 1)[1]] = sample.value
    for level, figures in sums.items():
        if figures.get("count"):
            print(f"  {level:12} {1e6 * figures['sum'] / figures['count']:10.1f} us over {int(figures['count'])}")
    return 0
