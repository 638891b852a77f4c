"""Video sources: opencv-doc's clips decoded by ffmpeg (the next frame, distant frames), else synthetic
pans over a photo."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from PIL import Image

from offline.near_duplicates.pairs import (
    DEFAULT_TOKENS,
    LARGE_TOKENS,
    TOKEN,
    Pair,
    changed_video,
    interleave,
    shape_for,
)
from offline.near_duplicates.scans import SKIMAGE_DATA, skimage_image

OPENCV_DATA = Path("/usr/share/doc/opencv-doc/examples/data")
CLIPS = ("vtest.avi", "Megamind.avi", "tree.avi")


def find_clips() -> list[Path]:
    if shutil.which("ffmpeg") is None:
        return []
    return [OPENCV_DATA / name for name in CLIPS if (OPENCV_DATA / name).exists()]


@lru_cache(maxsize=8)
def frame_count(path: Path) -> int:
    out = subprocess.run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-count_packets", "-show_entries",
                          "stream=nb_read_packets,width,height", "-of", "json", str(path)],
                         capture_output=True, check=True, timeout=120, text=True)
    return int(json.loads(out.stdout)["streams"][0]["nb_read_packets"])


def decode(path: Path, indices: Sequence[int]) -> dict[int, Image.Image]:
    """The frames at ``indices`` (decoded in one pass, selected by number)."""
    probe = subprocess.run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries",
                            "stream=width,height", "-of", "json", str(path)],
                           capture_output=True, check=True, timeout=120, text=True)
    stream = json.loads(probe.stdout)["streams"][0]
    width, height = int(stream["width"]), int(stream["height"])
    wanted = sorted(set(indices))
    expression = "+".join(f"eq(n,{index})" for index in wanted)
    out = subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-i", str(path), "-vf", f"select='{expression}'",
                          "-fps_mode", "passthrough", "-f", "rawvideo", "-pix_fmt", "rgb24", "-"],
                         capture_output=True, check=True, timeout=300)
    size = width * height * 3
    frames = {}
    for position, index in enumerate(wanted):
        chunk = out.stdout[position * size:(position + 1) * size]
        if len(chunk) == size:
            frames[index] = Image.frombytes("RGB", (width, height), chunk)
    return frames


def _frame_grid(width: int, height: int, large: bool) -> tuple[int, int, float]:
    """(rows, cols, scale): the frame's token grid, scaled up to at least about 300 tokens (or ~4,000 when large)."""
    target = LARGE_TOKENS[0] if large else DEFAULT_TOKENS[0]
    scale = max(1.0, math.sqrt(target * TOKEN * TOKEN / (width * height)))
    return int(height * scale) // TOKEN, int(width * scale) // TOKEN, scale


def _centre(frame: Image.Image, rows: int, cols: int, scale: float) -> Image.Image:
    if scale > 1:
        frame = frame.resize((math.ceil(frame.width * scale), math.ceil(frame.height * scale)),
                             Image.Resampling.BICUBIC)
    x, y = (frame.width - cols * TOKEN) // 2, (frame.height - rows * TOKEN) // 2
    return frame.crop((x, y, x + cols * TOKEN, y + rows * TOKEN))


