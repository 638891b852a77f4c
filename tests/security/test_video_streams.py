"""A video's streams: the worker decodes the one stream the gateway checked and keyed, with the gateway's decoder.

Before: the gateway checked only the first video stream against its codec list and sent the client's bytes to the
worker, whose decoder (decord 0.6.0, bundling FFmpeg 4.1.6, end of life) decoded whichever video stream FFmpeg
ranked best. A second video stream in a codec never vetted ran unvetted decoder code in the worker, and one showing
another picture was what the model saw while the cache keys named the first stream's pixels.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from gateway.app import create_app
from gateway.config import GatewayConfig, ProcessorSettings, TenantSettings, VideoSettings
from gateway.errors import UnprocessableVideo
from gateway.image_fetch import ImageFetcher
from gateway.images import content_key
from gateway.intake import Intake
from gateway.videos import open_video, sampled_frames
from launcher import WorkerSpec, build_launch
from plan.video import CODECS
from tests.images_lib import data_url

ROOT = Path(__file__).resolve().parents[2]
PROCESSOR = ProcessorSettings()
SETTINGS = VideoSettings()
RED, BLUE = (230, 20, 20), (20, 20, 230)
PIX_FMT = {"ffv1": "yuv420p", "huffyuv": "yuv422p", "png": "rgb24", "mjpeg": "yuvj420p"}


def streams(*specs: tuple[str, tuple[int, int, int], int, int], fmt: str = "matroska", fps: int = 4) -> bytes:
    """A container of video streams, each ``(codec, colour, size, frames)``: frames of one colour with a corner
    that brightens frame by frame (so that each frame is its own picture), muxed side by side."""
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        muxed = []
        for codec, _, size, _ in specs:
            stream = container.add_stream(codec, rate=fps)
            stream.width = stream.height = size
            stream.pix_fmt = PIX_FMT.get(codec, "yuv420p")
            muxed.append(stream)
        for index in range(max(frames for *_, frames in specs)):
            for (_, colour, size, frames), stream in zip(specs, muxed, strict=True):
                if index < frames:
                    picture = np.empty((size, size, 3), dtype=np.uint8)
                    picture[...] = colour
                    picture[:8, :8] = 20 * index
                    container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        for stream in muxed:
            container.mux(stream.encode())
    return out.getvalue()


def opened(data: bytes):
    return open_video(data, settings=SETTINGS, processor=PROCESSOR, model="m", namespace="n")


def kinds(data: bytes) -> list[tuple[str, str]]:
    """Every stream of a container: (type, codec)."""
    with av.open(io.BytesIO(data), "r") as container:
        return [(s.type, s.codec_context.codec.canonical_name if s.codec_context else "") for s in container.streams]


def keys_of(frames: np.ndarray) -> tuple[str, ...]:
    return tuple(content_key(Image.fromarray(frame), model="m", namespace="n", processor=PROCESSOR)
                 for frame in frames)


def chat(url: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what happens?"}]}]}).encode()


# --- a video stream in a codec not accepted ---

@pytest.mark.parametrize("codec, fmt", [("ffv1", "matroska"), ("huffyuv", "avi"), ("png", "mov"), ("ffv1", "avi")])
def test_a_second_video_stream_in_a_codec_not_accepted_is_refused(codec, fmt):
    assert codec in av.codecs_available and codec not in CODECS
    data = streams(("libx264", RED, 64, 8), (codec, BLUE, 64, 8), fmt=fmt)
    assert kinds(data) == [("video", "h264"), ("video", codec)]
    with pytest.raises(UnprocessableVideo) as info:
        opened(data)
    assert info.value.status_code == 422 and info.value.code == "invalid_video"
    assert f"video stream 1 is {codec}" in info.value.message
    opened(streams(("libx264", RED, 64, 8), fmt=fmt))  # the same video without it is accepted


@pytest.fixture(scope="module")
def client():
    """A real gateway app in process. No worker listens at its worker's address: a request that intake lets
    through answers 503, so a 4xx is the gateway refusing it."""
    app = create_app(GatewayConfig(model="m", workers=("http://127.0.0.1:9",), tenants=TenantSettings.open()))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def test_the_app_refuses_it_with_a_422_naming_the_stream(client):
    data = streams(("libx264", RED, 64, 8), ("ffv1", BLUE, 64, 8))
    response = client.post("/v1/chat/completions", content=chat(data_url(data, "video/x-matroska")),
                           headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_video"
    assert "messages[0].content[0].video_url" in error["message"] and "video stream 1 is ffv1" in error["message"]
    alone = data_url(streams(("libx264", RED, 64, 8)), "video/x-matroska")
    passed = client.post("/v1/chat/completions", content=chat(alone), headers={"content-type": "application/json"})
    assert passed.status_code == 503, passed.text  # accepted, then no worker answers


# --- two accepted video streams, two pictures ---

# Stream 0 red, 4 frames; stream 1 blue, larger, 8 frames: FFmpeg's "best" video stream (what decord decoded) is
# stream 1, the gateway keys stream 0.
TWO_PICTURES = streams(("libx264", RED, 64, 4), ("libx264", BLUE, 128, 8))


def test_the_worker_is_sent_only_the_stream_the_gateway_keyed():
    from engine_ext.video_decoder import PyAVVideoDecoder

    video = opened(TWO_PICTURES)
    assert kinds(TWO_PICTURES) == [("video", "h264"), ("video", "h264")]
    assert kinds(video.payload) == [("video", "h264")]  # the worker cannot choose another stream
    assert (video.frames, video.width, video.height) == (4, 64, 64)
    # The worker's decoder on the bytes the worker gets: the very frames the gateway keyed, and red ones.
    decoder = PyAVVideoDecoder(video.payload)
    assert (len(decoder), decoder.avg_fps, decoder.frame_shape) == (video.frames, video.fps, (64, 64))
    frames = decoder.get_frames_at(sampled_frames(len(decoder), decoder.avg_fps, SETTINGS))
    assert keys_of(frames) == video.frame_keys
    red, _, blue = frames.reshape(-1, 3).mean(axis=0)
    assert red > 150 > 60 > blue
    # And the pixels are stream 0's of the client's file, decoded directly.
    with av.open(io.BytesIO(TWO_PICTURES), "r") as original:
        first = [f.to_ndarray(format="rgb24") for f in original.decode(original.streams[0])]
    assert np.array_equal(frames, np.stack([first[i] for i in sampled_frames(4, 4.0, SETTINGS)]))


def test_audio_goes_and_the_video_stream_becomes_stream_0():
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        audio = container.add_stream("aac", rate=16000)
        video = container.add_stream("libx264", rate=4)
        video.width = video.height = 64
        video.pix_fmt = "yuv420p"
        silence = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        silence.sample_rate = 16000
        for index in range(8):
            container.mux(audio.encode(silence))
            picture = np.full((64, 64, 3), 40 + 20 * index, dtype=np.uint8)
            container.mux(video.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(audio.encode())
        container.mux(video.encode())
    data = out.getvalue()
    assert [kind for kind, _ in kinds(data)] == ["audio", "video"]
    canonical = opened(data)
    assert kinds(canonical.payload) == [("video", "h264")] and canonical.mime == "video/mp4"
    assert canonical.frames == 8


@pytest.mark.parametrize("codec, fmt", [("libx264", "matroska"), ("libvpx-vp9", "webm"), ("libx264", "mp4"),
                                        ("mpeg4", "avi")])
def test_the_copy_is_the_same_bytes_every_time(codec, fmt):
    """A repeat of a video is named by the bytes the worker gets: they must not change from one upload to the
    next (Matroska writes a random segment UID unless told to be bit-exact)."""
    data = streams((codec, RED, 64, 8), fmt=fmt)
    first, again = opened(data), opened(data)
    assert first.payload == again.payload and first.key == again.key


async def test_a_client_data_url_is_replaced_by_the_one_stream_copy():
    """What intake sends upstream for a video sent inline: the one-stream copy, not the client's string."""
    config = GatewayConfig(model="m", workers=("http://127.0.0.1:1",))
    intake = Intake(config, ImageFetcher(config.images))
    result = await intake.process(chat(data_url(TWO_PICTURES, "video/x-matroska")), namespace="n")
    url = result.upstream_body["messages"][0]["content"][0]["video_url"]["url"]
    sent = base64.b64decode(url.partition(",")[2])
    assert sent == result.videos[0].payload, (
        "the worker gets the client's bytes, both streams: gateway/intake.py _needs_rewrite must rewrite a video "
        "whose CanonicalVideo.as_uploaded is False")
    assert kinds(sent) == [("video", "h264")]


