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

The model's tokens of a video are its temporal patches: each two sampled frames in turn, resized together to one
token grid (:func:`patch_grid`), one token per ``factor x factor`` pixels of both. With a feature extractor, each
patch gets the per-token features approximate matching compares (:class:`TemporalPatch`, taken from the mean of
its two frames), and :class:`PatchBook` looks each patch up among the namespace's earlier videos' patches: the
same two pictures (exact), a near-duplicate within the match guard (approximate), or nothing (miss). Two windows
of one stream sample other instants (SGLang spreads its samples over each clip), so their patches are rarely the
same, but the nearest earlier instant is often a near-duplicate.

With ``REVISIT_VIDEO_REUSE_PATCHES`` the planner plans each patch as it plans an image (gateway/planner.py: stored
on first sight, exact or approximate later) and the workers execute those plans per patch (engine_ext.executor);
otherwise a video runs on the worker as plain SGLang (the request's images are still planned). Either way a video
keeps to the worker that served it last (whose prefix and encoder caches may hold it), and what repeats is counted
(gateway/metrics.py ``revisit_video_frames_total`` and ``revisit_video_patches_total``, the response headers
``x-revisit-video-frames`` and ``x-revisit-video-patches``: as planned where patches are planned, else as this
module's :class:`PatchBook` finds them).

Only MP4/QuickTime, Matroska/WebM and AVI containers are opened, named by their first bytes and opened with
that demuxer alone: FFmpeg's probing would otherwise also accept playlists (HLS, concat) that name other files
or URLs to read. FFmpeg may open only the accepted codecs' decoders (``codec_whitelist``), also while it probes
a file's streams.
"""

from __future__ import annotations

import hashlib
import io
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import av
import numpy as np
from PIL import Image

from gateway.config import ImageLimits, MatchSettings, ProcessorSettings, VideoSettings
from gateway.errors import PayloadTooLarge, UnprocessableVideo
from gateway.images import data_url, image_key, smart_resize
from gateway.matching.features import Extractor, TokenFeatures
from gateway.matching.matcher import Matcher
from plan.video import CODECS, DECODERS, demuxer_of

KEY_VERSION = b"revisit-video-key-v2"  # v2: a video is named by the one-stream bytes the worker gets
PATCH_KEY_VERSION = b"revisit-video-patch-v1"
FRAMES_SEEN = ("image", "video", "new")  # revisit_video_frames_total's labels (FramesSeen.counts)
PATCHES_SEEN = ("exact", "approximate", "miss")  # revisit_video_patches_total's labels (PatchesSeen.counts)
FRAME_FACTOR = 2  # the Qwen-VL processors take an even number of frames (two per temporal patch)
# How SGLang's Qwen-VL video preprocessing sizes the sampled frames (sglang/srt/multimodal/processors/qwen_vl.py,
# preprocess_video, 0.5.23), whatever the model's image processor says: between these pixel counts a frame, and at
# most TOTAL_PIXELS over all the frames (two per patch). SGLang reads TOTAL_PIXELS from its worker's environment
# (VIDEO_MAX_PIXELS); a worker started with another value needs it here.
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)
# Container -> (PyAV demuxer, the muxers that may write its one-stream copy, first that takes the codec wins).
CONTAINERS = {"mp4": ("mp4", ("mp4", "mov")), "webm": ("matroska", ("webm", "matroska")), "avi": ("avi", ("avi",))}
MIME = {"mp4": "video/mp4", "mov": "video/quicktime", "webm": "video/webm", "matroska": "video/x-matroska",
        "avi": "video/x-msvideo"}


@dataclass(frozen=True, slots=True, eq=False)
class TemporalPatch:
    """Two sampled frames the model turns into one grid of tokens."""

    key: str  # the two frames' image keys, in order (:func:`patch_key`): the same pictures in the same place
    features: TokenFeatures | None  # per token, of the two frames' mean; None without an extractor

    @property
    def nbytes(self) -> int:
        return 80 + (self.features.nbytes if self.features is not None else 0)


def patch_key(first: str, second: str) -> str:
    """A temporal patch's identity: its frames' image keys (which carry the model, the processor and the
    namespace)."""
    return hashlib.blake2b(PATCH_KEY_VERSION + f"\0{first}\0{second}".encode(), digest_size=32).hexdigest()


def patch_grid(height: int, width: int, sampled: int, processor: ProcessorSettings) -> tuple[int, int]:
    """(rows, cols) of the token grid of each temporal patch of a video of ``sampled`` frames of height x width,
    as SGLang's Qwen-VL video preprocessing resizes them (the bounds above, then the image processor's rounding to
    the token side)."""
    max_pixels = max(min(VIDEO_MAX_PIXELS, VIDEO_TOTAL_PIXELS / sampled * FRAME_FACTOR), int(VIDEO_MIN_PIXELS * 1.05))
    sized = replace(processor, min_pixels=VIDEO_MIN_PIXELS, max_pixels=max(VIDEO_MIN_PIXELS, math.floor(max_pixels)))
    resized_height, resized_width = smart_resize(height, width, sized)
    return resized_height // processor.factor, resized_width // processor.factor


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
    patches: tuple[TemporalPatch, ...] = ()  # the model's temporal patches (two sampled frames each), in order
    grid: tuple[int, int] = (0, 0)  # each patch's token grid (:func:`patch_grid`)

    @property
    def seconds(self) -> float:
        return self.frames / self.fps if self.fps > 0 else 0.0

    @property
    def nbytes(self) -> int:
        return len(self.payload) + 80 * len(self.frame_keys) + sum(patch.nbytes for patch in self.patches)

    @property
    def as_uploaded(self) -> bool:
        """Whether the worker may get the client's own bytes: never, it gets the one-stream copy (a client's
        data: URL must be replaced by :attr:`data_url`)."""
        return False

    @property
    def forwarded_bytes(self) -> int:
        """The bytes the worker's copy holds (what base64 encoding it costs)."""
        return len(self.payload)

    @property
    def data_url(self) -> str:
        return data_url(self.payload, self.mime)


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
               namespace: str, images: ImageLimits = ImageLimits(),
               extractor: Extractor | None = None) -> CanonicalVideo:
    """Check a video under the limits, cut it down to its video stream (:func:`one_stream`) and key the frames the
    model samples from that copy, and its temporal patches (with ``extractor``, their token features too).
    CPU-bound (it decodes every frame up to the last sampled one): run it off the event loop."""
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
        frame_keys, patches = _sampled(payload, demuxer, wanted, settings, processor=processor, model=model,
                                       namespace=namespace, images=images, extractor=extractor)
    except (av.FFmpegError, ValueError, IndexError, OSError, MemoryError) as exc:
        raise UnprocessableVideo(f"video data is corrupt or truncated: {exc}", code="invalid_video") from exc
    return CanonicalVideo(key=video_key(payload, model=model, namespace=namespace), payload=payload,
                          mime=MIME[muxer], frames=total, fps=fps, width=width, height=height,
                          frame_keys=frame_keys, patches=patches,
                          grid=patch_grid(height, width, len(wanted), processor))


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


