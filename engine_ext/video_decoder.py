"""The workers' video decoder: PyAV (FFmpeg, maintained) in place of SGLang's torchcodec-else-decord.

SGLang opens every video part with ``sglang.srt.utils.video_decoder.VideoDecoderWrapper`` (``load_video`` in
``sglang.srt.utils.common``, called by the model's multimodal processor in the worker's tokenizer process), which
uses torchcodec where it is installed and decord otherwise. decord 0.6.0, what a CPU install would get, bundles
FFmpeg 4.1.6 (end of life) and decodes whichever video stream FFmpeg ranks best. :class:`PyAVVideoDecoder`
offers the same interface (``len``, ``avg_fps``, ``frame_shape``, ``get_frames_at``, ``get_frames_as_tensor``,
indexing, ``source_bytes``, ``close``) and reads the video the way the gateway does (gateway/videos.py), with the
same library:

- only MP4/QuickTime, Matroska/WebM and AVI, named by their first bytes and opened with that demuxer alone;
- stream 0 and nothing else (the gateway sends a container holding only the stream it checked and keyed), whose
  codec must be one the gateway accepts; FFmpeg may open no other decoder, even while probing the file;
- its frames numbered in the order the decoder returns them, one per packet (as decord counts them), at the
  stream's average frame rate (else the rate FFmpeg guesses);
- each frame converted to RGB by ``VideoFrame.to_ndarray(format="rgb24")``, the pixels the gateway keys.

It decodes on the CPU, whatever device is asked for. :func:`install` makes SGLang use it: the worker site's
``sitecustomize`` (engine_ext/worker_site) calls it in every worker process as soon as SGLang's module is
imported, before any other module binds the name.
"""

from __future__ import annotations

import io
import os
import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import av
import numpy as np
from sglang.srt.utils import video_decoder as sglang_video_decoder

from plan.video import CODECS, DECODERS, demuxer_of

SGLANG_WRAPPER = sglang_video_decoder.VideoDecoderWrapper


class PyAVVideoDecoder(sglang_video_decoder.VideoDecoderWrapper):
    """SGLang's ``VideoDecoderWrapper``, decoding stream 0 with PyAV. A subclass, so that SGLang's
    ``isinstance(video, VideoDecoderWrapper)`` checks hold under any binding of the name; it overrides every
    method SGLang calls and never runs the base class's constructor (which would open torchcodec or decord)."""

    def __init__(self, source: str | bytes, device: str = "cpu", num_decode_threads: int = 0) -> None:
        self._source = source
        self._num_decode_threads = num_decode_threads
        self._source_bytes = source if isinstance(source, bytes) else None
        self._source_path = source if isinstance(source, str) else None
        self._tmp_path = None
        self._decoder = None
        if self._source_bytes is None and self._source_path is None:
            raise ValueError(f"unsupported video source: {type(source).__name__}")
        head = self._source_bytes[:12] if self._source_bytes is not None else _head(self._source_path or "")
        self._demuxer = demuxer_of(head)
        with self._open() as container:
            stream = _stream_zero(container)
            rate = stream.average_rate or stream.guessed_rate
            self._fps = float(rate) if rate else 0.0
            self._height, self._width = stream.codec_context.height, stream.codec_context.width
            self._frames = sum(1 for packet in container.demux(stream) if packet.size)
        if self._frames < 1:
            raise ValueError("video has no frames")

    @contextmanager
    def _open(self) -> Iterator[Any]:
        if self._source_bytes is None and self._source_path is None:
            raise ValueError("video decoder is closed")
        target: Any = io.BytesIO(self._source_bytes) if self._source_bytes is not None else self._source_path
        with av.open(target, "r", format=self._demuxer, options={"codec_whitelist": DECODERS}) as container:
            yield container

    def __len__(self) -> int:
        return self._frames

    def __getitem__(self, idx: int) -> np.ndarray:
        """One frame, (height, width, 3) uint8 RGB."""
        return self.get_frames_at([idx])[0]

    @property
    def avg_fps(self) -> float:
        return self._fps

    @property
    def frame_shape(self) -> tuple[int, int]:
        return self._height, self._width

    def get_frames_at(self, indices: Sequence[int]) -> np.ndarray:
        """The frames at ``indices`` (any order, repeats allowed; negative from the end), (n, height, width, 3)
        uint8 RGB. Decodes from the first frame to the last one asked for, as the gateway does."""
        wanted = [int(i) + self._frames if int(i) < 0 else int(i) for i in indices]
        for index in wanted:
            if not 0 <= index < self._frames:
                raise IndexError(f"frame {index} of a video of {self._frames} frames")
        if not wanted:
            return np.empty((0, self._height, self._width, 3), dtype=np.uint8)
        pending = sorted(set(wanted))
        got: dict[int, np.ndarray] = {}
        with self._open() as container:
            for index, frame in enumerate(container.decode(container.streams[0])):
                if index == pending[len(got)]:
                    got[index] = frame.to_ndarray(format="rgb24")
                    if len(got) == len(pending):
                        break
        if len(got) < len(pending):
            raise ValueError(f"video decoded to fewer frames than its {self._frames} packets")
        return np.stack([got[i] for i in wanted])

    def get_frames_as_tensor(self, indices: Sequence[int]) -> Any:
        """:meth:`get_frames_at` as a torch tensor (NHWC uint8), in pinned memory unless the worker runs on CPU
        (as SGLang's own wrapper returns it)."""
        import torch

        output = torch.from_numpy(self.get_frames_at(indices))
        return output if sglang_video_decoder._is_cpu_engine() else output.pin_memory()

    @property
    def source_bytes(self) -> bytes | None:
        if self._source_bytes is not None:
            return self._source_bytes
        if self._source_path is not None and os.path.isfile(self._source_path):
            with open(self._source_path, "rb") as f:
                return f.read()
        return None

    def close(self) -> None:
        self._source = None  # type: ignore[assignment]  # as SGLang's close() does
        self._source_bytes = None
        self._source_path = None

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> PyAVVideoDecoder:
        return self

    def __exit__(self, *args: object) -> None:
        self.close()


def _head(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(12)


def _stream_zero(container: Any) -> Any:
    if not container.streams:
        raise ValueError("video has no streams")
    stream = container.streams[0]
    if stream.type != "video":
        raise ValueError(f"stream 0 of the video is {stream.type}, not video")
    codec = _codec_name(stream)
    if codec not in CODECS:
        raise ValueError(f"video codec {codec} is not accepted; use one of {', '.join(sorted(CODECS))}")
    return stream


def install(module: types.ModuleType = sglang_video_decoder) -> None:
    """Make SGLang decode videos with :class:`PyAVVideoDecoder`: in ``module`` (SGLang's video_decoder), and in
    every SGLang module already imported that bound SGLang's class to its own name (none, when the worker site
    installs it as SGLang's module is first imported)."""
    setattr(module, "VideoDecoderWrapper", PyAVVideoDecoder)  # noqa: B010 (a module typed as any module)
    for name, loaded in list(sys.modules.items()):
        if name.startswith("sglang.") and getattr(loaded, "VideoDecoderWrapper", None) is SGLANG_WRAPPER:
            setattr(loaded, "VideoDecoderWrapper", PyAVVideoDecoder)  # noqa: B010 (any module)


def _codec_name(stream: Any) -> str:
    """The stream's codec (FFmpeg's codec descriptor name: "av1", not the name of the decoder that would run)."""
    context = stream.codec_context
    return context.codec.canonical_name if context is not None else "unknown"