@pytest.mark.parametrize("encoder, codec, fmt", [
    ("libx264", "h264", "mp4"), ("libx265", "hevc", "matroska"), ("libvpx", "vp8", "webm"),
    ("libvpx-vp9", "vp9", "webm"), ("libsvtav1", "av1", "mp4"), ("mpeg4", "mpeg4", "avi"), ("mjpeg", "mjpeg", "avi")])
def test_every_accepted_codec_reaches_the_worker_as_keyed(encoder, codec, fmt):
    """Each codec on the list, checked by its codec (AV1's decoder is dav1d, and was once taken for the codec),
    copied alone and decoded by the worker's decoder to the frames the gateway keyed."""
    from engine_ext.video_decoder import PyAVVideoDecoder

    if encoder not in av.codecs_available:
        pytest.skip(f"this PyAV has no {encoder} encoder")
    assert codec in CODECS
    video = opened(streams((encoder, RED, 64, 12), fmt=fmt))
    assert kinds(video.payload) == [("video", codec)]
    decoder = PyAVVideoDecoder(video.payload)
    assert (len(decoder), decoder.avg_fps) == (video.frames, video.fps) == (12, 4.0)
    assert keys_of(decoder.get_frames_at(sampled_frames(12, 4.0, SETTINGS))) == video.frame_keys