def _sampled(payload: bytes, demuxer: str, wanted: list[int], settings: VideoSettings, *,
             processor: ProcessorSettings, model: str, namespace: str, images: ImageLimits,
             extractor: Extractor | None) -> tuple[tuple[str, ...], tuple[TemporalPatch, ...]]:
    """The image keys of the sampled frames, and the temporal patches they make (each two frames in turn)."""
    keys: list[str] = []
    patches: list[TemporalPatch] = []
    first: np.ndarray | None = None  # the patch's first frame, while its second is decoded
    pending = iter(wanted)
    next_index = next(pending)
    with _open(payload, demuxer) as opened:
        for index, frame in enumerate(opened.decode(opened.streams[0])):
            _check_size(frame.width, frame.height, settings)  # a stream may change size mid-way
            if index < next_index:
                continue
            pixels = frame.to_ndarray(format="rgb24")
            keys.append(image_key(Image.fromarray(pixels), model=model, namespace=namespace, processor=processor,
                                  limits=images))
            if len(keys) % FRAME_FACTOR:
                first = pixels
            else:
                assert first is not None
                features = _patch_features(first, pixels, len(wanted), processor, extractor)
                patches.append(TemporalPatch(key=patch_key(keys[-2], keys[-1]), features=features))
                first = None
            next_index = next(pending, -1)
            if next_index < 0:
                break
    if len(keys) != len(wanted):
        raise UnprocessableVideo(f"video decoded to fewer frames than its {wanted[-1] + 1} packets",
                                 code="invalid_video")
    return tuple(keys), tuple(patches)


