"""Real test videos: a camera panning over one of scikit-image's bundled pictures, encoded with PyAV (FFmpeg), and
the frames a decoder gets back from them."""

from __future__ import annotations

import io

import av
import numpy as np
from PIL import Image

from tests.images_lib import load


def pan(picture: str = "astronaut.png", *, frames: int = 12, size: tuple[int, int] = (112, 112), step: int = 6,
        start: int = 0) -> list[np.ndarray]:
    """RGB frames (height, width, 3) of a camera moving ``step`` pixels right and down per frame over a picture."""
    image = np.asarray(load(picture).convert("RGB"))
    width, height = size
    out = []
    for i in range(start, start + frames):
        top, left = (i * step) % (image.shape[0] - height), (i * step) % (image.shape[1] - width)
        out.append(np.ascontiguousarray(image[top : top + height, left : left + width]))
    return out


def walker(picture: str = "astronaut.png", *, frames: int = 12, size: tuple[int, int] = (112, 112), step: int = 6,
           side: int = 20) -> list[np.ndarray]:
    """RGB frames of a still camera over a picture, a dark square of ``side`` pixels crossing it ``step`` pixels
    right per frame along its middle (someone walking past)."""
    width, height = size
    scene = np.asarray(load(picture).convert("RGB"))[:height, :width]
    out = []
    for i in range(frames):
        frame = scene.copy()
        left = (i * step) % (width - side)
        frame[(height - side) // 2 : (height + side) // 2, left : left + side] = 20
        out.append(frame)
    return out


def encode_video(frames: list[np.ndarray], *, fps: int = 4, codec: str = "libx264", fmt: str = "mp4",
                 lossless: bool = False) -> bytes:
    """The frames as a video file in memory (yuv420p, as cameras and screen recorders write). Lossy coding decodes
    the same picture to other pixels in another video (H.264 codes most frames from their neighbours); ``lossless``
    (H.264 at qp 0) decodes it to the same pixels in any video."""
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps, options={"qp": "0"} if lossless else None)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def decoded_frames(video: bytes) -> list[Image.Image]:
    """Every frame of a video as a decoder returns it (what a client that extracts frames would send as images)."""
    with av.open(io.BytesIO(video), "r") as container:
        return [Image.fromarray(frame.to_ndarray(format="rgb24")) for frame in container.decode(video=0)]
