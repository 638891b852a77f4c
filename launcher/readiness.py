"""Waiting for a worker's ``/health`` to answer 200, in sync and async flavours.

Both flavours poll the same way: one GET per ``interval``, a progress line every
``progress_every`` seconds, and an immediate :class:`WorkerExitedError` (with the log tail) when
the watched process has died, instead of waiting out the timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import httpx

from launcher.errors import WorkerExitedError, WorkerTimeoutError

ProgressCallback = Callable[[str], None]

POLL_INTERVAL_S = 1.0
PROGRESS_EVERY_S = 10.0
_REQUEST_TIMEOUT = httpx.Timeout(5.0)


class WatchedProcess(Protocol):
    """What readiness needs from a worker process (``launcher.WorkerProcess`` provides it)."""

    def exit_code(self) -> int | None: ...

    def log_tail(self, lines: int = ...) -> str: ...


class _Poll:
    """The policy shared by both flavours; the flavours only do the I/O and the sleeping."""

    def __init__(
        self,
        url: str,
        timeout: float,
        on_progress: ProgressCallback | None,
        worker: WatchedProcess | None,
    ) -> None:
        self.health_url = url.rstrip("/") + "/health"
        self.timeout = timeout
        self.on_progress = on_progress
        self.worker = worker
        self.started = time.monotonic()
        self.next_progress = self.started + PROGRESS_EVERY_S
        self.last_status = "no answer yet"

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def check_alive(self) -> None:
        if self.worker is None:
            return
        code = self.worker.exit_code()
        if code is not None:
            raise WorkerExitedError(
                f"worker for {self.health_url} exited with code {code} after {self.elapsed():.1f} s "
                "before becoming ready",
                self.worker.log_tail(),
            )

    def record(self, status: int | None, error: Exception | None) -> bool:
        """Note one probe's outcome; True once the worker is ready."""
        if status == 200:
            return True
        self.last_status = f"HTTP {status}" if status is not None else type(error).__name__
        now = time.monotonic()
        if now - self.started > self.timeout:
            raise WorkerTimeoutError(
                f"{self.health_url} not ready after {self.timeout:.0f} s (last: {self.last_status})",
                self.worker.log_tail() if self.worker else "",
            )
        if self.on_progress is not None and now >= self.next_progress:
            self.next_progress = now + PROGRESS_EVERY_S
            self.on_progress(f"waiting for {self.health_url}: {self.elapsed():.0f} s ({self.last_status})")
        return False


def wait_ready(
    url: str,
    timeout: float,
    on_progress: ProgressCallback | None = None,
    *,
    worker: WatchedProcess | None = None,
    interval: float = POLL_INTERVAL_S,
) -> float:
    """Block until ``GET {url}/health`` returns 200; returns the seconds waited.

    Raises WorkerExitedError as soon as ``worker`` (if given) has exited, WorkerTimeoutError
    after ``timeout`` seconds; both carry the worker's log tail when a worker is given.
    """
    poll = _Poll(url, timeout, on_progress, worker)
    with httpx.Client(timeout=_REQUEST_TIMEOUT) as client:
        while True:
            poll.check_alive()
            status, error = None, None
            try:
                status = client.get(poll.health_url).status_code
            except httpx.HTTPError as exc:
                error = exc
            if poll.record(status, error):
                return poll.elapsed()
            time.sleep(interval)


async def wait_ready_async(
    url: str,
    timeout: float,
    on_progress: ProgressCallback | None = None,
    *,
    worker: WatchedProcess | None = None,
    interval: float = POLL_INTERVAL_S,
) -> float:
    """The awaitable twin of :func:`wait_ready`; cancelling it stops the polling."""
    poll = _Poll(url, timeout, on_progress, worker)
    async with httpx.AsyncClient(timeout=_REQUEST_TIMEOUT) as client:
        while True:
            poll.check_alive()
            status, error = None, None
            try:
                status = (await client.get(poll.health_url)).status_code
            except httpx.HTTPError as exc:
                error = exc
            if poll.record(status, error):
                return poll.elapsed()
            await asyncio.sleep(interval)
