"""Time to first token of sliding video windows with each temporal patch planned, against plain SGLang, side by side.

    .venv/bin/python bench/video_ttft.py [--clip vtest.avi] [--size bench] [--window 8] [--slide 2] [--windows 5]

One SGLang CPU worker on a bundled model and a gateway in front of it (REVISIT_VIDEO_REUSE_PATCHES and
REVISIT_VIDEO_MATCH_PATCHES on, every plan sent), on a store of the bench's own. The clip (opencv-doc's, as
bench/video_windows.py reads them; a still camera's synthetic walk past a bundled picture where it is not installed)
is cut into windows of WINDOW seconds every SLIDE seconds, each sent the way a sliding-window client sends it:

    sliding  each window coded losslessly (H.264 qp 0), so a window's patches of frames an earlier window also
             sampled are the same two pictures (exact), the rest near-duplicates or new
    resent   each window again at CRF 32 (after the lossless one): every pixel changed a little

With ``--by-cost`` the gateway sends a plan only where the worker's measured costs predict it pays (as deployed);
without it every plan is sent. Each request is a streamed one-token answer; every one is sent twice, in turn, by
two tenants of one gateway: one planned (x-revisit-video-patches says how), one with ``x-revisit-reuse-mode: off``
(plain SGLang). SGLang's prefix cache is emptied before each request. Printed per window: the patches planned,
both TTFTs and their ratio; then the medians. The vision tower runs over the whole video either way (SGLang
encodes a video in one pass): what a plan can save is the decoder's work on its patches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import worker_and_gateway  # noqa: E402
from bench.reuse_ttft import ttft  # noqa: E402
from bench.video_windows import CLIPS_DIR, frames_of  # noqa: E402
from bench.video_windows import encode as lossy  # noqa: E402
from bundled import DEFAULT_ARCH, build_model  # noqa: E402
from gateway.routes.openai_api import REUSE_MODE_HEADER  # noqa: E402
from tests.videos_lib import encode_video, walker  # noqa: E402

MODEL_ID = "bench-model"
QUESTION = "What happens in the video? One word."
RESENT_CRF = 32


def body(video: bytes) -> dict:
    import base64

    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    content = [{"type": "text", "text": "Watch:"}, {"type": "video_url", "video_url": {"url": url}},
               {"type": "text", "text": QUESTION}]
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "temperature": 0, "stream": True}


def clip(name: str):
    path = Path(name) if "/" in name else CLIPS_DIR / name
    if path.exists():
        frames, fps = frames_of(path)
        return path.name, frames, fps
    print(f"{name}: not installed ({path}; apt-get install opencv-doc): a synthetic still camera instead")
    return "walker (chelsea.png, 224 px)", walker("chelsea.png", frames=60, size=(224, 224), step=3), 4.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clip", default="vtest.avi")
    parser.add_argument("--size", default="bench", choices=("tiny", "bench", "deep"))
    parser.add_argument("--window", type=float, default=8.0, help="seconds a window")
    parser.add_argument("--slide", type=float, default=2.0, help="seconds between windows' starts")
    parser.add_argument("--windows", type=int, default=5, help="windows sent (the first ones)")
    parser.add_argument("--scale", type=float, default=0.5, help="frames resized by this factor (CPU time)")
    parser.add_argument("--by-cost", action="store_true",
                        help="plans sent only where the worker's measured costs say they pay (the default "
                             "deployment); without it every plan is sent, to time the reuse paths themselves")
    args = parser.parse_args()

    name, frames, fps = clip(args.clip)
    if args.scale != 1.0:
        import numpy as np
        from PIL import Image

        size = (int(frames[0].shape[1] * args.scale) // 2 * 2, int(frames[0].shape[0] * args.scale) // 2 * 2)
        frames = [np.asarray(Image.fromarray(f).resize(size, Image.Resampling.BILINEAR)) for f in frames]
    rate = max(1, round(fps))
    window, slide = round(args.window * fps), round(args.slide * fps)
    starts = list(range(0, len(frames) - window + 1, slide))[: args.windows]
    if not starts:
        raise SystemExit(f"{name} is shorter than one window")
    model_path = build_model(DEFAULT_ARCH, args.size, on_progress=print)
    env = {"REVISIT_VIDEO_REUSE_PATCHES": "1", "REVISIT_VIDEO_MATCH_PATCHES": "1", "REVISIT_HEALTH_INTERVAL_S": "3600",
           "REVISIT_PLAN_BY_COST": "1" if args.by_cost else "0"}
    with worker_and_gateway(model_path, MODEL_ID, "bench-video-", env) as (worker, gateway):
        print(f"\n{name}: {frames[0].shape[1]} x {frames[0].shape[0]} at {fps:.2f} fps, {len(starts)} windows "
              f"of {args.window:g} s every {args.slide:g} s; model {model_path.name}; streamed one-token TTFT")
        measure(gateway.url, worker.url, [frames[s:s + window] for s in starts], rate)


def measure(gateway_url: str, worker_url: str, windows: list, rate: int) -> None:
    client = httpx.Client(timeout=1800)
    url = gateway_url + "/v1/chat/completions"
    ratios: dict[str, list[float]] = {"sliding": [], "resent": []}
    print(f"{'':8} {'window':>6} {'patches planned':34} {'plain':>8} {'planned':>8} {'ratio':>6}")
    for kind in ("sliding", "resent"):
        for number, frames in enumerate(windows):
            video = encode_video(frames, fps=rate, lossless=True) if kind == "sliding" else \
                lossy(frames, rate, RESENT_CRF)
            timings = {}
            for tenant in (("plain", "planned") if number % 2 else ("planned", "plain")):
                httpx.post(worker_url + "/flush_cache", timeout=60)
                seconds, headers = ttft(client, url, body(video), api_key=f"sk-{tenant}",
                                        headers={REUSE_MODE_HEADER: "off"} if tenant == "plain" else None)
                timings[tenant] = (seconds, headers.get("x-revisit-video-patches", "-"))
            time.sleep(0.5)  # the worker's store writes of the planned misses, before the next window looks
            plain, (planned, patches) = timings["plain"][0], timings["planned"]
            if number or kind == "resent":  # the first sliding window is all misses
                ratios[kind].append(planned / plain)
            print(f"{kind:8} {number:6d} {patches:34} {plain:7.2f}s {planned:7.2f}s {planned / plain:5.2f}x",
                  flush=True)
    for kind, values in ratios.items():
        if values:
            print(f"{kind}: planned / plain TTFT, median over the windows planned: "
                  f"{statistics.median(values):.2f}x (min {min(values):.2f}, max {max(values):.2f})")


if __name__ == "__main__":
    main()
