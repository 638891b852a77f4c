"""Turns at the workers: while more than one API key has requests for the workers, each key may have at most
``per_key`` of them at the workers at once; its others wait at the gateway, in the order they came, for one of its
own to end.

A worker serves the requests it has queued first come, first served (SGLang's scheduler), so a key that sends a
hundred requests at once puts every other key's next request behind all of them, and into batches made mostly of
its own. Admission (gateway/admission.py) bounds what a key has in the gateway; this bounds what it has in the
workers' queues and batches, which is what the other keys wait for. One key alone is not held back (a batch job on
a gateway of its own runs as fast as the workers take it): the bound holds from the moment a second key has a
request for the workers, and a key already past it sends nothing more until it is back under it. Everything here
runs on the event loop: no locks.

The bound, unless set: ``CPU_PER_KEY`` while every worker that has said what it runs on is a CPU worker, else
``ACCELERATOR_PER_KEY``. On a GPU a batch of 16 costs a forward little more than one request does, so a key held
to fewer would lose throughput and give the others nothing; on a CPU every request in a batch adds its own compute,
so each of another key's requests at the worker slows everyone's forward (the soak's tenants' p50, under a flood of
small requests from a third key on one CPU worker: 1.60x its quiet figure with 16, 1.18x with 2;
bench/dos_under_load.py).

Paced on CPU workers: there, a backlogged key (one with at least its bound's worth of requests waiting: a flood,
not a key whose few clients go past its bound now and then) sends no more of its waiting requests than its bound
per ``PACE_S`` while a key that is not backlogged has requests at the workers or waiting. A CPU worker's every
forward costs the whole batch's compute, and a backlogged key's requests start prefill forwards of their own
between the others' forwards (even sent with another key's request: a text request reaches the scheduler before
an image request that its tokenizer is still processing). Without pacing, two turns let a flood of one-token
requests start a forward each time its last two ended, and the other keys' p50 rose 1.2-1.3x
(bench/dos_under_load.py). A request of seconds, the kind a CPU worker serves, is not slowed by the pace: its
key's turns are what it waits for. A key not backlogged is never paced, nor is one with the workers to itself.
A key that is not backlogged counts as there for ``RECENT_S`` after its last request left: between two requests its
client is making the next, and that gap is no time for a flood to take the worker.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Collection

CPU_PER_KEY = 2
ACCELERATOR_PER_KEY = 16
PACE_S = 2.0  # on CPU workers, a backlogged key sends at most its bound of waiting requests per this many seconds
RECENT_S = 10.0  # a key that had a request at the workers this recently still counts as there, for pacing


class WorkerTurns:
    """``per_key``: the most requests one key may have at the workers while another key has any there or waiting;
    None: by the workers' devices (:meth:`workers_run_on`)."""

    def __init__(self, per_key: int | None = None) -> None:
        if per_key is not None and per_key < 1:
            raise ValueError(f"per_key must be at least 1, got {per_key}")
        self._set = per_key
        self.per_key = per_key or ACCELERATOR_PER_KEY
        self.devices: tuple[str, ...] = ()  # what the workers said they run on
        self.paced = False  # whether backlogged keys are paced (CPU workers: see the module's docstring)
        self._at_workers: dict[str, int] = {}  # key id -> its requests at the workers now
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}  # key id -> its requests waiting, in order
        self._present: dict[str, int] = {}  # key id -> its requests at the workers or waiting (keys with none absent)
        self.waited = 0  # requests that had to wait, ever
        self.paced_out = 0  # waiting requests that went at their key's pace, ever
        # key id -> (when its pace's window began (loop time), how many of its waiting requests went in it)
        self._window: dict[str, tuple[float, int]] = {}
        # key id -> when it last had requests at the workers or waiting, not backlogged (loop time; pruned)
        self._seen: dict[str, float] = {}
        self._pace_timer: asyncio.TimerHandle | None = None  # what wakes the held keys when the first may go

    def workers_run_on(self, devices: Collection[str]) -> None:
        """The devices the workers have said they run on (SGLang's ``device``: "cpu", "cuda", ...): the bound
        follows them unless it was set, and pacing always does."""
        self.devices = tuple(sorted(set(devices)))
        self.paced = self.devices == ("cpu",)
        if self._set is None:
            self.per_key = CPU_PER_KEY if self.paced else ACCELERATOR_PER_KEY
        self._wake()

    def _contended(self, key_id: str) -> bool:
        """Whether a key other than ``key_id`` has requests at the workers or waiting for them."""
        return len(self._present) > (key_id in self._present)

    def _arrive(self, key_id: str) -> None:
        self._present[key_id] = self._present.get(key_id, 0) + 1

    def _leave(self, key_id: str) -> None:
        left = self._present[key_id] - 1
        if left:
            self._present[key_id] = left
        else:
            del self._present[key_id]
            self._window.pop(key_id, None)
            if self.paced and not self._backlogged(key_id):
                now = asyncio.get_running_loop().time()
                self._seen = {key: seen for key, seen in self._seen.items() if now - seen < RECENT_S}
                self._seen[key_id] = now

    def _may_go(self, key_id: str) -> bool:
        return self._at_workers.get(key_id, 0) < self.per_key or not self._contended(key_id)

    def _backlogged(self, key_id: str) -> bool:
        """Whether ``key_id`` has at least its bound's worth of requests waiting (a key with a few clients goes
        past its bound now and then; a flood is past it many times over)."""
        return len(self._waiting.get(key_id, ())) >= self.per_key

    def _paced_until(self, key_id: str, now: float) -> float | None:
        """When ``key_id`` may send its next waiting request (None: now): paced, it is backlogged, as many as its
        bound went in the last PACE_S, and a key that is not backlogged has requests at the workers or waiting."""
        if not self.paced or not self._backlogged(key_id):
            return None
        began, sent = self._window.get(key_id, (0.0, 0))
        if sent < self.per_key or now >= began + PACE_S:
            return None
        for other in [*self._present, *self._seen]:
            if other != key_id and not self._backlogged(other) and (other in self._present or
                                                                    now - self._seen[other] < RECENT_S):
                return began + PACE_S
        return None

    def _paced_out(self, key_id: str, now: float) -> None:
        began, sent = self._window.get(key_id, (0.0, 0))
        self._window[key_id] = (began, sent + 1) if now < began + PACE_S else (now, 1)
        self.paced_out += 1

    async def take(self, key_id: str) -> Callable[[], None]:
        """Wait for ``key_id``'s turn to send a request to the workers; returns what gives the turn back (once,
        whenever it is called: when the response has ended or the request was cancelled)."""
        self._arrive(key_id)
        if not self._waiting.get(key_id) and self._may_go(key_id):
            self._go(key_id)
        else:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(key_id, deque()).append(waiter)
            self.waited += 1
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # its turn came as it was cancelled: hand it on
                    self._end(key_id)
                else:
                    self._withdraw(key_id, waiter)
                raise
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self._end(key_id)

        return give_back

    def _go(self, key_id: str) -> None:
        self._at_workers[key_id] = self._at_workers.get(key_id, 0) + 1

    def _end(self, key_id: str) -> None:
        self._leave(key_id)
        left = self._at_workers[key_id] - 1
        if left:
            self._at_workers[key_id] = left
        else:
            del self._at_workers[key_id]
        self._wake()

    def _withdraw(self, key_id: str, waiter: asyncio.Future[None]) -> None:
        queue = self._waiting.get(key_id)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[key_id]
        self._leave(key_id)
        self._wake()  # a key that stops waiting may leave another alone, and so unbounded

    def _wake(self) -> None:
        """Start every waiting request that may go now, each key's in order, at its pace."""
        if not self._waiting:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for key_id in list(self._waiting):
            queue = self._waiting[key_id]
            while queue and self._may_go(key_id):
                if (until := self._paced_until(key_id, now)) is not None:
                    if self._pace_timer is None or self._pace_timer.when() > until:
                        if self._pace_timer is not None:
                            self._pace_timer.cancel()
                        self._pace_timer = loop.call_at(until, self._pace_timeout)
                    break
                waiter = queue.popleft()
                if waiter.cancelled():  # (its task's CancelledError handler finds it gone: it leaves there)
                    continue
                self._go(key_id)
                if self.paced:
                    self._paced_out(key_id, now)
                waiter.set_result(None)
            if not queue:
                del self._waiting[key_id]

    def _pace_timeout(self) -> None:
        self._pace_timer = None
        self._wake()

    def stats(self) -> dict[str, int | str]:
        by = "setting" if self._set is not None else "devices:" + ",".join(self.devices or ("unknown",))
        return {"per_key": self.per_key, "per_key_by": by, "at_workers": sum(self._at_workers.values()),
                "keys": len(self._at_workers), "waiting": sum(len(queue) for queue in self._waiting.values()),
                "waited": self.waited, "paced": self.paced, "paced_out": self.paced_out}
