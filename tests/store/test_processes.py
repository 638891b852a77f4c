"""Real processes sharing one store: concurrent readers never see torn or wrong data; a killed writer leaves none."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from store import DramTier, LmdbTier
from store.dram import TEMP_PREFIX
from tests.store import workers

CTX = multiprocessing.get_context("spawn")
# How long a process may take to start (a spawned interpreter importing the store on a busy 2-core machine: up to
# ~50 s measured inside the full suite) and finish: a bound on a hang, not a speed target.
PROCESS_TIMEOUT_S = 300


@pytest.mark.parametrize("kind", ["dram", "lmdb", "tiered"])
def test_two_writers_four_readers(store_config, kind):
    duration_s = 2.0
    barrier, results, writers_left = CTX.Barrier(6), CTX.Queue(), CTX.Value("i", 2)
    procs = [CTX.Process(target=workers.writer,
                         args=(kind, store_config, i, barrier, duration_s, results, writers_left))
             for i in range(2)]
    procs += [CTX.Process(target=workers.reader,
                          args=(kind, store_config, 10 + i, barrier, duration_s, results, writers_left))
              for i in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=PROCESS_TIMEOUT_S)
    assert [proc.exitcode for proc in procs] == [0] * len(procs)
    reports = [results.get(timeout=5) for _ in procs]
    readers = [r for r in reports if r.role == "reader"]
    assert all(r.mismatches == 0 and r.damaged_reads == 0 for r in reports), reports
    assert all(r.verified_reads > 0 for r in readers), reports
    assert all(r.operations >= workers.MIN_WRITES for r in reports if r.role == "writer"), reports


def test_dram_writer_killed_mid_put_leaves_no_partial_entry(store_config):
    proc = CTX.Process(target=workers.slow_dram_writer, args=(store_config,))
    proc.start()
    path = store_config.dram_path
    deadline = time.monotonic() + 60
    temps: list[str] = []
    try:
        # Freeze the writer as soon as a temp file shows; if that put is still under way (its temp file still
        # there), kill it now, frozen mid-put; otherwise let it go on and try again with the next put.
        while not temps and time.monotonic() < deadline and proc.is_alive():
            seen = [name for name in os.listdir(path) if name.startswith(TEMP_PREFIX)] if path.is_dir() else []
            if not seen:
                continue
            os.kill(proc.pid, signal.SIGSTOP)
            temps = [name for name in seen if (path / name).exists()]
            if not temps:
                os.kill(proc.pid, signal.SIGCONT)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(timeout=10)
    assert temps, "the writer was never caught inside a put"
    half_written_key = temps[0].split(".")[3]
    store = DramTier(path, pin_host_memory=False)
    assert store.removed_stale_temps >= 1
    assert not [name for name in os.listdir(path) if name.startswith(TEMP_PREFIX)]
    assert store.get(half_written_key) is None and not store.contains(half_written_key)
    for key in store.keys():
        with store.get(key) as view:
            assert view.header.num_layers == 28
    assert store.stats().damaged_reads == 0


def test_lmdb_writer_killed_mid_put_leaves_no_partial_entry(store_config):
    in_put, completed = CTX.Value("i", 0), CTX.Value("i", 0)
    proc = CTX.Process(target=workers.lmdb_writer_until_killed, args=(store_config, in_put, completed))
    proc.start()
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.is_alive() and not (completed.value >= 2 and in_put.value):
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(timeout=10)
    done = completed.value
    assert done >= 2 and in_put.value == 1, "killed inside put()"
    store = LmdbTier(store_config.lmdb_path)
    keys = list(store.keys())
    assert done <= len(keys) <= done + 1  # the killed put either committed whole or not at all
    for key in keys:
        with store.get(key) as view:
            assert view.header.num_layers == 28
    assert store.stats().damaged_reads == 0
    store.close()


def test_lmdb_reader_adopts_a_map_grown_by_another_process(store_config):
    small = LmdbTier(store_config.lmdb_path, map_size=1 << 20)
    before = small.map_size
    proc = CTX.Process(target=workers.lmdb_filler, args=(store_config.__class__(
        name=store_config.name, lmdb_dir=store_config.lmdb_path, lmdb_map_size=1 << 20), 80))
    proc.start()
    proc.join(timeout=PROCESS_TIMEOUT_S)
    assert proc.exitcode == 0
    assert len(list(small.keys())) == 80
    assert all(small.get(key) is not None for key in small.keys())
    assert small.map_size > before
    small.close()
