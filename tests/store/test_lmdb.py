"""The LMDB tier's map: starts tiny, grows geometrically, never remaps under an open handle, stops at its maximum."""

from __future__ import annotations

import threading
import time

import pytest

from store import LmdbTier, StoreError, StoreFullError
from tests.store.entries import key_for, make_entry


def test_map_grows_past_a_tiny_start(tmp_path):
    tier = LmdbTier(tmp_path, map_size=64 << 10, growth_factor=2.0)
    start = tier.map_size
    entries = {key_for(i): make_entry(i)[0] for i in range(40)}  # ~40 KiB each: ~25x the initial map
    for key, entry in entries.items():
        tier.put(key, entry)
    assert tier.map_size > 16 * start
    for key, entry in entries.items():
        with tier.get(key) as view:
            assert bytes(view.buffer) == entry.data
    tier.close()
    reopened = LmdbTier(tmp_path, map_size=64 << 10)
    assert reopened.map_size >= 16 * start and reopened.stats().entries == 40
    reopened.close()


def test_one_entry_larger_than_several_doublings(tmp_path):
    tier = LmdbTier(tmp_path, map_size=64 << 10)
    entry = make_entry(1, layers=16, tokens=512, head_dim=32)[0]  # ~2 MiB
    tier.put(key_for(1), entry)
    assert tier.get(key_for(1)) is not None
    tier.close()


def test_growth_waits_for_open_handles_then_gives_up(tmp_path):
    tier = LmdbTier(tmp_path, map_size=128 << 10, grow_wait_s=0.2)
    tier.put(key_for(0), make_entry(0)[0])
    view = tier.get(key_for(0))
    before = bytes(view.buffer)
    with pytest.raises(StoreFullError):
        for i in range(1, 20):
            tier.put(key_for(i), make_entry(i)[0])
    assert bytes(view.buffer) == before, "the open handle's memory was not remapped"
    view.close()
    for i in range(1, 20):
        tier.put(key_for(i), make_entry(i)[0])
    assert tier.stats().entries == 20
    tier.close()


def test_map_stops_at_its_maximum(tmp_path):
    tier = LmdbTier(tmp_path, map_size=64 << 10, max_map_size=256 << 10)
    with pytest.raises(StoreFullError):
        for i in range(20):
            tier.put(key_for(i), make_entry(i)[0])
    assert tier.map_size == 256 << 10
    assert all(tier.get(key) is not None for key in tier.keys())
    tier.close()


def test_close_with_an_open_handle_defers(tmp_path):
    tier = LmdbTier(tmp_path, map_size=1 << 20)
    entry = make_entry(1)[0]
    tier.put(key_for(1), entry)
    view = tier.get(key_for(1))
    tier.close()
    assert bytes(view.buffer) == entry.data
    view.close()
    tier.close()


def test_unopenable_path_is_a_store_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError):
        LmdbTier(blocker / "lmdb")


def test_growth_under_reader_threads(tmp_path):
    """The map grows while other threads keep opening and closing handles; nobody sees a remapped buffer."""
    tier = LmdbTier(tmp_path, map_size=64 << 10, grow_wait_s=5.0, sync=False)
    entries = {key_for(i): make_entry(i)[0] for i in range(30)}
    first = next(iter(entries))
    tier.put(first, entries[first])
    stop = threading.Event()
    failures: list[str] = []

    def read_loop() -> None:
        while not stop.is_set():
            for key in list(tier.keys()):
                with tier.get(key) as view:
                    if bytes(view.buffer) != entries[key].data:
                        failures.append(key)
                time.sleep(0.001)  # readers that never yield the GIL starve the writer for seconds

    readers = [threading.Thread(target=read_loop) for _ in range(3)]
    for thread in readers:
        thread.start()
    try:
        for key, entry in entries.items():
            tier.put(key, entry)
    finally:
        stop.set()
        for thread in readers:
            thread.join(timeout=10)
    assert not failures and tier.map_size >= 16 * (64 << 10)
    tier.close()