def video_pairs(rng: random.Random, count: int, large: bool, notes: list[str]) -> dict[str, list[Pair]]:
    clips = find_clips()
    if not clips:
        notes.append("video: no clip (apt-get install opencv-doc ffmpeg): video_next and video_distant are "
                      "synthetic pans over a photo")
        return _pan_pairs(rng, count, large)
    nexts: list[Pair] = []
    distants: list[Pair] = []
    per_clip = math.ceil(count / len(clips))
    for clip in clips:
        frames = frame_count(clip)
        gap = max(frames // 4, 10)
        starts = rng.sample(range(frames - 2), min(frames - 2, per_clip * 2))
        near = [(t, t + rng.choice((1, 1, 2))) for t in starts]
        far = [(t, rng.randint(t + gap, frames - 1)) for t in rng.sample(range(frames - gap), per_clip)]
        decoded = decode(clip, [t for pair in near + far for t in pair])
        any_frame = next(iter(decoded.values()))
        rows, cols, scale = _frame_grid(any_frame.width, any_frame.height, large)
        kept = 0
        for t, u in near:
            if kept == per_clip or t not in decoded or u not in decoded:
                continue
            a, b = _centre(decoded[t], rows, cols, scale), _centre(decoded[u], rows, cols, scale)
            changed = changed_video(a, b)
            if changed.mean() > 0.5:  # a cut between shots: not the next frame of the same scene
                continue
            kept += 1
            nexts.append(Pair(f"video-next/{clip.name}/{t}-{u}", "video_next", a, b, True, changed, (0, 0)))
        for t, u in far:
            if t in decoded and u in decoded:
                a, b = _centre(decoded[t], rows, cols, scale), _centre(decoded[u], rows, cols, scale)
                distants.append(Pair(f"video-distant/{clip.name}/{t}-{u}", "video_distant", a, b, None,
                                     changed_video(a, b), (0, 0)))
    return {"video_next": interleave([nexts], count), "video_distant": interleave([distants], count)}


def next_frames(clip: Path, count: int, rng: random.Random, large: bool = False) -> list[Pair]:
    """Up to ``count`` pairs of consecutive frames (t, t + 1) of ``clip`` at random instants, cuts left out (more
    than half the tokens changed), in the clip's order: the next frames a stream sends, more of them than the
    labelled set's video_next holds."""
    starts = sorted(rng.sample(range(frame_count(clip) - 1), min(frame_count(clip) - 1, count)))
    decoded: dict[int, Image.Image] = {}
    for first in range(0, len(starts), 10):  # ffmpeg's select expression, a few frames at a time
        decoded.update(decode(clip, [t for start in starts[first:first + 10] for t in (start, start + 1)]))
    if not decoded:
        return []
    any_frame = next(iter(decoded.values()))
    rows, cols, scale = _frame_grid(any_frame.width, any_frame.height, large)
    pairs = []
    for t in starts:
        if t in decoded and t + 1 in decoded:
            a, b = _centre(decoded[t], rows, cols, scale), _centre(decoded[t + 1], rows, cols, scale)
            changed = changed_video(a, b)
            if changed.mean() <= 0.5:
                pairs.append(Pair(f"video-next/{clip.name}/{t}-{t + 1}", "video_next", a, b, True, changed, (0, 0)))
    return pairs


def _pan_pairs(rng: random.Random, count: int, large: bool) -> dict[str, list[Pair]]:
    """Synthetic video: a window panning over a large photo, a few pixels a frame (not a whole token)."""
    names = [name for name in ("hubble_deep_field.jpg", "retina.jpg", "astronaut.png", "coffee.png")
             if (SKIMAGE_DATA / name).exists()]
    out: dict[str, list[Pair]] = {"video_next": [], "video_distant": []}
    tokens = LARGE_TOKENS if large else DEFAULT_TOKENS
    for family in out:
        for index in range(count):
            name = names[index % len(names)]
            rows, cols = shape_for(rng, 4 / 3, tokens)
            width, height = cols * TOKEN, rows * TOKEN
            while True:  # at most 9 px a frame
                vx, vy = rng.randint(-9, 9), rng.randint(-9, 9)
                if (vx, vy) != (0, 0):
                    break
            frames = 1 if family == "video_next" else rng.randint(30, 60)
            source = skimage_image(name)
            # enlarged (2x, 4x when large), and more where the window and its path over the frames need it
            scale = max(4 if large else 2, (width + abs(vx) * frames) / source.width,
                        (height + abs(vy) * frames) / source.height)
            source = source.resize((math.ceil(source.width * scale), math.ceil(source.height * scale)),
                                   Image.Resampling.LANCZOS)
            span_x, span_y = abs(vx) * frames, abs(vy) * frames
            x = rng.randint(span_x if vx < 0 else 0, source.width - width - (span_x if vx > 0 else 0))
            y = rng.randint(span_y if vy < 0 else 0, source.height - height - (span_y if vy > 0 else 0))
            a = source.crop((x, y, x + width, y + height))
            x, y = x + vx * frames, y + vy * frames
            b = source.crop((x, y, x + width, y + height))
            slug = family.replace("_", "-")
            out[family].append(Pair(f"{slug}/video-pan/{name}/{vx},{vy}x{frames}-{index}", family, a, b,
                                    True if family == "video_next" else None, changed_video(a, b), (0, 0),
                                    motion=(-vy * frames, -vx * frames)))
    return out
