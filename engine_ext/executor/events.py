"""What the executor did, counted, so that tests and operators see execution rather than intent.

Every image a plan names ends in events (one name per outcome, below). They are kept in-process
(``ExecutionEvents.counts``) and, where SGLang runs with ``--enable-metrics`` (the launcher always asks for it), as
the Prometheus counter ``revisit_worker_events_total{event=...}`` on the worker's own ``/metrics``: the model runs
in SGLang's scheduler process, whose counters SGLang's multiprocess registry serves from the HTTP process. Each
fallback is also counted by plan and cause (plan.outcome.CAUSES) as ``revisit_worker_fallbacks_total{plan,cause}``,
and logged; what ran is reported back to the gateway per request (plan.outcome).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from plan import RequestPlan
from plan.outcome import (
    CAUSES,
    FORWARD_ENDED,
    FORWARD_STARTED,
    FULL_PREFILL,
    PLANNED,
    PREFIX_CACHED,
    UNPLANNED,
    Outcome,
    Outcomes,
)

if TYPE_CHECKING:
    from engine_ext.executor.rows import ImageRows
    from plan import ImagePlan

log = logging.getLogger(__name__)
_RANK = {PLANNED: 0, PREFIX_CACHED: 1, FULL_PREFILL: 2, UNPLANNED: 3}

METRIC = "revisit_worker_events"
FALLBACK_METRIC = "revisit_worker_fallbacks"


class ForwardClock:
    """When the model's last forward started and ended (Unix seconds), on the worker's /metrics as it happens
    (multiprocess gauges are written through to shared files): a started time after the ended one means a forward
    is running. The gateway reads it when SGLang's /health does not answer, to tell a worker busy with a long
    prefill from a hung one (gateway/workers.py)."""

    def __init__(self) -> None:
        self._started = self._ended = None
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import Gauge

            self._started = Gauge(FORWARD_STARTED, "When the model's last forward started.", registry=None,
                                  multiprocess_mode="mostrecent")
            self._ended = Gauge(FORWARD_ENDED, "When the model's last forward ended.", registry=None,
                                multiprocess_mode="mostrecent")

    def start(self) -> None:
        if self._started is not None:
            self._started.set(time.time())

    def end(self) -> None:
        if self._ended is not None:
            self._ended.set(time.time())


class FullPrefill(Exception):
    """An image cannot run as planned and is computed as after a miss, for ``cause`` (plan.outcome.CAUSES)."""

    def __init__(self, cause: str, detail: str = "") -> None:
        if cause not in CAUSES:
            raise ValueError(f"unknown cause {cause!r}")
        super().__init__(f"{cause}: {detail or CAUSES[cause]}")
        self.cause = cause

EVENTS = {
    "miss": "an image planned as a miss ran the vision tower and the full prefill",
    "exact_executed": "an exact plan ran: stored encoder output and K/V reused, the planned rows recomputed",
    "exact_rows_reused": "image rows (summed over images) whose K/V came from the store at some layer",
    "exact_fallback": "an exact plan found no usable entry (absent, damaged, foreign): full prefill instead",
    "kv_read_failed": "image rows whose stored K/V could not be read mid-forward, computed from that layer on",
    "exact_served_by_prefix_cache": "an exact plan's image rows were all in SGLang's radix cache already",
    "approximate_served_by_prefix_cache": "an approximate plan's image rows were all in SGLang's radix cache "
                                          "already (computed there as a full prefill computes them)",
    "kept_out_of_prefix_cache": "images whose K/V differ from a full prefill's (moved, recomputed, derived or "
                                "approximate): their request's insert into SGLang's radix cache is withheld",
    "approximate_executed": "an approximate plan ran: warmup, then R computed, B from the alias, D hidden",
    "approximate_rows_reused": "image rows (summed over images) whose late-layer K/V came from an alias (B)",
    "approximate_rows_recomputed": "image rows of approximate plans computed at every layer (R)",
    "approximate_rows_dropped": "image rows of approximate plans hidden from the warmup depth on (D)",
    "approximate_fallback": "an approximate plan ran as a full prefill (alias absent or damaged, a cacheblend "
                            "image split over extends); the image is stored as after a miss",
    "decode_steps_hiding": "decode steps (per request) run by the executor to keep dropped tokens hidden",
    "decode_kept_off_graph": "decode batches kept off CUDA graph replay, so that the executor hides dropped tokens",
    "plan_refused": "a request id carried a damaged plan or one of an unknown version; ran unplanned",
    "plan_mismatch": "a plan did not fit its request's images; ran unplanned",
    "store_bytes_read": "bytes read from the store for exact and approximate plans: headers, encoder outputs, K/V",
    "encoder_from_store": "a stored encoder output was put in SGLang's encoder cache (the vision tower skipped)",
    "vision_images": "images the vision tower encoded in full",
    "vision_partial_images": "images of approximate plans encoded by a partial vision pass (the rest from the alias)",
    "vision_partial_tokens": "tokens (summed over images) the partial vision passes encoded",
    "vision_partial_failed": "partial vision passes that could not run (the full pass ran instead)",
    "stored": "entries written to the store after a miss",
    "derived_stored": "derived entries written: the K/V an approximate plan computed, marked with its alias",
    "derive_skipped": "approximate images not stored as derived entries because some of their tokens were dropped",
    "store_failed": "entries that could not be written",
    "capture_skipped": "misses whose encoder output SGLang no longer held, so nothing was stored",
    "outcome_failed": "requests whose outcome (what ran) could not be left for the gateway",
}


class ExecutionEvents:
    """Counts of EVENTS; see the module docstring. Thread-safe enough for the executor's two threads (the
    forward and the store writer): each increment is one dictionary update under the GIL. ``metrics``: whether
    they go to the worker's /metrics (under tensor parallelism, the first rank's only: the multiprocess registry
    sums the ranks')."""

    def __init__(self, *, metrics: bool = True) -> None:
        self.counts: Counter[str] = Counter()
        self._metric = self._fallbacks = None
        if metrics and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # set by SGLang before it starts the scheduler
            from prometheus_client import Counter as PrometheusCounter

            self._metric = PrometheusCounter(METRIC, "What the engine extension executed, by event.", ["event"],
                                             registry=None)
            self._fallbacks = PrometheusCounter(FALLBACK_METRIC, "Images that did not run as planned, by plan "
                                                "(exact, approximate) and cause.", ["plan", "cause"], registry=None)

    def add(self, event: str, count: int = 1) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown execution event {event!r}")
        self.counts[event] += count
        if self._metric is not None:
            self._metric.labels(event).inc(count)

    def fallback(self, plan: str, cause: str) -> None:
        """One image of a ``plan`` (exact, approximate) that did not run as planned, for ``cause``."""
        if cause not in CAUSES:
            raise ValueError(f"unknown cause {cause!r}")
        self.counts[f"fallback:{plan}:{cause}"] += 1
        if self._fallbacks is not None:
            self._fallbacks.labels(plan, cause).inc()


