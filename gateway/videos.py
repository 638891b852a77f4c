"""Video parts: checked under limits, and the frames the model samples keyed like images.

The worker decodes a video itself (SGLang: torchcodec, else decord) and samples frames the Qwen-VL way
(:func:`sampled_frames`). The gateway opens the same bytes with PyAV, which decodes to the same pixels (FFmpeg
underneath both): it checks the limits, from the container before any frame is decoded and again while counting
packets, and keys each frame the model will see with the image key (:func:`gateway.images.content_key`). A frame
seen before, as an image or in another video of the namespace, is therefore recognised by its key.

KV reuse is not planned for video spans yet: a video runs on the worker as plain SGLang (the request's images
are still planned), keeps to the worker that served the same video last (whose prefix and encoder caches may
hold it), and what repeats is counted (gateway/metrics.py ``revisit_video_frames_total``, the response header
``x-revisit-video-frames``), which is what video reuse would gain.

Only MP4/QuickTime, Matroska/WebM and AVI containers are opened, named by their first bytes and opened with
that demuxer alone: FFmpeg's probing would otherwise also accept playlists (HLS, concat) that name other files
or URLs to read.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from PIL import Image

from gateway.config import ProcessorSettings, VideoSettings
from gateway.errors import PayloadTooLarge, UnprocessableVideo
from gateway.images import content_key

KEY_VERSION = b"revisit-video-key-v1"
FRAME_FACTOR = 2  # the Qwen-VL processors take an even number of frames (two per temporal patch)
# Container -> (PyAV demuxer, MIME type the worker is sent).
CONTAINERS = {"mp4": ("mp4", "video/mp4"), "webm": ("matroska", "video/webm"), "avi": ("avi", "video/x-msvideo")}
CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg"})
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")


@dataclass(frozen=True, slots=True)
class CanonicalVideo:
    """One request video, checked and keyed."""

    key: str  # the video's identity: its bytes, the model and the namespace
    payload: bytes  # what the worker receives: the uploaded bytes
    mime: str
    frames: int  # in the container
    fps: float
    width: int
    height: int
    frame_keys: tuple[str, ...]  # the image keys of the frames the model samples, in order

    @property
    def seconds(self) -> float:
        return self.frames / self.fps if self.fps > 0 else 0.0

    @property
    def nbytes(self) -> int:
        return len(self.payload) + 80 * len(self.frame_keys)

    @property
    def data_url(self) -> str:
        return f"data:{self.mime};base64," + base64.b64encode(self.payload).decode("ascii")


def sampled_frames(total: int, fps: float, settings: VideoSettings) -> list[int]:
    """Indices of the frames the model's processor samples from a video of ``total`` frames at ``fps``: ``fps``
    frames a second, clamped to [min_frames, max_sampled_frames] and to the video, rounded down to an even count,
    spread evenly from the first frame to the last (SGLang's Qwen-VL smart_nframes). A video of fewer than two
    frames cannot be sampled: the model refuses it."""
    if total < FRAME_FACTOR:
        raise UnprocessableVideo(f"video has {total} frame(s); the model needs at least {FRAME_FACTOR}",
                                 code="invalid_video")
    min_frames = math.ceil(settings.min_frames / FRAME_FACTOR) * FRAME_FACTOR
    max_frames = math.floor(min(settings.max_sampled_frames, total) / FRAME_FACTOR) * FRAME_FACTOR
    wanted = total / fps * settings.fps if fps > 0 else float(min_frames)
    count = math.floor(min(max(wanted, min_frames), max_frames, total) / FRAME_FACTOR) * FRAME_FACTOR
    return np.unique(np.linspace(0, total - 1, num=count, dtype=np.int64)).tolist()


def container_of(data: bytes) -> str:
    """The container named by a video's first bytes (a key of CONTAINERS); else UnprocessableVideo."""
    if data[4:8] in _MP4_BOXES:
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    raise UnprocessableVideo("video data is not MP4, WebM/Matroska or AVI", code="invalid_video")


def video_key(data: bytes, *, model: str, namespace: str) -> str:
    digest = hashlib.blake2b(KEY_VERSION + f"\0{model}\0{namespace}\0".encode(), digest_size=32)
    digest.update(data)
    return digest.hexdigest()


def open_video(data: bytes, *, settings: VideoSettings, processor: ProcessorSettings, model: str,
               namespace: str) -> CanonicalVideo:
    """Check a video under the limits and key the frames the model samples. CPU-bound (it decodes every frame up
    to the last sampled one): run it off the event loop."""
    container = container_of(data)
    demuxer, mime = CONTAINERS[container]
    try:
        with av.open(io.BytesIO(data), "r", format=demuxer) as opened:
            if not opened.streams.video:
                raise UnprocessableVideo("video has no video stream", code="invalid_video")
            stream = opened.streams.video[0]
            codec = stream.codec_context.name
            if codec not in CODECS:
                raise UnprocessableVideo(f"video codec {codec} is not accepted; use one of {', '.join(sorted(CODECS))}",
                                         code="invalid_video")
            width, height = stream.codec_context.width, stream.codec_context.height
            _check_size(width, height, settings)
            declared = opened.duration / av.time_base if opened.duration else None
            if declared is not None and declared > settings.max_seconds:
                raise _too_long(declared, settings)
            rate = stream.average_rate or stream.guessed_rate or Fraction(0)
            fps = float(rate)
            total = 0
            for packet in opened.demux(stream):
                if packet.size:
                    total += 1
                    if total > settings.max_frames:
                        raise PayloadTooLarge(f"video has more than {settings.max_frames} frames",
                                              code="video_too_large")
            if fps > 0 and total / fps > settings.max_seconds:
                raise _too_long(total / fps, settings)
            wanted = sampled_frames(total, fps, settings)
        frame_keys = _frame_keys(data, demuxer, wanted, settings, processor=processor, model=model,
                                 namespace=namespace)
    except (av.FFmpegError, ValueError, IndexError, OSError, MemoryError) as exc:
        raise UnprocessableVideo(f"video data is corrupt or truncated: {exc}", code="invalid_video") from exc
    return CanonicalVideo(key=video_key(data, model=model, namespace=namespace), payload=data, mime=mime,
                          frames=total, fps=fps, width=width, height=height, frame_keys=frame_keys)


def _frame_keys(data: bytes, demuxer: str, wanted: list[int], settings: VideoSettings, *,
                processor: ProcessorSettings, model: str, namespace: str) -> tuple[str, ...]:
    keys: list[str] = []
    pending = iter(wanted)
    next_index = next(pending)
    with av.open(io.BytesIO(data), "r", format=demuxer) as opened:
        for index, frame in enumerate(opened.decode(video=0)):
            _check_size(frame.width, frame.height, settings)  # a stream may change size mid-way
            if index < next_index:
                continue
            rgb = Image.fromarray(frame.to_ndarray(format="rgb24"))
            keys.append(content_key(rgb, model=model, namespace=namespace, processor=processor))
            next_index = next(pending, -1)
            if next_index < 0:
                break
    if len(keys) != len(wanted):
        raise UnprocessableVideo(f"video decoded to fewer frames than its {wanted[-1] + 1} packets",
                                 code="invalid_video")
    return tuple(keys)


def _check_size(width: int, height: int, settings: VideoSettings) -> None:
    if width < 1 or height < 1:
        raise UnprocessableVideo("video has no pixels", code="invalid_video")
    if width * height > settings.max_frame_pixels:
        raise PayloadTooLarge(f"video frames are {width}x{height} = {width * height} pixels; the limit is "
                              f"{settings.max_frame_pixels}", code="video_too_large")


def _too_long(seconds: float, settings: VideoSettings) -> PayloadTooLarge:
    return PayloadTooLarge(f"video is {seconds:.1f} s long; the limit is {settings.max_seconds:g} s",
                           code="video_too_long")


@dataclass(frozen=True, slots=True)
class FramesSeen:
    """Of one video's sampled frames: how many were seen before as images (stored in the cache), how many in an
    earlier video of the namespace, and how many are new."""

    sampled: int
    as_image: int
    in_video: int

    @property
    def new(self) -> int:
        return self.sampled - self.as_image - self.in_video

    def header(self) -> str:
        return f"{self.sampled};seen_as_image={self.as_image};seen_in_video={self.in_video}"


class FrameBook:
    """The frame keys of videos each namespace sent lately (an LRU of ``capacity`` keys). Event-loop only."""

    def __init__(self, capacity: int = 1 << 18):
        self._capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()  # image keys carry the namespace already

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, video: CanonicalVideo, stored: frozenset[str]) -> FramesSeen:
        """Count what of ``video`` was seen before (``stored``: those of its frame keys the cache holds as images),
        then remember its frames."""
        as_image = in_video = 0
        for key in video.frame_keys:
            if key in stored:
                as_image += 1
            elif key in self._keys:
                in_video += 1
        for key in video.frame_keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)
        return FramesSeen(sampled=len(video.frame_keys), as_image=as_image, in_video=in_video)
