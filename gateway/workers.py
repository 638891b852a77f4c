"""The pool of SGLang workers: health, load, and the choice of worker per request.

A background task polls every worker's ``/health``. A request goes to the healthy
worker with the fewest requests in flight (ties: the one used least recently). A
worker that fails a request is marked down at once and comes back when its health
check passes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import httpx

from gateway.errors import NoHealthyWorker

log = logging.getLogger(__name__)


# How many more requests in flight a preferred worker (one that holds the request's images) may have than the
# least-loaded one and still be chosen.
AFFINITY_SLACK = 2

@dataclass(slots=True)
class Worker:
    url: str
    healthy: bool = False
    inflight: int = 0
    served: int = 0
    failures: int = 0
    missed_checks: int = 0
    last_error: str | None = None
    last_checked: float = 0.0
    _last_used: int = field(default=0, repr=False)

    def snapshot(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "served": self.served,
            "failures": self.failures,
            "last_error": self.last_error,
        }


class WorkerPool:
    def __init__(
        self, urls: Iterable[str], client: httpx.AsyncClient, *, interval_s: float, timeout_s: float,
        misses_allowed: int = 3,
    ):
        self.workers = [Worker(url) for url in urls]
        self._client = client
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._misses_allowed = misses_allowed
        self._task: asyncio.Task | None = None
        self._ticket = itertools.count(1)

    @property
    def ready(self) -> bool:
        return any(w.healthy for w in self.workers)

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="worker-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.check_all()
            except Exception:  # keep polling whatever one round did
                log.exception("health check round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.workers))

    async def _check(self, worker: Worker) -> None:
        refused = False
        try:
            response = await self._client.get(worker.url + "/health", timeout=self._timeout_s)
            ok, error = response.status_code == 200, f"health returned HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"health check failed: {type(exc).__name__}: {exc}"
            refused = isinstance(exc, httpx.ConnectError)
        worker.last_checked = time.monotonic()
        worker.missed_checks = 0 if ok else worker.missed_checks + 1
        # SGLang's /health waits for its scheduler, which is deaf during a long prefill.
        # So: a refused connection (nothing listening) takes a worker out at once; slow or
        # failed answers only after several in a row, and never while the worker has our
        # requests in flight (those report their own failures).
        tolerated = worker.inflight > 0 or worker.missed_checks < self._misses_allowed
        healthy = ok or (worker.healthy and not refused and tolerated)
        if healthy != worker.healthy:
            log.info("worker %s is now %s", worker.url, "up" if healthy else f"down ({error})")
        worker.healthy = healthy
        worker.last_error = None if ok else error

    def choose(self, exclude: Iterable[Worker] = (), prefer: str | None = None) -> Worker:
        """The least-loaded healthy worker; the preferred one (cache affinity) unless it is busier than that by
        more than AFFINITY_SLACK requests."""
        excluded = {id(w) for w in exclude}
        candidates = [w for w in self.workers if w.healthy and id(w) not in excluded]
        if not candidates:
            raise NoHealthyWorker("no healthy worker is available; try again shortly")
        best = min(candidates, key=lambda w: (w.inflight, w._last_used))
        if prefer is not None:
            for worker in candidates:
                if worker.url == prefer and worker.inflight <= best.inflight + AFFINITY_SLACK:
                    return worker
        return best

    @contextlib.asynccontextmanager
    async def lease(self, worker: Worker) -> AsyncIterator[Worker]:
        """Count a request against ``worker`` for as long as the block runs."""
        worker.inflight += 1
        worker._last_used = next(self._ticket)
        try:
            yield worker
        finally:
            worker.inflight -= 1

    def mark_failed(self, worker: Worker, error: str) -> None:
        worker.failures += 1
        worker.last_error = error
        if worker.healthy:
            log.warning("worker %s marked down: %s", worker.url, error)
        worker.healthy = False