class Marks:
    """A bounded set that forgets its oldest members first."""

    def __init__(self, bound: int) -> None:
        self._bound = bound
        self._members: dict[Hashable, None] = {}  # insertion-ordered

    def __contains__(self, mark: Hashable) -> bool:
        return mark in self._members

    def add(self, mark: Hashable) -> bool:
        """Whether ``mark`` is new."""
        if mark in self._members:
            return False
        self._members[mark] = None
        while len(self._members) > self._bound:
            self._members.pop(next(iter(self._members)))
        return True


class OutcomeLog:
    """What ran for each planned image of the requests in a forward, merged over a request's chunks (the worst
    outcome wins: a full prefill over a degraded plan over a plan as written), and left for the gateway in the
    OutcomeBox at the end of each forward (plan.outcome). ``reports``: whether this process leaves them (under
    tensor parallelism, the first rank only)."""

    def __init__(self, box: Callable[[], Outcomes], events: ExecutionEvents, *, reports: bool = True) -> None:
        self._box_factory = box
        self._box: Outcomes | None = None
        self._events = events
        self._reports = reports
        self._by_rid: OrderedDict[str, dict[int, Outcome]] = OrderedDict()  # bounded
        self._touched: set[str] = set()
        self._muted: set[str] = set()  # this forward's requests whose gateway reads nothing back
        self._fell_back = Marks(4096)  # (request id, image) of the plans that ran as a full prefill

    def fell_back(self, rows: ImageRows, plan: ImagePlan, fallback: FullPrefill) -> None:
        """An image of an exact or approximate plan computed as after a miss: counted by cause (once, in the first
        extend that falls back: each later chunk of the image falls back again), logged, and reported."""
        if self._fell_back.add((rows.rid, rows.index)):
            self._events.add(f"{plan.kind}_fallback")
            self._events.fallback(plan.kind, fallback.cause)
            log.warning("revisit: the %s plan for %s (%s) runs as a full prefill: %s", plan.kind,
                        plan.key[:16], rows.rid[:40], fallback)
        self.record(rows.rid, rows.index, Outcome(FULL_PREFILL, fallback.cause))

    def mute(self, rid: str) -> None:
        """Nothing is left for this request (its plan is not RequestPlan.reported) in this forward."""
        self._muted.add(rid)

    def record(self, rid: str, index: int, outcome: Outcome) -> None:
        outcomes = self._by_rid.setdefault(rid, {})
        held = outcomes.get(index)
        if held is None or _rank(outcome) >= _rank(held):
            outcomes[index] = outcome
        self._touched.add(rid)
        while len(self._by_rid) > 4096:
            self._by_rid.popitem(last=False)

    def flush(self) -> None:
        """Write the outcomes of the requests this forward touched."""
        for rid in (self._touched - self._muted) if self._reports else ():
            request_id = RequestPlan.request_id(rid)
            outcomes = self._by_rid.get(rid)
            if request_id is None or not outcomes:
                continue
            try:
                if self._box is None:
                    self._box = self._box_factory()
                self._box.put(request_id, outcomes)
            except Exception:  # the gateway then reports the plan as planned; nothing else depends on it
                log.exception("revisit: could not leave the outcome of %s for the gateway", request_id)
                self._events.add("outcome_failed")
        self._touched.clear()
        self._muted.clear()


def _rank(outcome: Outcome) -> int:
    return _RANK[outcome.ran] + (outcome.ran == PLANNED and outcome.cause is not None)
