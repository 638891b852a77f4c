"""bench/load.py's reading of a py-spy profile: each frame counted once per sample it is on the stack of."""

from __future__ import annotations

from pathlib import Path

from bench.load import profile_summary


def test_a_profile_is_summed_by_the_samples_each_frame_is_on(tmp_path: Path) -> None:
    collapsed = tmp_path / "gateway.txt"
    collapsed.write_text("main (a.py:1);handle (b.py:2);send (c.py:3) 6\n"
                         "main (a.py:1);handle (b.py:2);handle (b.py:2) 3\n"  # recursion: counted once
                         "main (a.py:1);idle (d.py:4) 1\n"
                         "a line py-spy did not write\n")
    lines = profile_summary(collapsed).splitlines()
    assert lines[0].startswith("10 samples")
    shares = {line.split("%  ")[1]: float(line.split("%")[0]) for line in lines[1:]}
    assert shares == {"main (a.py:1)": 100.0, "handle (b.py:2)": 90.0, "send (c.py:3)": 60.0, "idle (d.py:4)": 10.0}
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert profile_summary(empty) == "no samples"
