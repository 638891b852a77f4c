"""The pool of SGLang workers: health, load, and the choice of worker per request.

A background task polls every worker's ``/health``. A request goes to the healthy
worker with the fewest requests in flight (ties: the one used least recently), a busy
one (below) last. A worker that fails a request is marked down at once and comes back
when its health check passes again.

Busy or hung: SGLang's ``/health`` waits for its scheduler, which answers nothing during
a long prefill, whoever sent it. So when ``/health`` does not answer, the worker's own
``/metrics`` (served by its HTTP process, never queued behind the scheduler) is read for
the engine extension's forward clock (engine_ext.executor.events.ForwardClock): a forward
that started and has not ended means busy, and the worker stays up; no forward in
progress and no answer means hung, and after ``misses_allowed`` such checks it is taken
out; requests in flight keep it in only while its /metrics still answers. (A forward stuck
for good is ended by SGLang's own watchdog, which exits the worker.)

A worker taken out by its checks takes back what it was sent: requests still waiting for its first answer
(``WorkerPool.until_taken_out``) are cancelled there, and the dispatcher retries them on another worker, instead
of holding them (and their key's turns) until the upstream timeout. Streams it has begun to answer are not: their
half answer cannot be retried, and they end at the upstream read timeout.

Last resort: when no worker is healthy, a request goes to a worker whose checks went unanswered (``Worker.silent``:
slow or stopped, but something was listening) rather than failing at once: the one that missed the fewest checks,
then the least loaded. On a small machine the worker left alone with all the load while another restarts or hangs
can miss its checks for seconds and still answer; a 503 then would fail requests it serves late. A worker where
nothing listens, or that answers its checks with an error, is never tried this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import httpx

from gateway.errors import NoHealthyWorker
from plan.outcome import FORWARD_ENDED, FORWARD_STARTED

log = logging.getLogger(__name__)


# How many more requests in flight a preferred worker (one that holds the request's images) may have than the
# least-loaded one and still be chosen.
# SGLang's CPU attention backend pads an extend's queries to the whole sequence and attends over all of it
# (sglang/srt/layers/attention/torch_native_backend.py, _run_sdpa_forward_extend, 0.5.23): a prompt whose prefix its
# cache holds still pays the whole prompt's attention (a 2.3K-token image held: 2.2 s on the deep bench model, where
# its text alone takes 0.1 s). FlashInfer, FA3 and Triton run the extend's queries alone.
PADDED_EXTEND_BACKENDS = frozenset({"torch_native"})
AFFINITY_SLACK = 2

@dataclass(slots=True)
class Worker:
    url: str
    healthy: bool = False
    inflight: int = 0
    served: int = 0
    failures: int = 0
    missed_checks: int = 0
    busy_since: float | None = None  # Unix time the forward in progress started, while /health goes unanswered
    silent: bool = False  # its last check timed out (nothing refused, no error answered): slow or stopped
    last_error: str | None = None
    last_checked: float = 0.0
    # What the worker's /v1/models says of its model: {"root": ..., "max_model_len": ...}; read each time it comes up.
    model_card: dict | None = None
    # What its SGLang says of itself in /server_info, read each time it comes up: what it runs on ("cpu", "cuda",
    # ...), its KV pool's tokens (max_total_num_tokens) and its attention backend; None until it has said.
    device: str | None = None
    kv_tokens: int | None = None
    attention_backend: str | None = None

    @property
    def pads_extends(self) -> bool:
        """Whether its attention backend pads an extend after a cached prefix to the whole prompt, attending over
        the held rows again (PADDED_EXTEND_BACKENDS)."""
        return self.attention_backend in PADDED_EXTEND_BACKENDS
    _last_used: int = field(default=0, repr=False)
    # The requests waiting for its first answer (WorkerPool.until_taken_out): cancelled when it is taken out.
    _awaited: set[AwaitedAnswer] = field(default_factory=set, repr=False)

    def snapshot(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "served": self.served,
            "failures": self.failures,
            "busy_s": None if self.busy_since is None else round(max(0.0, time.time() - self.busy_since), 1),
            "silent": self.silent,
            "last_error": self.last_error,
            "device": self.device,
        }


class Lease:
    """:meth:`WorkerPool.lease`: a request counted against its worker from ``__aenter__`` to ``__aexit__`` (a plain
    object: one is made for each request sent)."""

    __slots__ = ("worker", "_tickets")

    def __init__(self, worker: Worker, tickets: Iterator[int]) -> None:
        self.worker, self._tickets = worker, tickets

    async def __aenter__(self) -> Worker:
        self.worker.inflight += 1
        self.worker._last_used = next(self._tickets)
        return self.worker

    async def __aexit__(self, *exc_info: object) -> None:
        self.worker.inflight -= 1


class AwaitedAnswer:
    """:meth:`WorkerPool.until_taken_out`: a context manager around one task's wait, which ``cancel`` cancels and
    the block's end swallows (as ``asyncio.timeout`` does its own), then ``taken_out`` is true. Any other
    cancellation of the task (its client leaving, the gateway stopping) goes through. Made for each request
    sent: a plain object, not an anyio cancel scope (a fifth of its time on asyncio)."""

    __slots__ = ("_worker", "_task", "_cancelling", "cancel_called", "taken_out")

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._task: asyncio.Task | None = None
        self._cancelling = 0
        self.cancel_called = self.taken_out = False

    def __enter__(self) -> AwaitedAnswer:
        self._task = asyncio.current_task()
        if self._task is None:
            raise RuntimeError("until_taken_out is for a task's wait")
        self._cancelling = self._task.cancelling()
        if self._worker.healthy:
            self._worker._awaited.add(self)
        return self

    def cancel(self) -> None:
        """The worker is taken out: the wait ends (a health check calls this, never the task itself)."""
        if not self.cancel_called and self._task is not None:
            self.cancel_called = True
            self._task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        self._worker._awaited.discard(self)
        if self.cancel_called and self._task is not None and self._task.uncancel() <= self._cancelling \
                and exc_type is asyncio.CancelledError:
            self.taken_out = True
            return True
        return False


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
        self.last_resort_sent = 0  # requests sent to a silent worker for want of a healthy one
        self._last_resort_logged = float("-inf")
        self.on_devices: Callable[[list[str]], None] | None = None  # told the devices the workers run on, as learnt
        self.on_up: Callable[[Worker], None] | None = None  # told of a worker that came up (first, or back)

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
        refused = timed_out = False
        try:
            response = await self._client.get(worker.url + "/health", timeout=self._timeout_s)
            ok, error = response.status_code == 200, f"health returned HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"health check failed: {type(exc).__name__}: {exc}"
            refused = isinstance(exc, httpx.ConnectError)
            timed_out = isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout)
        worker.silent = timed_out
        answering, worker.busy_since = (True, None) if ok or refused else await self._forward_clock(worker)
        worker.last_checked = time.monotonic()
        busy = worker.busy_since is not None
        worker.missed_checks = 0 if ok or busy else worker.missed_checks + 1
        # A refused connection (nothing listening) takes a worker out at once; a busy one stays; other slow or
        # failed answers only after several in a row. While the worker has our requests in flight (those report
        # their own failures) it stays too, as long as its HTTP process answers: one that answers nothing at all,
        # /health nor /metrics, is hung (stopped, swapped out, wedged), whatever it was sent.
        tolerated = (worker.inflight > 0 and answering) or worker.missed_checks < self._misses_allowed
        healthy = ok or busy or (worker.healthy and not refused and tolerated)  # busy: alive, whatever it was
        came_back = healthy and not worker.healthy
        if healthy != worker.healthy:
            log.info("worker %s is now %s", worker.url, "up" if healthy else f"down ({error})")
        worker.healthy = healthy
        # Taken out for good reason (nothing listening, or as many unanswered checks as a hang takes): what it was
        # sent and has not begun to answer goes elsewhere.
        if not healthy and (refused or worker.missed_checks >= self._misses_allowed) and worker._awaited:
            log.warning("worker %s: %d request(s) waiting for its answer go elsewhere", worker.url,
                        len(worker._awaited))
            for awaited in list(worker._awaited):
                awaited.cancel()
        worker.last_error = None if ok else error if not busy else f"busy with a forward ({error})"
        if ok and (worker.model_card is None or came_back):  # a worker back may have been restarted with another
            worker.model_card = await self._model_card(worker) or worker.model_card  # context length
            device = worker.device
            await self._read_server_info(worker)  # (or on another device)
            if worker.device != device and self.on_devices is not None:
                self.on_devices([w.device for w in self.workers if w.device is not None])
        if ok and came_back and self.on_up is not None:
            self.on_up(worker)

    async def _object(self, worker: Worker, path: str) -> dict:
        """The JSON object the worker answers ``path`` with ({} when it gives none)."""
        try:
            response = await self._client.get(worker.url + path, timeout=self._timeout_s)
            found = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    async def _model_card(self, worker: Worker) -> dict | None:
        """The fields of the worker's model card that clients size prompts by (None when it gives none)."""
        cards = (await self._object(worker, "/v1/models")).get("data")
        if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict):
            return None
        card = {k: cards[0][k] for k in ("root", "max_model_len") if cards[0].get(k) is not None}
        return card or None

    async def _read_server_info(self, worker: Worker) -> None:
        """What the worker's SGLang says of itself (/server_info), onto ``worker``; what it does not say is kept."""
        info = await self._object(worker, "/server_info")
        device, kv_tokens, backend = info.get("device"), info.get("max_total_num_tokens"), info.get("attention_backend")
        if isinstance(device, str) and device:
            worker.device = device
        if isinstance(kv_tokens, int) and not isinstance(kv_tokens, bool) and kv_tokens > 0:
            worker.kv_tokens = kv_tokens
        if isinstance(backend, str) and backend:
            worker.attention_backend = backend

    async def _forward_clock(self, worker: Worker) -> tuple[bool, float | None]:
        """Whether the worker's HTTP process answers /metrics, and when the forward it is running started (None
        when none is running, or the metrics cannot be read: then nothing tells the worker is busy)."""
        try:
            response = await self._client.get(worker.url + "/metrics", timeout=self._timeout_s)
        except httpx.HTTPError:
            return False, None
        if response.status_code != 200:
            return True, None
        clock: dict[str, float] = {}
        for line in response.text.splitlines():
            name, _, value = line.partition(" ")
            if name in (FORWARD_STARTED, FORWARD_ENDED):
                with contextlib.suppress(ValueError):
                    clock[name] = float(value)
        started, ended = clock.get(FORWARD_STARTED), clock.get(FORWARD_ENDED, 0.0)
        return True, started if started is not None and started > ended else None

    def context_length(self) -> int | None:
        """The workers' context length in tokens (the least any reported, as they serve one model); None until one
        has reported its model card."""
        lengths = [w.model_card["max_model_len"] for w in self.workers
                   if w.model_card and isinstance(w.model_card.get("max_model_len"), int)]
        return min(lengths, default=None)

    def choose(self, exclude: Iterable[Worker] = (), prefer: str | None = None) -> Worker:
        """The least-loaded healthy worker; the preferred one (cache affinity) unless it is busier than that by
        more than AFFINITY_SLACK requests."""
        excluded = {id(w) for w in exclude}
        candidates = [w for w in self.workers if w.healthy and id(w) not in excluded]
        if not candidates:
            return self._last_resort(excluded)
        best = min(candidates, key=lambda w: (w.busy_since is not None, w.inflight, w._last_used))
        if prefer is not None:
            for worker in candidates:
                if worker.url == prefer and worker.inflight <= best.inflight + AFFINITY_SLACK:
                    return worker
        return best

    def _last_resort(self, excluded: set[int]) -> Worker:
        """With no healthy worker: a silent one (slow or stopped, see the module's doc), fewest checks missed first."""
        silent = [w for w in self.workers if w.silent and id(w) not in excluded]
        if not silent:
            raise NoHealthyWorker("no healthy worker is available; try again shortly")
        worker = min(silent, key=lambda w: (w.missed_checks, w.inflight, w._last_used))
        self.last_resort_sent += 1
        if time.monotonic() - self._last_resort_logged > 5.0:  # once in a while, not once per request
            self._last_resort_logged = time.monotonic()
            log.warning("no healthy worker: sent to silent worker %s as a last resort (%d so far)", worker.url,
                        self.last_resort_sent)
        return worker

    def lease(self, worker: Worker) -> Lease:
        """Count a request against ``worker`` for as long as the ``async with`` block runs."""
        return Lease(worker, self._ticket)

    @staticmethod
    def until_taken_out(worker: Worker) -> AwaitedAnswer:
        """A block waiting for ``worker``'s answer, cancelled if a health check takes the worker out meanwhile
        (``taken_out`` then tells: the request may be sent elsewhere). Not for what runs after the worker has
        begun to answer. A request sent to a worker already out (the last resort, see the module's doc) was sent
        knowing, and waits."""
        return AwaitedAnswer(worker)

    def mark_failed(self, worker: Worker, error: str) -> None:
        worker.failures += 1
        worker.last_error = error
        if worker.healthy:
            log.warning("worker %s marked down: %s", worker.url, error)
        worker.healthy = False
