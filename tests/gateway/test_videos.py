"""Video parts in the gateway: the frames it keys are the ones the model samples, with the pixels the worker's
decoder gets; and a video outside the limits, or not a video, is refused before its frames are decoded."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from gateway.config import ImageLimits, MatchSettings, ProcessorSettings, VideoSettings
from gateway.errors import PayloadTooLarge, UnprocessableVideo
from gateway.images import canonicalize, content_key
from gateway.matching.pixel import PixelExtractor
from gateway.videos import (
    FrameBook,
    PatchBook,
    PatchesSeen,
    open_video,
    patch_grid,
    patch_key,
    sampled_frames,
)
from tests.images_lib import encode, small
from tests.videos_lib import decoded_frames, encode_video, pan, walker

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


# --- temporal patches ---

EXTRACTOR = PixelExtractor()


def with_patches(data: bytes, namespace: str = "default"):
    return open_video(data, settings=SETTINGS, processor=PROCESSOR, model="m", namespace=namespace,
                      extractor=EXTRACTOR)


@pytest.mark.parametrize("height, width, sampled", [(112, 112, 6), (528, 720, 4), (576, 768, 160), (1080, 1920, 8),
                                                    (2160, 3840, 768), (144, 176, 4), (720, 1280, 300)])
def test_the_patch_grid_is_sglangs_resize_of_the_sampled_frames(height, width, sampled):
    from sglang.srt.multimodal.processors import qwen_vl

    max_pixels = max(min(qwen_vl.VIDEO_MAX_PIXELS, qwen_vl.VIDEO_TOTAL_PIXELS / sampled * 2),
                     int(qwen_vl.VIDEO_MIN_PIXELS * 1.05))
    resized = qwen_vl.smart_resize(height, width, factor=28, min_pixels=qwen_vl.VIDEO_MIN_PIXELS,
                                   max_pixels=max_pixels)
    assert patch_grid(height, width, sampled, PROCESSOR) == (resized[0] // 28, resized[1] // 28)


def test_a_video_has_a_temporal_patch_per_two_sampled_frames():
    video = with_patches(encode_video(pan(frames=12), fps=4))
    assert len(video.patches) == len(video.frame_keys) // 2 == 3
    rows, cols = patch_grid(112, 112, 6, PROCESSOR)
    assert all(patch.features is not None and patch.features.grid == (rows, cols) for patch in video.patches)
    assert [patch.key for patch in video.patches] == [patch_key(video.frame_keys[i], video.frame_keys[i + 1])
                                                      for i in (0, 2, 4)]
    assert video.nbytes > len(video.payload) + sum(p.features.nbytes for p in video.patches)
    plain = opened(encode_video(pan(frames=12), fps=4))  # without an extractor: keys, no features
    assert [p.features for p in plain.patches] == [None] * 3


def test_the_patch_book_counts_same_and_nearly_same_patches():
    book = PatchBook(MatchSettings(), scope="s")
    # A still camera, someone walking across: windows of 3 s a frame apart sample other instants of one scene.
    clip = walker("astronaut.png", frames=24, size=(224, 224))
    first = with_patches(encode_video(clip[0:12], fps=4))
    assert book.record(first, "default") == PatchesSeen(patches=3, exact=0, approximate=0)
    assert book.record(first, "default") == PatchesSeen(patches=3, exact=3, approximate=0)
    later = with_patches(encode_video(clip[1:13], fps=4))
    assert set(later.frame_keys).isdisjoint(first.frame_keys)
    seen = book.record(later, "default")
    assert seen == PatchesSeen(patches=3, exact=0, approximate=3)
    assert seen.header() == "3;exact=0;approximate=3"
    # The first window again, coded by another encoder: every pixel differs a little.
    reencoded = with_patches(encode_video(clip[0:12], fps=4, codec="mpeg4", fmt="avi"))
    assert set(reencoded.frame_keys).isdisjoint(first.frame_keys)
    assert book.record(reencoded, "default") == PatchesSeen(patches=3, exact=0, approximate=3)
    unrelated = with_patches(encode_video(pan("coffee.png", frames=12, size=(224, 224)), fps=4))
    assert book.record(unrelated, "default").miss == 3
    # Another namespace's patches are never candidates: its keys differ, and its lookups see only its own.
    elsewhere = with_patches(encode_video(clip[0:12], fps=4), namespace="other")
    assert book.record(elsewhere, "other") == PatchesSeen(patches=3, exact=0, approximate=0)


def test_the_patch_book_forgets_its_oldest_patches_past_its_capacity():
    first = with_patches(encode_video(pan(frames=12), fps=4))
    book = PatchBook(MatchSettings(), scope="s", capacity=sum(p.nbytes for p in first.patches))
    book.record(first, "default")
    assert len(book) == 3
    book.record(with_patches(encode_video(pan("coffee.png", frames=4), fps=4)), "default")
    assert len(book) == 3  # two of the first video's patches made room for the new video's two
    assert book.record(first, "default").exact == 1