def _patch_features(first: np.ndarray, second: np.ndarray, sampled: int, processor: ProcessorSettings,
                    extractor: Extractor | None) -> TokenFeatures | None:
    """The token features of a temporal patch: of its two frames' mean, on the patch's token grid. None without an
    extractor, or for two frames of different sizes (a stream that changed size mid-way)."""
    if extractor is None or first.shape != second.shape:
        return None
    mean = ((first.astype(np.uint16) + second) >> 1).astype(np.uint8)
    grid = patch_grid(mean.shape[0], mean.shape[1], sampled, processor)
    return extractor.extract(Image.fromarray(mean), grid, processor.factor)


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

    def counts(self) -> dict[str, int]:
        """revisit_video_frames_total's labels (metrics.FRAMES_SEEN) and this video's count of each."""
        return dict(zip(FRAMES_SEEN, (self.as_image, self.in_video, self.new), strict=True))


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


@dataclass(frozen=True, slots=True)
class PatchesSeen:
    """Of one video's temporal patches: how many an earlier video of the namespace had (exact: the same two
    pictures), how many nearly duplicate one of them within the match guard (approximate; None: not looked for,
    the patches have no features), and the rest (miss)."""

    patches: int
    exact: int
    approximate: int | None

    @property
    def miss(self) -> int:
        return self.patches - self.exact - (self.approximate or 0)

    def header(self) -> str:
        near = f";approximate={self.approximate}" if self.approximate is not None else ""
        return f"{self.patches};exact={self.exact}{near}"

    def counts(self) -> dict[str, int]:
        """revisit_video_patches_total's labels (metrics.PATCHES_SEEN) and this video's count of each."""
        return dict(zip(PATCHES_SEEN, (self.exact, self.approximate or 0, self.miss), strict=True))


class PatchBook:
    """The temporal patches of the videos each namespace sent lately, as candidates for later videos' patches: their
    keys and, where they have features, an in-memory match index (gateway/matching) of at most ``capacity`` bytes,
    the oldest forgotten first. Lookups run the matcher's in-place stages (a whole-token shift at most) under the
    planner's guard. One video at a time (a lock): call it off the event loop."""

    def __init__(self, settings: MatchSettings, *, scope: str, capacity: int = 128 << 20) -> None:
        # The matcher keeps every indexed patch's features (its cache is the book's capacity and a patch more).
        self.matcher = Matcher(replace(settings, feature_cache_bytes=2 * capacity), scope=scope, features=None)
        self._capacity = capacity
        self._patches: OrderedDict[str, int] = OrderedDict()  # key -> bytes held, oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._patches)

    def record(self, video: CanonicalVideo, namespace: str) -> PatchesSeen:
        """Count what of ``video``'s patches was seen before (not within the video itself), then remember them."""
        with self._lock:
            return self._record(video, namespace)

    def _record(self, video: CanonicalVideo, namespace: str) -> PatchesSeen:
        exact = approximate = 0
        for patch in video.patches:
            if patch.key in self._patches:
                exact += 1
            elif patch.features is not None and self._near(namespace, patch):
                approximate += 1
        for patch in video.patches:
            self._remember(namespace, patch)
        matched = any(patch.features is not None for patch in video.patches)
        return PatchesSeen(patches=len(video.patches), exact=exact, approximate=approximate if matched else None)

    def _near(self, namespace: str, patch: TemporalPatch) -> bool:
        assert patch.features is not None
        found = self.matcher.lookup(namespace, patch.key, patch.features)
        return any(self.matcher.within_guard(match) for match in found.matches)

    def _remember(self, namespace: str, patch: TemporalPatch) -> None:
        if patch.key in self._patches:
            self._patches.move_to_end(patch.key)
            return
        held = patch.nbytes
        if held > self._capacity:
            return
        if patch.features is not None:
            self.matcher.add(patch.key, namespace, patch.features)
        self._patches[patch.key] = held
        self._bytes += held
        while self._bytes > self._capacity:
            key, freed = self._patches.popitem(last=False)
            self.matcher.forget(key)
            self._bytes -= freed


def _codec_name(stream: Any) -> str:
    """The stream's codec (FFmpeg's codec descriptor name: "av1", not the name of the decoder that would run)."""
    context = stream.codec_context
    return context.codec.canonical_name if context is not None else "unknown"
