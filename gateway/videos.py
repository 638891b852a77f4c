"""Video parts: checked under limits, cut down to one video stream, and the frames the model samples keyed like
images.

Every stream of the container is looked at: a video stream in a codec outside :data:`CODECS` is refused, whichever
it is (a worker given the file could otherwise decode it); the first video stream (not a cover picture) is the
video. The worker is sent that stream alone, its packets copied into a new container of the same kind with no
re-encoding (:func:`one_stream`): audio, subtitles, data, attachments and any other video stream stay here, so the
worker cannot decode another stream than the one keyed.

The worker decodes the video itself, with PyAV (engine_ext/video_decoder.py, installed in every worker process in
place of SGLang's torchcodec or decord), and samples frames the Qwen-VL way (:func:`sampled_frames`). The gateway
reads the very bytes the worker gets in the very way it reads them (stream 0, one frame per packet, the stream's
average rate, frames converted by PyAV to RGB): it checks the limits, from the container before any frame is
decoded and again while counting packets, and keys each frame the model will see with the image key
(:func:`gateway.images.image_key`). A frame seen before, as an image or in another video of the namespace, is
therefore recognised by its key.

KV reuse is not planned for video spans yet: a video runs on the worker as plain SGLang (the request's images
are still planned), keeps to the worker that served the same video last (whose prefix and encoder caches may
hold it), and what repeats is counted (gateway/metrics.py ``revisit_video_frames_total``, the response header
``x-revisit-video-frames``), which is what video reuse would gain.

Only MP4/QuickTime, Matroska/WebM and AVI containers are opened, named by their first bytes and opened with
that demuxer alone: FFmpeg's probing would otherwise also accept playlists (HLS, concat) that name other files
or URLs to read. FFmpeg may open only the accepted codecs' decoders (``codec_whitelist``), also while it probes
a file's streams.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import av
import numpy as np
from PIL import Image

from gateway.config import ImageLimits, ProcessorSettings, VideoSettings
from gateway.errors import PayloadTooLarge, UnprocessableVideo
from gateway.images import image_key
from plan.video import CODECS, DECODERS, demuxer_of

KEY_VERSION = b"revisit-video-key-v2"  # v2: a video is named by the one-stream bytes the worker gets
FRAME_FACTOR = 2  # the Qwen-VL processors take an even number of frames (two per temporal patch)
# Container -> (PyAV demuxer, the muxers that may write its one-stream copy, first that takes the codec wins).
CONTAINERS = {"mp4": ("mp4", ("mp4", "mov")), "webm": ("matroska", ("webm", "matroska")), "avi": ("avi", ("avi",))}
MIME = {"mp4": "video/mp4", "mov": "video/quicktime", "webm": "video/webm", "matroska": "video/x-matroska",
        "avi": "video/x-msvideo"}


@dataclass(frozen=True, slots=True)
class CanonicalVideo:
    """One request video, checked and keyed."""

    key: str  # the video's identity: the bytes the worker receives, the model and the namespace
    payload: bytes  # what the worker receives: the video stream alone, remuxed (:func:`one_stream`)
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
    def as_uploaded(self) -> bool:
        """Whether the worker may get the client's own bytes: never, it gets the one-stream copy (a client's
        data: URL must be replaced by :attr:`data_url`)."""
        return False

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
    try:
        demuxer = demuxer_of(data)
    except ValueError as exc:
        raise UnprocessableVideo(str(exc), code="invalid_video") from None
    return {"mp4": "mp4", "matroska": "webm", "avi": "avi"}[demuxer]


def video_key(data: bytes, *, model: str, namespace: str) -> str:
    digest = hashlib.blake2b(KEY_VERSION + f"\0{model}\0{namespace}\0".encode(), digest_size=32)
    digest.update(data)
    return digest.hexdigest()


def open_video(data: bytes, *, settings: VideoSettings, processor: ProcessorSettings, model: str,
               namespace: str, images: ImageLimits = ImageLimits()) -> CanonicalVideo:
    """Check a video under the limits, cut it down to its video stream (:func:`one_stream`) and key the frames the
    model samples from that copy. CPU-bound (it decodes every frame up to the last sampled one): run it off the
    event loop."""
    container = container_of(data)
    try:
        payload, muxer = one_stream(data, container, settings)
        demuxer = CONTAINERS[container_of(payload)][0]
        with _open(payload, demuxer) as opened:  # as the worker reads it (engine_ext/video_decoder.py)
            stream = opened.streams[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = stream.average_rate or stream.guessed_rate or Fraction(0)
            fps = float(rate)
            total = sum(1 for packet in opened.demux(stream) if packet.size)
        if fps > 0 and total / fps > settings.max_seconds:
            raise _too_long(total / fps, settings)
        wanted = sampled_frames(total, fps, settings)
        frame_keys = _frame_keys(payload, demuxer, wanted, settings, processor=processor, model=model,
                                 namespace=namespace, images=images)
    except (av.FFmpegError, ValueError, IndexError, OSError, MemoryError) as exc:
        raise UnprocessableVideo(f"video data is corrupt or truncated: {exc}", code="invalid_video") from exc
    return CanonicalVideo(key=video_key(payload, model=model, namespace=namespace), payload=payload,
                          mime=MIME[muxer], frames=total, fps=fps, width=width, height=height,
                          frame_keys=frame_keys)


def one_stream(data: bytes, container: str, settings: VideoSettings) -> tuple[bytes, str]:
    """The video's one video stream, alone in a new container of the same kind (packets copied, nothing
    re-encoded), and the muxer that wrote it. Refuses a container holding a video stream in a codec not accepted,
    or none; checks the size and the declared length before copying and the frame count while copying."""
    demuxer, muxers = CONTAINERS[container]
    with _open(data, demuxer) as opened:
        chosen = None
        for stream in opened.streams:
            if stream.type != "video":
                continue  # audio, subtitles, data, attachments: not passed on
            codec = _codec_name(stream)
            if codec not in CODECS:
                raise UnprocessableVideo(f"video stream {stream.index} is {codec}, which is not accepted; every video "
                                         f"stream must be one of {', '.join(sorted(CODECS))}", code="invalid_video")
            if chosen is None and not stream.disposition & av.stream.Disposition.attached_pic:
                chosen = stream
        if chosen is None:
            raise UnprocessableVideo("video has no video stream", code="invalid_video")
        _check_size(chosen.codec_context.width, chosen.codec_context.height, settings)
        declared = opened.duration / av.time_base if opened.duration else None
        if declared is not None and declared > settings.max_seconds:
            raise _too_long(declared, settings)
        packets = []
        for packet in opened.demux(chosen):
            if packet.size:
                packets.append(packet)
                if len(packets) > settings.max_frames:
                    raise PayloadTooLarge(f"video has more than {settings.max_frames} frames", code="video_too_large")
        refused: list[str] = []
        for muxer in muxers:
            try:
                return _mux(chosen, packets, muxer), muxer
            except (av.FFmpegError, ValueError) as exc:  # the muxer does not take this codec: the next one may
                refused.append(f"{muxer}: {exc}")
        raise UnprocessableVideo(f"video stream {chosen.index} ({_codec_name(chosen)}) cannot be repackaged alone: "
                                 f"{'; '.join(refused)}", code="invalid_video")


def _mux(stream: Any, packets: list[Any], muxer: str) -> bytes:
    out = io.BytesIO()
    # Bit-exact: the same bytes for the same video (Matroska would write a random segment UID).
    with av.open(out, "w", format=muxer, options={"fflags": "+bitexact"}) as copy:
        target = copy.add_stream_from_template(stream, opaque=True)  # the codec's parameters, no encoder
        if stream.average_rate:  # kept, else Matroska would store none and readers would guess another rate
            target.codec_context.framerate = stream.average_rate
        for packet in packets:
            packet.stream = target
            copy.mux(packet)
    return out.getvalue()


def _open(data: bytes, demuxer: str) -> Any:
    return av.open(io.BytesIO(data), "r", format=demuxer, options={"codec_whitelist": DECODERS})


def _frame_keys(payload: bytes, demuxer: str, wanted: list[int], settings: VideoSettings, *,
                processor: ProcessorSettings, model: str, namespace: str, images: ImageLimits) -> tuple[str, ...]:
    keys: list[str] = []
    pending = iter(wanted)
    next_index = next(pending)
    with _open(payload, demuxer) as opened:
        for index, frame in enumerate(opened.decode(opened.streams[0])):
            _check_size(frame.width, frame.height, settings)  # a stream may change size mid-way
            if index < next_index:
                continue
            rgb = Image.fromarray(frame.to_ndarray(format="rgb24"))
            keys.append(image_key(rgb, model=model, namespace=namespace, processor=processor, limits=images))
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


def _codec_name(stream: Any) -> str:
    """The stream's codec (FFmpeg's codec descriptor name: "av1", not the name of the decoder that would run)."""
    context = stream.codec_context
    return context.codec.canonical_name if context is not None else "unknown"
