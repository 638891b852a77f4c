"""The premises of bench/video_quality.py and bench/video_ttft.py, without their workers."""

from __future__ import annotations

import random

from bench import video_quality, video_ttft
from bundled import QWEN2_5_VL
from bundled.reader.panels import random_panel
from gateway.config import ProcessorSettings, VideoSettings
from gateway.videos import open_video
from tests.videos_lib import encode_video


def test_a_panel_recording_keeps_the_oracles_token_grid(tiny_models) -> None:
    """SGLang's video resize must leave the recording as drawn (the oracle reads panels on its token grid only; its
    processor's patch and merge sizes are its family's, the video bounds SGLang's own)."""
    processor = ProcessorSettings.from_model_dir(tiny_models[QWEN2_5_VL])
    panel = random_panel(random.Random(5), min_fields=2)
    frames = video_quality.frames_of(panel)
    video = open_video(encode_video(frames, fps=video_quality.FPS, lossless=True), settings=VideoSettings(),
                       processor=processor, model="m", namespace="n")
    assert video.grid == (12, 12) and len(video.patches) == video_quality.FRAMES // 2
    assert frames[0].shape == (video_quality.CANVAS, video_quality.CANVAS, 3)


def test_a_clip_not_installed_is_replaced_by_a_synthetic_still_camera(capsys) -> None:
    name, frames, fps = video_ttft.clip("not-installed.avi")
    assert name.startswith("walker") and len(frames) == 60 and fps == 4.0
    assert "not-installed.avi: not installed" in capsys.readouterr().out
