"""Answer quality of videos whose temporal patches were planned, on recordings of the oracle's panels, against plain
SGLang's answers to the same recordings.

    .venv/bin/python bench/video_quality.py [--panels 40]

One SGLang CPU worker on the oracle (the reader whose answers come from late-layer image KV, bundled's ``oracle``)
and a gateway in front of it (REVISIT_VIDEO_REUSE_PATCHES and REVISIT_VIDEO_MATCH_PATCHES on, every plan sent), on
a store of the bench's own. Per panel (of at least two fields, drawn on a white canvas of 12 x 12 tokens so that
SGLang's video resize keeps it on the token grid the oracle reads):

    A         a recording of the panel, 4 frames (2 temporal patches), coded losslessly: each patch stored
    edited    a recording of the panel with one field given another value: a near-duplicate of A's patches
    resent    A's recording coded again at CRF 32: every pixel a little off

Each of edited and resent is asked one question about a field, twice in turn, by two tenants of one gateway: one
planned (its patches approximate against A's, as x-revisit-video-patches says), one with ``x-revisit-reuse-mode:
off`` (plain SGLang). Fields asked: edited, the changed field (right = its new value, stale = A's) and a field A and
the edit share; resent, any field. SGLang's prefix cache is emptied before each request. Printed: right answers
per case and field, planned vs plain, and the stale answers.
"""

from __future__ import annotations

import argparse
import base64
import random
import sys
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import worker_and_gateway  # noqa: E402
from bench.video_windows import encode as lossy  # noqa: E402
from bundled import QWEN2_5_VL, build_model  # noqa: E402
from bundled.reader.panels import CELL, Panel, random_panel  # noqa: E402
from bundled.reader.panels import changed as revalue  # noqa: E402
from bundled.reader.questions import field  # noqa: E402
from gateway.routes.openai_api import REUSE_MODE_HEADER  # noqa: E402
from tests.videos_lib import encode_video  # noqa: E402

MODEL_ID = "bench-oracle"
CANVAS = 12 * CELL  # 144 tokens a patch: within SGLang's video bounds (128-768), so not resized
FRAMES, FPS, RESENT_CRF = 4, 2, 32


def frames_of(panel: Panel) -> list[np.ndarray]:
    canvas = Image.new("RGB", (CANVAS, CANVAS), panel.background)
    canvas.paste(panel.render(), (0, 0))
    return [np.asarray(canvas)] * FRAMES


def ask(client: httpx.Client, url: str, video: bytes, question: str, tenant: str) -> tuple[str, str]:
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(video).decode()}}
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": [part, {"type": "text", "text": question}]}],
            "max_tokens": 1, "temperature": 0}
    response = client.post(url, json=body, headers={"Authorization": f"Bearer sk-{tenant}",
                                                    **({REUSE_MODE_HEADER: "off"} if tenant == "plain" else {})})
    response.raise_for_status()
    answer = (response.json()["choices"][0]["message"]["content"] or "").strip()
    return answer, response.headers.get("x-revisit-video-patches", "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--panels", type=int, default=40)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    model_path = build_model(QWEN2_5_VL, "oracle", on_progress=print)
    env = {"REVISIT_VIDEO_REUSE_PATCHES": "1", "REVISIT_VIDEO_MATCH_PATCHES": "1", "REVISIT_HEALTH_INTERVAL_S": "3600"}
    with worker_and_gateway(model_path, MODEL_ID, "bench-video-quality-", env) as (worker, gateway):
        measure(gateway.url, worker.url, args.panels, random.Random(args.seed))


def measure(gateway_url: str, worker_url: str, panels: int, rng: random.Random) -> None:
    client = httpx.Client(timeout=600)
    url = gateway_url + "/v1/chat/completions"
    right: Counter[tuple[str, str, str]] = Counter()  # (case, field, tenant)
    stale: Counter[tuple[str, str]] = Counter()  # (case, tenant): the edited field answered with A's value
    asked: Counter[tuple[str, str]] = Counter()
    planned: Counter[str] = Counter()  # the planned tenant's patches by kind
    for number in range(panels):
        panel = random_panel(rng, min_fields=2)
        seen = encode_video(frames_of(panel), fps=FPS, lossless=True)
        ask(client, url, seen, field(panel, panel.keys[0]).text, "planned")  # A: each patch a miss, stored
        edited, keys = revalue(panel, rng, 1)
        same = rng.choice([key for key in panel.keys if key not in keys])
        cases = (("edited", encode_video(frames_of(edited), fps=FPS, lossless=True), edited,
                  (("changed", keys[0]), ("unchanged", same))),
                 ("resent", lossy(frames_of(panel), FPS, RESENT_CRF), panel, (("any", rng.choice(panel.keys)),)))
        for case, video, shown, questions in cases:
            for name, key in questions:
                question = field(shown, key)
                asked[(case, name)] += 1
                for tenant in (("plain", "planned") if number % 2 else ("planned", "plain")):
                    httpx.post(worker_url + "/flush_cache", timeout=60)
                    answer, patches = ask(client, url, video, question.text, tenant)
                    right[(case, name, tenant)] += answer == question.answer
                    if name == "changed" and answer == panel.value(key) != question.answer:
                        stale[(case, tenant)] += 1
                    if tenant == "planned":
                        for part in patches.split(";")[1:]:
                            kind, patch_count = part.split("=")
                            planned[kind] += int(patch_count)
                        planned["patches"] += int(patches.split(";")[0])
        if (number + 1) % 10 == 0:
            print(f"  {number + 1}/{panels} panels", flush=True)
    print(f"\n{panels} panels on a {CANVAS} px canvas, {FRAMES} frames ({FRAMES // 2} patches) a recording; the "
          f"planned tenant's patches: {dict(planned)}")
    print(f"{'case':8} {'field':10} {'asked':>5} {'plain':>7} {'planned':>8} {'stale plain/planned':>20}")
    for (case, name), count in asked.items():
        stale_text = f"{stale[(case, 'plain')]}/{stale[(case, 'planned')]}" if name == "changed" else ""
        print(f"{case:8} {name:10} {count:5d} {100 * right[(case, name, 'plain')] / count:6.1f}% "
              f"{100 * right[(case, name, 'planned')] / count:7.1f}% {stale_text:>20}")


if __name__ == "__main__":
    main()