# --- the workers' decoder ---

WORKER_PROBE = """
import asyncio, json, sys
import numpy as np
from sglang.srt.utils import common, video_decoder
from sglang.srt.multimodal.processors import qwen_vl
import engine_ext.video_decoder as ours

with open(sys.argv[1]) as f:
    url = f.read()
video = common.load_video(url, use_gpu=False)  # what SGLang's multimodal processor calls for a video part
_, metadata = asyncio.run(qwen_vl.preprocess_video(video, video_config={}))
indices = [int(i) for i in metadata["frames_indices"]]
np.save(sys.argv[2], video.get_frames_as_tensor(indices).numpy())
print(json.dumps({
    "module": video_decoder.VideoDecoderWrapper is ours.PyAVVideoDecoder,
    "common": common.VideoDecoderWrapper is ours.PyAVVideoDecoder,
    "qwen_vl": qwen_vl.VideoDecoderWrapper is ours.PyAVVideoDecoder,
    "decoder": type(video).__module__ + "." + type(video).__qualname__,
    "indices": indices, "frames": len(video), "fps": video.avg_fps,
    "decord_imported": "decord" in sys.modules,
}))
"""


def test_sglang_decodes_videos_with_pyav_in_a_worker_process(tmp_path):
    """A process started as the launcher starts a worker (its environment: the worker site first on PYTHONPATH)
    has SGLang's VideoDecoderWrapper replaced under every name SGLang binds it to, and SGLang's own Qwen-VL video
    path then samples the gateway's frames, with the gateway's pixels."""
    _, env = build_launch(WorkerSpec(model_path=tmp_path, dtype="float32"))
    video = opened(TWO_PICTURES)
    (tmp_path / "url").write_text(video.data_url)
    done = subprocess.run([sys.executable, "-c", WORKER_PROBE, str(tmp_path / "url"), str(tmp_path / "frames.npy")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["module"] and probe["common"] and probe["qwen_vl"], probe
    assert probe["decoder"] == "engine_ext.video_decoder.PyAVVideoDecoder" and not probe["decord_imported"]
    assert (probe["frames"], probe["fps"]) == (video.frames, video.fps)
    assert probe["indices"] == sampled_frames(video.frames, video.fps, SETTINGS)
    assert keys_of(np.load(tmp_path / "frames.npy")) == video.frame_keys


def test_the_worker_decoder_takes_what_the_gateway_takes_and_nothing_else():
    from engine_ext import video_decoder

    assert video_decoder.SGLANG_WRAPPER in video_decoder.PyAVVideoDecoder.__mro__  # SGLang's isinstance checks hold
    with pytest.raises(ValueError, match="ffv1 is not accepted"):
        video_decoder.PyAVVideoDecoder(streams(("ffv1", BLUE, 64, 8), ("libx264", RED, 64, 8)))
    with pytest.raises(ValueError, match="not MP4"):  # a playlist naming a URL is never opened
        video_decoder.PyAVVideoDecoder(b"#EXTM3U\n#EXTINF:1,\nhttp://127.0.0.1:1/x.ts\n")
    # Stream 0 and only stream 0, even where FFmpeg would rank another one best.
    decoder = video_decoder.PyAVVideoDecoder(TWO_PICTURES)
    assert (len(decoder), decoder.frame_shape) == (4, (64, 64))
    assert decoder[-1].shape == (64, 64, 3) and decoder.get_frames_at([]).shape == (0, 64, 64, 3)
    assert np.array_equal(decoder.get_frames_at([3, 0, 3]), decoder.get_frames_at([0, 3])[[1, 0, 1]])


def test_decord_is_neither_installed_by_the_requirements_nor_imported():
    requirements = (ROOT / "requirements" / "sglang-cpu.txt").read_text()
    listed = [line.split("#")[0].strip() for line in requirements.splitlines()]
    assert not [line for line in listed if re.match(r"decord\b", line, re.I)], "requirements install decord"
    importers = []
    for package in ("gateway", "engine_ext", "launcher", "bundled", "plan", "store", "settings", "offline"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(name.split(".")[0] == "decord" for name in names):
                    importers.append(os.path.relpath(path, ROOT))
    assert not importers, importers
