"""Giving memory back to the system after a large request body or a large image's decoding, so that a burst of them
does not leave the gateway larger for good.

A body arrives in the server's chunks (64 KiB each), each its own allocation from glibc's heaps; they are joined
and freed, and so are the parsed copies, but the heaps keep the freed space wherever a live object sits above it,
and glibc gives heap memory back only from the top. ``malloc_trim(0)`` hands every free page inside the heaps
back (madvise). It runs on a thread of its own after a request that held at least ``threshold_bytes`` of body has
ended, and after an image whose decoding held that much (gateway/intake.py: a 170 KB PNG may decode to 150 MiB), at
most one at a time (those that end meanwhile ask for one more), never on the event loop. Measured with
a gateway taking three bursts of four bodies (two of 50 MB of text, two of 16 MB of ``[{},...]``) at once, 102 MiB
before: 106-132 MiB after without it, 102 MiB with it. Where the C library is not glibc (musl, macOS), nothing is
done.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD_BYTES = 8 << 20


def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class MemoryTrim:
    """``after(held_bytes)`` once a request has ended or an image is decoded; trims (module docstring) when what it
    held was large."""

    def __init__(self, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES) -> None:
        self.threshold_bytes = threshold_bytes
        self._trim = _malloc_trim()
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self.trims = 0

    def after(self, held_bytes: int) -> None:
        if self._trim is None or held_bytes < self.threshold_bytes:
            return
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="memory-trim")

    async def _run(self) -> None:
        assert self._trim is not None
        while True:
            self._again = False
            try:
                await asyncio.to_thread(self._trim, 0)
            except Exception:  # noqa: BLE001 - an optimisation; never the request's failure
                log.exception("malloc_trim failed")
                return
            self.trims += 1
            if not self._again:
                return
