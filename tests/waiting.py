"""Waiting in a test for something that happens on another thread or task: poll, with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def until(condition: Callable[[], object], what: object = "", timeout: float = 5.0) -> None:
    """Wait, polling every 10 ms on the event loop, for ``condition()`` to be true (AssertionError naming ``what``
    after ``timeout`` seconds)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not reached in {timeout:g} s: {what}")
        await asyncio.sleep(0.01)


def wait_until(condition: Callable[[], T], what: object = "", timeout: float = 60.0, interval: float = 0.05) -> T:
    """Wait, polling every ``interval`` seconds on this thread, for ``condition()`` to be true; return what it
    returned (AssertionError naming ``what`` after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout:g} s: {what}")
        time.sleep(interval)
    return found
