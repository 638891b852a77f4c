"""The soak's creation watch reports each file made in its folder, and nothing when none is made."""

from __future__ import annotations

import threading
import time

from soak.created import Created


def test_names_made_in_the_folder_are_reported(tmp_path) -> None:
    with Created(tmp_path) as created:
        assert created.names(timeout=0.05) == []
        (tmp_path / "a").write_bytes(b"1")
        (tmp_path / "b.tmp").write_bytes(b"2")
        assert sorted(created.names(timeout=1.0)) == ["a", "b.tmp"]
        (tmp_path / "a").write_bytes(b"again")  # written, not made
        assert created.names(timeout=0.05) == []


def test_a_file_made_while_waiting_wakes_the_watch(tmp_path) -> None:
    def make() -> None:
        time.sleep(0.2)
        (tmp_path / "late").touch()

    with Created(tmp_path) as created:
        maker = threading.Thread(target=make)
        maker.start()
        started = time.monotonic()
        names = created.names(timeout=5.0)
        maker.join()
    assert names == ["late"]
    assert time.monotonic() - started < 4.0
