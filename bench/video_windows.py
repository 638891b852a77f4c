"""Video windows: how many of a video's temporal patches an earlier video of the namespace had, the same or nearly.

    .venv/bin/python bench/video_windows.py [--clips vtest.avi Megamind.avi] [--window 8] [--slide 2]

Real clips (opencv-doc's, under /usr/share/doc/opencv-doc/examples/data: `apt-get install opencv-doc`; a clip not
installed is named and skipped) cut into windows of WINDOW seconds every SLIDE seconds, each encoded as H.264 (CRF
18) the way a client would send it, and opened as the gateway opens a video (gateway/videos.py ``open_video`` with
the pixel extractor: frames sampled as SGLang samples them, two to a temporal patch, token features of each patch).
In the order a sliding-window client sends them, each window's patches go through one ``PatchBook`` (what
``REVISIT_VIDEO_MATCH_PATCHES`` runs): exact (the same two pictures), approximate (a near-duplicate within the
match guard), miss. Then every window again, re-sent at another bitrate (CRF 32), looked up against the book.

Printed per clip: the windows' counts, the share of patches after the first window that found an earlier one, and
the costs: opening a window with and without patch features (medians), and the book's lookups per patch. What the
counts stand for is a prediction of what planned patches would reuse (bench/video_ttft.py times them).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import av  # noqa: E402
import numpy as np  # noqa: E402

from gateway.config import MatchSettings, ProcessorSettings, VideoSettings  # noqa: E402
from gateway.matching.pixel import PixelExtractor  # noqa: E402
from gateway.videos import CanonicalVideo, PatchBook, PatchesSeen, open_video  # noqa: E402

CLIPS_DIR = Path("/usr/share/doc/opencv-doc/examples/data")
CLIPS = ("vtest.avi", "Megamind.avi")
SENT_CRF, RESENT_CRF = 18, 32
NAMESPACE = "bench"


def frames_of(path: Path) -> tuple[list[np.ndarray], float]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 25)
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)], fps


def encode(frames: list[np.ndarray], fps: int, crf: int) -> bytes:
    """H.264 in MP4 at ``crf`` (yuv420p, even sides)."""
    height, width = (side - side % 2 for side in frames[0].shape[:2])
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": str(crf)})
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(
                np.ascontiguousarray(frame[:height, :width]), format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def opened(data: bytes, with_features: bool) -> tuple[CanonicalVideo, float]:
    started = time.perf_counter()
    video = open_video(data, settings=VideoSettings(), processor=ProcessorSettings(), model="bench",
                       namespace=NAMESPACE, extractor=PixelExtractor() if with_features else None)
    return video, time.perf_counter() - started


def share(seen: list[PatchesSeen]) -> str:
    patches = sum(s.patches for s in seen)
    exact, near = sum(s.exact for s in seen), sum(s.approximate or 0 for s in seen)
    if not patches:
        return "no patches"
    return (f"{patches} patches: exact {exact} ({100 * exact / patches:.0f}%), approximate {near} "
            f"({100 * near / patches:.0f}%), miss {patches - exact - near} "
            f"({100 * (patches - exact - near) / patches:.0f}%)")


def run_clip(path: Path, window_s: float, slide_s: float) -> None:
    frames, fps = frames_of(path)
    rate = max(1, round(fps))
    window, slide = round(window_s * fps), round(slide_s * fps)
    starts = list(range(0, len(frames) - window + 1, slide))
    print(f"\n{path.name}: {len(frames)} frames of {frames[0].shape[1]} x {frames[0].shape[0]} at {fps:.2f} fps "
          f"({len(frames) / fps:.1f} s); {len(starts)} windows of {window_s:g} s every {slide_s:g} s")
    if not starts:
        print("  shorter than one window: skipped")
        return
    book = PatchBook(MatchSettings(), scope="bench")
    sent: list[PatchesSeen] = []
    open_plain, open_featured, lookups = [], [], []
    for number, start in enumerate(starts):
        data = encode(frames[start:start + window], rate, SENT_CRF)
        video, took = opened(data, with_features=True)
        open_featured.append(took)
        open_plain.append(opened(data, with_features=False)[1])
        started = time.perf_counter()
        seen = book.record(video, NAMESPACE)
        lookups.append((time.perf_counter() - started) / max(1, seen.patches))
        sent.append(seen)
        grid = video.patches[0].features.grid if video.patches and video.patches[0].features else None
        print(f"  window {number:2d} at {start / fps:5.1f} s: {seen.header():32s} grid {grid}")
    print(f"  sliding, after the first window: {share(sent[1:])}")
    resent = []
    for start in starts:
        video, _ = opened(encode(frames[start:start + window], rate, RESENT_CRF), with_features=True)
        resent.append(book.record(video, NAMESPACE))
    print(f"  every window re-sent at CRF {RESENT_CRF} (sent at {SENT_CRF}): {share(resent)}")
    print(f"  open a window: {1000 * statistics.median(open_plain):.0f} ms keys only, "
          f"{1000 * statistics.median(open_featured):.0f} ms with patch features (medians); "
          f"book lookup {1000 * statistics.median(lookups):.1f} ms a patch (median, {len(book)} patches held at "
          "the end)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", nargs="+", default=list(CLIPS))
    parser.add_argument("--window", type=float, default=8.0, help="seconds a window")
    parser.add_argument("--slide", type=float, default=2.0, help="seconds between windows' starts")
    args = parser.parse_args()
    for name in args.clips:
        path = Path(name) if "/" in name else CLIPS_DIR / name
        if not path.exists():
            print(f"\n{name}: not installed ({path}; apt-get install opencv-doc): skipped")
            continue
        run_clip(path, args.window, args.slide)


if __name__ == "__main__":
    main()
