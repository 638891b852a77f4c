"""A bounded thread pool that is fair between callers: the gateway's threads for decoding media.

Decoding and keying an image takes tens of milliseconds to seconds of CPU. On asyncio's default executor, one FIFO
queue shared with everything, a caller that sends a hundred expensive images delays every other caller's images by
all of them. :class:`FairPool` has a bounded number of threads and one FIFO queue per caller (an API key's id):
a free thread takes the next job of the caller with the fewest jobs running, callers with as many taking turns
(round robin), so one caller's single image waits for at most about one job per thread, however many the others
have queued. Jobs of one caller start in the order they were submitted.

Jobs may also have a cost (what they hold in memory while they run: an image's decoded pixels, a large body's
parse), and the pool a budget for the cost of the jobs running at once: a job starts only within it, so what
decoding holds in memory is bounded by the budget, not by the number of threads (on a 32-core host, 32 images of
40 Mpx at once would be ~6 GB). A job costlier than the whole budget runs when nothing else costly does. A caller
may have a budget of its own too (``caller_cost_budget``), kept the same way among its own jobs: one caller's
costly jobs then run a few at a time, or one at a time past it, however many threads are free, so what one caller
has decoded and parsed at once is bounded whatever the others do. Among the callers whose next job fits, the order
above holds. What a caller holds outside the pool may count against its budget too (:meth:`share_caller_budget`:
the gateway's admission counts a key's request bodies there, gateway/admission.py), and the pool tells whoever
shares it each time a caller's costly job has ended.

A job whose awaiting coroutine is cancelled (the client left) is taken off its queue if it has not started; one
that has started runs to its end (a thread cannot be interrupted), and its result is dropped. Threads start as jobs
need them and leave after IDLE_S without one, so a pool nobody closes holds no threads for long.

A pool's threads may run at a lower CPU priority than the rest of the process (``nice``, Linux's per-thread
niceness): the event loop, which every request's relaying, parsing of small bodies and cached answers wait on,
then takes a contended CPU first, and decoding gets what it leaves (on a host whose gateway has one CPU, a caller
sending 40 Mpx images otherwise takes that CPU from every other caller's requests while they decode).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
IDLE_S = 60.0  # a thread with no job for this long leaves (another starts when jobs come)


def default_workers() -> int:
    """One thread per CPU this process may run on, at least two (Pillow, numpy and hashlib release the GIL while
    they decode and hash). Each decodes one image at a time: at most this many images' pixels are in memory."""
    try:
        cpus = len(os.sched_getaffinity(0))  # a container's cpuset, where os.cpu_count() gives the host's
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(2, cpus)


