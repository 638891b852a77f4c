"""Video parts in the gateway: the frames it keys are the ones the model samples, with the pixels the worker's
decoder gets; and a video outside the limits, or not a video, is refused before its frames are decoded."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from gateway.config import ImageLimits, ProcessorSettings, VideoSettings
from gateway.errors import PayloadTooLarge, UnprocessableVideo
from gateway.images import canonicalize, content_key
from gateway.videos import FrameBook, open_video, sampled_frames
from tests.images_lib import encode, small
from tests.videos_lib import decoded_frames, encode_video, pan

PROCESSOR = ProcessorSettings()
SETTINGS = VideoSettings()


def opened(data: bytes, settings: VideoSettings = SETTINGS, namespace: str = "default"):
    return open_video(data, settings=settings, processor=PROCESSOR, model="m", namespace=namespace)


@pytest.mark.parametrize("total, fps", [(2, 1.0), (3, 30.0), (12, 4.0), (13, 4.0), (24, 24.0), (300, 30.0),
                                        (301, 29.97), (90, 2.0), (5000, 25.0), (7, 0.5)])
def test_frames_sampled_as_sglangs_qwen_vl_processor_samples_them(total, fps):
    from sglang.srt.multimodal.processors.qwen_vl import smart_nframes

    count = smart_nframes({}, total_frames=total, video_fps=fps)
    expected = np.unique(np.linspace(0, total - 1, num=count, dtype=np.int64)).tolist()
    assert sampled_frames(total, fps, SETTINGS) == expected


def test_a_single_frame_video_is_refused():
    with pytest.raises(UnprocessableVideo, match="at least 2"):
        sampled_frames(1, 30.0, SETTINGS)


@pytest.mark.parametrize("codec, fmt, mime", [("libx264", "mp4", "video/mp4"), ("libvpx-vp9", "webm", "video/webm"),
                                              ("mpeg4", "avi", "video/x-msvideo")])
def test_frame_keys_are_the_image_keys_of_the_decoded_frames(codec, fmt, mime):
    data = encode_video(pan(frames=12), fps=4, codec=codec, fmt=fmt)
    video = opened(data)
    assert (video.frames, video.fps, video.width, video.height, video.mime) == (12, 4.0, 112, 112, mime)
    wanted = sampled_frames(12, 4.0, SETTINGS)
    assert len(wanted) == len(video.frame_keys) == 6
    frames = decoded_frames(data)
    assert list(video.frame_keys) == [content_key(frames[i], model="m", namespace="default", processor=PROCESSOR)
                                      for i in wanted]
    # A frame sent as a PNG image gets the very key its place in the video has.
    as_image = canonicalize(encode(frames[wanted[2]]), limits=ImageLimits(), processor=PROCESSOR, model="m",
                            namespace="default")
    assert as_image.key == video.frame_keys[2]


def test_frames_larger_than_the_model_keeps_are_keyed_as_the_same_pictures_sent_as_images():
    small_model = ProcessorSettings(min_pixels=28 * 28, max_pixels=56 * 56)  # the 112 x 112 frames are resized
    data = encode_video(pan(frames=12), fps=4)
    video = open_video(data, settings=SETTINGS, processor=small_model, model="m", namespace="default")
    frame = decoded_frames(data)[sampled_frames(12, 4.0, SETTINGS)[2]]
    as_image = canonicalize(encode(frame), limits=ImageLimits(), processor=small_model, model="m",
                            namespace="default")
    assert Image.open(io.BytesIO(as_image.payload)).size == (56, 56)
    assert as_image.key == video.frame_keys[2]


def test_keys_belong_to_the_namespace():
    data = encode_video(pan(frames=8))
    a, b = opened(data, namespace="a"), opened(data, namespace="b")
    assert a.key != b.key and not set(a.frame_keys) & set(b.frame_keys)


@pytest.mark.parametrize("settings, code", [
    (VideoSettings(max_seconds=2.0), "video_too_long"),
    (VideoSettings(max_frames=10), "video_too_large"),
    (VideoSettings(max_frame_pixels=100 * 100), "video_too_large"),
])
def test_limits(settings, code):
    data = encode_video(pan(frames=12), fps=4)  # 3 s, 12 frames of 112 x 112
    with pytest.raises(PayloadTooLarge) as info:
        opened(data, settings)
    assert info.value.code == code and info.value.status_code == 413


@pytest.mark.parametrize("data", [
    b"",
    b"not a video at all",
    encode(small("astronaut.png")),  # an image
    b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64,  # an MP4 header and nothing else
    b"#EXTM3U\n#EXTINF:1,\nhttp://127.0.0.1:1/x.ts\n",  # a playlist naming a URL: never opened
])
def test_what_is_not_a_readable_video(data):
    with pytest.raises(UnprocessableVideo) as info:
        opened(data)
    assert info.value.status_code == 422 and info.value.code == "invalid_video"


def test_a_truncated_video_is_refused():
    data = encode_video(pan(frames=24), fps=8)
    for cut in (len(data) // 3, len(data) // 2):
        with pytest.raises((UnprocessableVideo, PayloadTooLarge)):
            opened(data[:cut])


def test_audio_only_is_refused():
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for _ in range(4):
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    with pytest.raises(UnprocessableVideo, match="no video stream"):
        opened(out.getvalue())


def test_the_frame_book_counts_what_was_seen_before():
    book = FrameBook()
    # Frames 0..11 of a pan, then frames 6..17 of it, lossless: a picture in both decodes the same in both.
    first = opened(encode_video(pan(frames=12), fps=4, lossless=True))
    later = opened(encode_video(pan(frames=12, start=6), fps=4, lossless=True))
    stored = frozenset(first.frame_keys[:1])
    seen = book.record(first, stored)
    assert (seen.sampled, seen.as_image, seen.in_video, seen.new) == (6, 1, 0, 5)
    again = book.record(first, frozenset())
    assert (again.in_video, again.new) == (6, 0)
    overlap = book.record(later, frozenset())
    assert overlap.in_video == len(set(later.frame_keys) & set(first.frame_keys)) > 0
    assert overlap.header() == f"6;seen_as_image=0;seen_in_video={overlap.in_video}"
