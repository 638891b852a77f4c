"""How late the event loop runs: the gateway's own measure of anything that blocks it.

A task sleeps ``interval_s`` again and again and records how much later than asked it woke up. Work that holds the
loop (a synchronous store call, a large JSON parse) shows up as lag of about its duration; an idle or healthy loop
shows lag well under a millisecond. Exported as the ``revisit_event_loop_lag_seconds`` histogram, and kept as a
running maximum that :meth:`LoopLag.window` resets (what the loop-stall test reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class LoopLag:
    """Samples the loop's lag every ``interval_s`` once started; one per app."""

    def __init__(self, registry: CollectorRegistry, interval_s: float) -> None:
        self.interval_s = interval_s
        self.max_lag_s = 0.0
        self.samples = 0
        self._histogram = Histogram("revisit_event_loop_lag_seconds",
                                    "How much later than asked the gateway's event loop woke a sleeping task.",
                                    buckets=BUCKETS, registry=registry)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sample(), name="revisit-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @contextlib.contextmanager
    def window(self) -> Iterator[LoopLag]:
        """Reset the running maximum and sample count; read them on exit for what happened inside."""
        self.max_lag_s, self.samples = 0.0, 0
        yield self

    async def _sample(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - asked - self.interval_s)
            self.max_lag_s = max(self.max_lag_s, lag)
            self.samples += 1
            self._histogram.observe(lag)