def lower_priority(nice: int) -> None:
    """The calling thread's niceness raised by ``nice`` (Linux: PRIO_PROCESS of 0 is the calling thread alone);
    where it cannot be (another system, a limit), it stays as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
    except (AttributeError, OSError):
        pass


class PoolClosed(RuntimeError):
    """The pool was shut down before the job ran."""


@dataclass(eq=False, slots=True)
class _Job:
    caller: str
    call: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    cost: int = 0
    started: bool = field(default=False)


class FairPool:
    """At most ``workers`` threads (default: :func:`default_workers`), started as jobs need them; :meth:`aclose`
    (or :meth:`close`) on shutdown. :meth:`run` may be called from any event loop."""

    def __init__(self, workers: int | None = None, *, name: str = "revisit-media", idle_s: float = IDLE_S,
                 cost_budget: int | None = None, caller_cost_budget: int | None = None, nice: int = 0) -> None:
        self.workers = default_workers() if workers is None else workers
        if self.workers < 1:
            raise ValueError(f"a pool needs at least one thread, got {workers}")
        for budget in (cost_budget, caller_cost_budget):
            if budget is not None and budget < 1:
                raise ValueError(f"a cost budget must be positive, got {budget}")
        self.cost_budget = cost_budget  # None: jobs' costs are not limited
        self.caller_cost_budget = caller_cost_budget  # None: one caller's are limited by cost_budget alone
        self.nice = nice  # each thread's niceness above the process's (0: the same priority)
        self._cost_running = 0
        self._name = name
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # Callers with jobs waiting, in turn order (a caller served goes to the back), each with its FIFO.
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._running: dict[str, int] = {}  # caller -> jobs running now
        self._caller_cost: dict[str, int] = {}  # caller -> the cost of its jobs running now (those with one)
        self._queued = 0  # jobs waiting, all callers together
        self._threads: set[threading.Thread] = set()
        self._idle = 0  # threads waiting for a job
        self._started = 0  # threads ever started (names them)
        self._closed = False
        # What each caller holds outside the pool, counted against its budget (share_caller_budget); told on the
        # job's event loop each time a caller's costly job has ended.
        self._held_elsewhere: Callable[[str], int] = _nothing
        self._on_cost_ended: Callable[[str], None] | None = None

    def share_caller_budget(self, held_elsewhere: Callable[[str], int], on_cost_ended: Callable[[str], None]) -> None:
        """Count what ``held_elsewhere(caller)`` says the caller holds outside the pool against its budget: a job
        of the caller starts only where that, its running jobs' costs and the job's own fit ``caller_cost_budget``,
        or where none of its costly jobs runs (so that one always can). ``held_elsewhere`` is called on the pool's
        threads and must be cheap and safe there; call :meth:`room_made` when what it says has shrunk.
        ``on_cost_ended(caller)`` is called on the event loop of each of the caller's costly jobs once it has ended
        and its cost is no longer counted."""
        self._held_elsewhere, self._on_cost_ended = held_elsewhere, on_cost_ended

    def room_made(self) -> None:
        """What a caller holds outside the pool has shrunk: its held-back jobs may fit now."""
        with self._lock:
            if self._queued:
                self._wake.notify_all()

    def cost_running(self, caller: str) -> int:
        """The cost of ``caller``'s jobs running now."""
        return self._caller_cost.get(caller, 0)

    async def run(self, caller: str, work: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``work(*args, **kwargs)`` on one of the pool's threads, in ``caller``'s turn; its result or exception.
        Context variables reach the job as asyncio.to_thread passes them."""
        return await self.run_costing(caller, 0, work, *args, **kwargs)

    async def run_costing(self, caller: str, cost: int, work: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """:meth:`run` for a job of this ``cost``, started within the pool's cost budget."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        job = _Job(caller, functools.partial(context.run, work, *args, **kwargs), loop, loop.create_future(),
                   cost=max(0, cost))
        self._submit(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            self._withdraw(job)
            raise

    def queued(self, caller: str | None = None) -> int:
        """Jobs waiting to start: ``caller``'s, or everyone's."""
        with self._lock:
            return len(self._queues.get(caller, ())) if caller is not None else self._queued

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"threads": len(self._threads), "max_threads": self.workers, "callers_waiting": len(self._queues),
                    "queued": self._queued, "running": sum(self._running.values()), "cost_running": self._cost_running}

    def close(self, *, wait: bool = True) -> None:
        """Stop taking jobs; jobs not yet started fail with PoolClosed; with ``wait``, join the threads (jobs that
        started run to their end first)."""
        with self._lock:
            self._closed = True
            dropped = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._queued = 0
            self._wake.notify_all()
            threads = list(self._threads)
        for job in dropped:
            _settle(job, None, PoolClosed("the gateway is shutting down"))
        if wait:
            for thread in threads:
                thread.join()

    async def aclose(self) -> None:
        """:meth:`close`, joining the threads without holding up the event loop."""
        self.close(wait=False)
        await asyncio.to_thread(self.close, wait=True)

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise PoolClosed("the gateway is shutting down")
            queue = self._queues.get(job.caller)
            if queue is None:
                queue = self._queues[job.caller] = deque()
            queue.append(job)
            self._queued += 1
            if self._queued > self._idle and len(self._threads) < self.workers:
                thread = threading.Thread(target=self._serve, name=f"{self._name}-{self._started}", daemon=True)
                self._started += 1
                self._threads.add(thread)
                thread.start()
            self._wake.notify()

    def _withdraw(self, job: _Job) -> None:
        with self._lock:
            if job.started:
                return
            queue = self._queues.get(job.caller)
            if queue is not None:
                try:
                    queue.remove(job)
                except ValueError:
                    return
                self._queued -= 1
                if not queue:
                    del self._queues[job.caller]

    def _fits(self, job: _Job) -> bool:
        """Whether the job may start within the pool's budget and its caller's: within each, or past one when
        nothing costly runs under it."""
        if not job.cost:
            return True
        if (budget := self.cost_budget) is not None and self._cost_running \
                and self._cost_running + job.cost > budget:
            return False
        if (budget := self.caller_cost_budget) is not None and (own := self._caller_cost.get(job.caller, 0)) \
                and own + self._held_elsewhere(job.caller) + job.cost > budget:
            return False
        return True

    def _next(self) -> _Job | None:
        """The next job to run (under the lock): among the callers whose next job fits the cost budgets, the first
        in turn order of those with the fewest jobs running, which then goes to the back of the order. None once
        closed, or after idle_s without a job (the thread then leaves)."""
        while True:
            ready = [name for name, queue in self._queues.items() if self._fits(queue[0])]
            if ready:
                break
            if self._closed and not self._queues:
                return None
            self._idle += 1
            try:
                woken = self._wake.wait(self._idle_s)
            finally:
                self._idle -= 1
            if not woken and not self._queues:
                return None
        running = self._running
        caller = min(ready, key=lambda name: running.get(name, 0))  # the first of the least served
        queue = self._queues[caller]
        job = queue.popleft()
        self._queued -= 1
        if queue:
            self._queues.move_to_end(caller)
        else:
            del self._queues[caller]
        job.started = True
        running[caller] = running.get(caller, 0) + 1
        if job.cost:
            self._cost_running += job.cost
            self._caller_cost[caller] = self._caller_cost.get(caller, 0) + job.cost
        return job

    def _serve(self) -> None:
        if self.nice:
            lower_priority(self.nice)
        while True:
            with self._lock:
                job = self._next()
                if job is None:
                    self._threads.discard(threading.current_thread())
                    return
            result: Any = None
            error: BaseException | None = None
            if not job.future.cancelled():
                try:
                    result = job.call()
                except BaseException as exc:  # handed to the awaiting coroutine, as asyncio.to_thread does
                    error = exc
            # Its arguments let go before its outcome is handed over: the awaiting coroutine may run on before this
            # thread does, and should not find a whole request body still held here.
            job.call = _called
            with self._lock:
                left = self._running[job.caller] - 1
                if left:
                    self._running[job.caller] = left
                else:
                    del self._running[job.caller]
                if job.cost:
                    self._cost_running -= job.cost
                    if own := self._caller_cost[job.caller] - job.cost:
                        self._caller_cost[job.caller] = own
                    else:
                        del self._caller_cost[job.caller]
                    self._wake.notify_all()  # a job held back by a budget may fit now
            _settle(job, result, error, self._on_cost_ended if job.cost else None)
            # Not held while the thread waits for its next job: a job's arguments and result can be a request's
            # whole body and its parse (100 MB for 50 MB of text), which an idle thread kept alive until then.
            del job, result, error


def _called() -> None:
    raise RuntimeError("a pool job runs once")


def _nothing(caller: str) -> int:
    return 0


def _settle(job: _Job, result: Any, error: BaseException | None,
            cost_ended: Callable[[str], None] | None = None) -> None:
    """Hand a job's outcome to its event loop (which may have closed meanwhile: then nobody is waiting), and tell
    ``cost_ended`` there that the job's cost is no longer counted."""
    if isinstance(error, StopIteration):  # a future cannot carry one (it would end the awaiting generator)
        error = RuntimeError(f"job raised StopIteration: {error}")

    def settle() -> None:
        if not job.future.done():  # done: cancelled while it ran, and the result is dropped
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
        if cost_ended is not None:
            cost_ended(job.caller)

    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed
        pass
