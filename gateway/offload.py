"""Keeping CPU work off the event loop.

The loop serves every request and every relayed stream at once, so nothing on it may take more than a few
milliseconds. Work whose cost grows with the input (JSON and base64 of request bodies up to 64 MiB, image
decoding, hashing) runs on a thread once the input is large enough for that to matter; below the threshold the
thread hop would cost more than the work. Store and policy work has a thread of its own (gateway/cache.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Inputs above this many bytes are handled on a thread: ~0.1-1 ms of JSON, base64 or hashing.
OFF_LOOP_BYTES = 256 * 1024


async def off_loop(size: int, work: Callable[..., T], /, *args: object) -> T:
    """``work(*args)``, on a thread when ``size`` (the bytes it handles) exceeds OFF_LOOP_BYTES."""
    if size > OFF_LOOP_BYTES:
        return await asyncio.to_thread(work, *args)
    return work(*args)
