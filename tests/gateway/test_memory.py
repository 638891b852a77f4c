"""Giving a large body's freed memory back (gateway/memory.py): on glibc, after a large request only, coalesced."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import platform
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from PIL import Image

from gateway.memory import MemoryTrim

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) * 1024


def given_back_after_a_large_body_and_not_after_a_small_one() -> None:
    """The measurement, in an interpreter of its own (the test below): a heap other tests have used holds pages
    this process's earlier allocations keep, and what one trim gives back there depends on them."""
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


def test_freed_heap_memory_goes_back_after_a_large_body_and_not_after_a_small_one():
    ran = subprocess.run([sys.executable, "-c", "from tests.gateway.test_memory import given_back_after_a_large_body"
                          "_and_not_after_a_small_one as run; run()"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]


def test_without_glibcs_trim_nothing_is_done(monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "no-such-libc.so")
    trim = MemoryTrim(threshold_bytes=1)
    trim.after(1 << 30)  # no running loop needed: nothing is scheduled
    assert trim.trims == 0


def test_a_large_images_decoding_gives_its_memory_back_and_a_small_ones_does_not():
    """A 170 KB PNG can decode to hundreds of MB: what its decoding held is given back once it is done, whatever the
    size of the body it came in."""
    from gateway.config import GatewayConfig
    from gateway.image_fetch import ImageFetcher
    from gateway.intake import DECODED_BYTES_PER_PIXEL, Intake
    from tests.images_lib import data_url, encode, noise_image

    def chat(url: str) -> bytes:
        return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]})

    async def main() -> None:
        config = GatewayConfig(model="m", workers=("http://127.0.0.1:1",))
        trim = MemoryTrim(threshold_bytes=DECODED_BYTES_PER_PIXEL * 1000 * 1000)
        intake = Intake(config, ImageFetcher(config.images), memory=trim)
        try:
            await intake.process(chat(data_url(encode(noise_image(64, 64)))), namespace="n")
            assert trim._task is None
            await intake.process(chat(data_url(encode(Image.new("L", (1000, 1000))))), namespace="n")  # ~5 KB
            assert trim._task is not None
            await trim._task
            assert trim.trims == 1
        finally:
            await intake.aclose()

    asyncio.run(main())
