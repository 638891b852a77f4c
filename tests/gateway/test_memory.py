"""Giving a large body's freed memory back (gateway/memory.py): on glibc, after a large request only, coalesced."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import platform

import pytest

from gateway.memory import MemoryTrim

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) * 1024


def test_freed_heap_memory_goes_back_after_a_large_body_and_not_after_a_small_one():
    async def main() -> None:
        trim = MemoryTrim(threshold_bytes=1 << 20)
        trim.after(1000)
        assert trim._task is None and trim.trims == 0  # a small body: nothing to give back
        # Heap memory that malloc keeps: 64 KiB chunks (below its mmap threshold, as a body's are), each freed with
        # a small live block (malloc's too, past pymalloc's 512 bytes) after it.
        pairs = [(bytes(65536 - 64), bytes(1000)) for _ in range(3000)]
        keep = [small for _, small in pairs]
        del pairs
        held = rss()
        trim.after(2 << 20)
        trim.after(2 << 20)  # before the trim started: the same trim serves both
        assert trim._task is not None
        await asyncio.sleep(0)  # the trim is under way, on its thread
        trim.after(2 << 20)  # while it runs: one more afterwards, not one each
        trim.after(2 << 20)
        await trim._task
        assert trim.trims == 2
        assert rss() < held - (100 << 20), (held, rss())
        assert keep

    asyncio.run(main())


def test_without_glibcs_trim_nothing_is_done(monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "no-such-libc.so")
    trim = MemoryTrim(threshold_bytes=1)
    trim.after(1 << 30)  # no running loop needed: nothing is scheduled
    assert trim.trims == 0
