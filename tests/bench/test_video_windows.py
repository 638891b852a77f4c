"""bench/video_windows.py on a clip of its own: a still camera, someone walking past, windows sliding over it."""

from __future__ import annotations

import sys

from bench import video_windows
from tests.videos_lib import walker


def test_windows_of_a_still_camera_find_their_earlier_patches(tmp_path, monkeypatch, capsys) -> None:
    clip = tmp_path / "walker.mp4"
    clip.write_bytes(video_windows.encode(walker("chelsea.png", frames=40, size=(224, 224)), 4, 18))
    monkeypatch.setattr(sys, "argv", ["video_windows.py", "--clips", str(clip), "missing.avi", "--window", "4",
                                      "--slide", "2"])
    video_windows.main()
    out = capsys.readouterr().out
    assert "4 windows of 4 s every 2 s" in out
    assert "sliding, after the first window: 12 patches: exact 0 (0%), approximate 12 (100%)" in out
    assert "re-sent at CRF 32 (sent at 18): 16 patches: exact 0 (0%), approximate 16 (100%)" in out
    assert "missing.avi: not installed" in out
