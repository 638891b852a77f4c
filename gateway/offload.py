"""Keeping CPU work off the event loop.

The loop serves every request and every relayed stream at once, so nothing on it may take more than a few
milliseconds. Work whose cost grows with the input (JSON and base64 of request bodies up to 64 MiB, image
decoding, hashing) runs on a thread once the input is large enough for that to matter; below the threshold the
thread hop would cost more than the work. Store and policy work has a thread of its own (gateway/cache.py).

Within :func:`lane` (what intake opens around one request), that thread is one of a :class:`gateway.pools.FairPool`
and the work waits in the caller's turn: one caller's many large images or bodies hold up only itself. Elsewhere
it is asyncio's default executor.

A thread still holds the GIL between the C calls its work is cut into (base64 in slices of 256 KiB, JSON checked in
slices), and the loop, woken for its next event, waits for it: CPython takes the GIL from a thread that does not give
it up only after the switch interval (5 ms by default), so a loop behind a busy thread waited up to that plus one
slice at every wake-up. :func:`keep_gil_turns_short` makes the interval SWITCH_INTERVAL_S for the gateway's process.
Measured (a 26.7 MB body of one PNG through the whole gateway, a stub worker, 2-core machine): the loop's worst lag
while the image's base64 was decoded went from 9-11 ms to under 8; what is left is one C call that makes a string
of the whole data URL while the body is parsed (20-25 ms, mostly page faults of a new 27 MB block).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from gateway.pools import FairPool

T = TypeVar("T")

# Inputs above this many bytes are handled on a thread: ~0.1-1 ms of JSON, base64 or hashing.
OFF_LOOP_BYTES = 256 * 1024
SWITCH_INTERVAL_S = 0.001  # the longest a thread keeps the GIL from the waiting loop, past its current C call

# The pool and caller that thread work of the current task goes to (see lane).
_LANE: contextvars.ContextVar[tuple[FairPool, str] | None] = contextvars.ContextVar("revisit_offload_lane",
                                                                                     default=None)


@contextlib.contextmanager
def lane(pool: FairPool, caller: str) -> Iterator[None]:
    """Within it, :func:`on_thread` and :func:`off_loop` (of this task, and of the tasks it starts) run their work
    on ``pool`` in ``caller``'s turn."""
    token = _LANE.set((pool, caller))
    try:
        yield
    finally:
        _LANE.reset(token)


async def on_thread(work: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``work(*args, **kwargs)`` on a thread: the lane's pool in the caller's turn, else the default executor."""
    return await on_thread_costing(0, work, *args, **kwargs)


async def on_thread_costing(cost: int, work: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """:func:`on_thread` for work of this cost (the memory it holds while it runs), started within the lane's pool's
    cost budgets."""
    current = _LANE.get()
    if current is None:
        return await asyncio.to_thread(work, *args, **kwargs)
    pool, caller = current
    return await pool.run_costing(caller, cost, work, *args, **kwargs)


async def off_loop(size: int, work: Callable[..., T], /, *args: object, cost: int = 0) -> T:
    """``work(*args)``, on a thread (:func:`on_thread_costing`, of this ``cost``) when ``size`` (the bytes it
    handles) exceeds OFF_LOOP_BYTES."""
    if size > OFF_LOOP_BYTES:
        return await on_thread_costing(cost, work, *args)
    return work(*args)


def keep_gil_turns_short() -> None:
    """Let the event loop's thread take the GIL from a busy thread within SWITCH_INTERVAL_S (see the module's doc):
    process-wide, set when the gateway starts (never raised: a process that asked for shorter turns keeps them)."""
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
