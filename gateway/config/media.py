"""What the gateway accepts and how the model's processor sees it: image processing, image and video limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gateway.config.errors import ConfigError
from plan.checkpoint import UnreadableProcessorConfig, image_processor_config
from settings import PREFIX as ENV_PREFIX
from settings import EnvReader


@dataclass(frozen=True, kw_only=True)
class ProcessorSettings:
    """How the model's image processor resizes images (Qwen ``smart_resize``).

    The gateway needs these numbers to know each image's LLM token grid and to make
    them part of the exact cache key, because the same pixels give different KV under
    different processor settings; and, for an image of more than ``max_pixels``, to
    resize it to the size the processor would give it before keying and forwarding it
    (gateway/images.py, ``ImageLimits.resize_to_model``).
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 16384 * 28 * 28

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"processor {name} must be positive, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ConfigError("processor min_pixels exceeds max_pixels")

    @property
    def factor(self) -> int:
        """Side of the pixel square that becomes one LLM token."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ProcessorSettings:
        """Read a Hugging Face style model folder's image processor settings.

        ``processor_config.json`` (its ``image_processor`` section) is preferred, then
        ``preprocessor_config.json``, the older layout.
        """
        try:
            found = image_processor_config(model_dir)
        except UnreadableProcessorConfig as exc:
            raise ConfigError(str(exc)) from exc
        if found is None:
            raise ConfigError(f"{model_dir} has no image processor settings (processor_config.json)")
        raw = found[1]
        size = raw.get("size") or {}
        return cls(
            patch_size=int(raw.get("patch_size", cls.patch_size)),
            merge_size=int(raw.get("merge_size", cls.merge_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", cls.temporal_patch_size)),
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels),
        )


@dataclass(frozen=True, kw_only=True)
class ImageLimits:
    """What the gateway accepts as an image, checked before any pixel is decoded."""

    max_images_per_request: int = 16
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    # Every image's width x height together, from the headers before any is decoded: what decoding and keying a
    # request's images may cost (a few-colour PNG of 170 KB can hold 40 Mpx: seconds of CPU and ~800 MB to decode).
    max_request_pixels: int = 64_000_000
    # Every image being decoded at once, all callers together (decoding holds up to 4 bytes a pixel; a large body's
    # parse counts as its bytes' worth): what decoding may hold in memory, whatever the number of threads. An image
    # larger than this is decoded when no other is.
    max_decoding_pixels: int = 64_000_000
    # An image of more pixels than the model keeps is resized at the gateway to the model's size, and the worker
    # gets those pixels (gateway/images.py); off, the worker gets the original and resizes it itself.
    resize_to_model: bool = True
    # The worker gets the pixels the gateway decoded, uncompressed (a 24-bit BMP, 3 bytes a pixel: its decode is a
    # copy), for every image not forwarded as uploaded, and for PNGs, which it would otherwise decode again (an
    # 896-px photo's PNG: 12 ms less at the worker, and a re-encode 2 ms at the gateway, not 35-70 ms as a PNG).
    # A JPEG kept at its size still goes as uploaded (a tenth of the bytes). Off: PNGs go as uploaded and
    # re-encodes as lossless PNGs, for workers across a network where bytes cost more than a decode.
    forward_decoded: bool = True
    fetch_timeout_s: float = 10.0  # the longest wait for the next byte of a fetched image or video
    fetch_deadline_s: float = 30.0  # the longest a whole fetch may take, redirects included, however it drips
    max_redirects: int = 3
    allow_private_urls: bool = False

    def __post_init__(self) -> None:
        if self.max_images_per_request < 1 or self.max_image_bytes < 1 or self.max_image_pixels < 1 \
                or self.max_request_pixels < 1 or self.max_decoding_pixels < 1:
            raise ConfigError("image limits must be positive")
        if self.fetch_timeout_s <= 0 or self.fetch_deadline_s <= 0:
            raise ConfigError("fetch_timeout_s and fetch_deadline_s must be positive")


VIDEO_ENV_PREFIX = ENV_PREFIX + "VIDEO_"


@dataclass(frozen=True, kw_only=True)
class VideoSettings:
    """Video parts (gateway/videos.py), ``REVISIT_VIDEO_<FIELD>``.

    Limits, checked from the container before any frame is decoded and again while counting: ``max_per_request``
    videos, ``max_bytes`` each, ``max_seconds`` long, ``max_frames`` frames of at most ``max_frame_pixels``.
    Sampling, as the model's processor samples frames (SGLang's Qwen-VL defaults: ``fps`` frames a second, at
    least ``min_frames`` and at most ``max_sampled_frames``, an even count), so that the gateway keys the frames
    the model sees. A worker started with another video configuration needs the same numbers here.
    ``match_patches``: each temporal patch (two sampled frames) gets token features and is matched against the
    namespace's earlier videos' patches as a near-duplicate (gateway/videos.py ``PatchBook``); counted (planned
    with ``reuse_patches``), and it costs the request an extraction per patch (about 30 ms for 570 tokens on one
    core), so off unless asked for. ``reuse_patches``: each temporal patch is planned (gateway/planner.py):
    stored by the worker on its first sight, reused where the store holds the same two frames (exact, moved in time
    and place) and, with ``match_patches``, where it holds a near-duplicate (approximate, with the vision tower over
    the whole video); off until it is shown to pay.
    """

    max_per_request: int = 2
    max_bytes: int = 32 * 1024 * 1024
    max_seconds: float = 300.0
    max_frames: int = 9000
    max_frame_pixels: int = 3840 * 2160
    fps: float = 2.0
    min_frames: int = 4
    max_sampled_frames: int = 768
    match_patches: bool = False
    reuse_patches: bool = False

    def __post_init__(self) -> None:
        for name in ("max_per_request", "max_bytes", "max_seconds", "max_frames", "max_frame_pixels", "fps",
                     "min_frames", "max_sampled_frames"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"video {name} must be positive, got {getattr(self, name)}")
        if self.min_frames > self.max_sampled_frames:
            raise ConfigError("video min_frames exceeds max_sampled_frames")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VideoSettings:
        return cls(**EnvReader(environ, error=ConfigError).fields(cls, VIDEO_ENV_PREFIX))
