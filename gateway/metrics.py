"""Prometheus figures for one gateway app: the cache policy's and the planner's, read at scrape time, and the
requests served (counts, durations, time to first token), recorded as they end.

Each app owns its :class:`~prometheus_client.CollectorRegistry` (never the global
default one), so several apps can live in one process.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.planner import KINDS, REFUSALS, Planner
from gateway.policy import CachePolicy

PREFIX = "revisit_cache"
CLIENT_LEFT = 499  # the status counted for a request whose client left before its answer (nginx's convention)


class PolicyCollector(Collector):
    """Turns :meth:`CachePolicy.stats` into metric families; the same figures as GET /admin/stats. /metrics is open
    by default and runs on the cache thread: a scrape reads the policy's running totals and counters, never its
    entries, so it costs the same at any number of them (tests/security/test_metrics_cost.py)."""

    def __init__(self, policy: CachePolicy):
        self._policy = policy

    def collect(self) -> Iterator[Metric]:
        stats = self._policy.stats()
        for field, help_text in (
            ("entries", "Entries per tier (dram includes the preset share)."),
            ("bytes", "Bytes per tier (dram includes the preset share)."),
            ("capacity_bytes", "Capacity per tier in bytes."),
            ("pinned_entries", "Pinned entries per tier."),
            ("pinned_bytes", "Bytes of pinned entries per tier."),
        ):
            family = GaugeMetricFamily(f"{PREFIX}_{field}", help_text, labels=["tier"])
            for tier, usage in stats.tiers.items():
                family.add_metric([tier], getattr(usage, field))
            yield family
        for field in ("entries", "bytes", "capacity_bytes"):
            yield GaugeMetricFamily(
                f"{PREFIX}_preset_{field}", f"Preset victim cache (reserved DRAM share): {field}.",
                value=getattr(stats.preset, field),
            )
        hits = CounterMetricFamily(f"{PREFIX}_hits", "Cache hits by type and the tier that served them.",
                                   labels=["type", "tier"])
        for hit_type, by_tier in stats.hits.items():
            for tier, count in by_tier.items():
                hits.add_metric([hit_type, tier], count)
        yield hits
        decisions = CounterMetricFamily(f"{PREFIX}_decisions", "Policy decisions by kind.", labels=["kind"])
        for kind, count in stats.decisions.items():
            decisions.add_metric([kind], count)
        yield decisions
        evictions = CounterMetricFamily(f"{PREFIX}_evictions", "Evictions by tier and reason.",
                                        labels=["tier", "reason"])
        for tier, by_reason in stats.evictions.items():
            for reason, count in by_reason.items():
                evictions.add_metric([tier, reason], count)
        yield evictions
        yield CounterMetricFamily(
            f"{PREFIX}_protections_used", "Times eviction spent an exact entry's protection budget.",
            value=stats.protections_used,
        )


class PlannerCollector(Collector):
    """What the planner decided per image, and the approximate-match index's size; the same figures as the
    ``plans`` and ``matching`` parts of GET /admin/stats."""

    def __init__(self, planner: Planner):
        self._planner = planner

    def collect(self) -> Iterator[Metric]:
        stats = planner_stats(self._planner)
        plans = CounterMetricFamily("revisit_plans", "Images planned, by kind (miss, exact_same_prefix, exact_moved, "
                                    "approximate), exact plans on derived entries (derived_hit), entries taken "
                                    "into the books (admitted), requests planned nothing for want of a store "
                                    "(store_unavailable).", labels=["kind"])
        for kind, count in sorted(stats["plans"].items()):
            plans.add_metric([kind], count)
        yield plans
        refused = CounterMetricFamily("revisit_plan_refusals", "Images planned as misses though something stored "
                                      "was near them, by why (planner.REFUSALS): not similar enough, too much "
                                      "changed, not paying with the noted tokens recomputed, predicted not to pay, "
                                      "the near-duplicates' entries gone.",
                                      labels=["reason"])
        for reason, count in stats["refused"].items():
            refused.add_metric([reason], count)
        yield refused
        matching = stats["matching"]
        yield GaugeMetricFamily("revisit_match_index_entries", "Images in the approximate-match index.",
                                value=matching["indexed"])


def planner_stats(planner: Planner) -> dict:
    """The planner's counts and the match index's size (call on the cache thread, where they change)."""
    plans = {kind: 0 for kind in (*KINDS, "derived_hit", "admitted", "store_unavailable")}
    plans.update(planner.counts)
    matcher = planner.matcher
    refused = {reason: planner.refused[reason] for reason in REFUSALS}
    return {"plans": plans, "refused": refused,
            "matching": {"enabled": matcher is not None,
                         "indexed": len(matcher.index) if matcher is not None else 0,
                         "damaged_records": matcher.damaged_records if matcher is not None else 0}}


# Seconds: a cached image on a GPU answers in tens of milliseconds, a miss on a CPU worker in minutes.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/admin", "/dashboard")
COMPLETING = ENDPOINTS[:2]  # the endpoints that run the model: their latency is labelled by reuse
STREAM_END = b"data: [DONE]\n\n"  # the last event of an OpenAI stream, as the gateway relays it
NO_IMAGE = "none"  # the reuse label of a request without images or videos
PLAIN = "plain"  # ... of one whose images were planned nothing (reuse off for it): plain SGLang
MIXED = "mixed"  # ... of one whose images were planned as different kinds, or that has images and videos
VIDEO = "video"  # ... of one with videos and no image (their patches counted by revisit_video_patches_total)
RESPONSE_CACHED = "response_cache"  # ... of one the response cache answered (gateway/response_cache): no model ran


def reuse_label(kinds: tuple[str, ...] | list[str], *, videos: int = 0) -> str:
    """One label for a request's images: their kind when they agree (planner.KINDS), else "mixed"; "video" for
    videos alone."""
    distinct = set(kinds)
    if videos:
        return MIXED if distinct else VIDEO
    return NO_IMAGE if not distinct else distinct.pop() if len(distinct) == 1 else MIXED


MINUTE_S = 60
HOUR_MINUTES = 60
TTFT_SAMPLES = 256  # streamed requests' TTFTs kept a minute and reuse label: the median is of the first this many


class _Minute:
    __slots__ = ("minute", "requests", "failed", "images", "ttft")

    def __init__(self, minute: int) -> None:
        self.minute = minute  # minutes since the epoch
        self.requests = 0
        self.failed = 0  # answered 5xx, or the client left (CLIENT_LEFT)
        self.images: Tally[str] = Tally()  # images by what they were planned as (planner.KINDS)
        self.ttft: dict[str, list[float]] = {}  # reuse label -> streamed requests' seconds to the first token


class LastHour:
    """The last hour a minute at a time, for the operator page's charts (GET /admin/history): requests that ran the
    model (and how many failed), the images they carried by what each was planned as (the hit rate), and streamed
    requests' time to first token by reuse label. Kept on the event loop, where requests end and the route reads;
    at most an hour of minutes, each a few counters and at most TTFT_SAMPLES floats a label."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._minutes: deque[_Minute] = deque(maxlen=HOUR_MINUTES)

    def record(self, code: int, kinds: Sequence[str], reuse: str, ttft_s: float | None) -> None:
        now = int(self._clock() // MINUTE_S)
        if not self._minutes or self._minutes[-1].minute != now:
            self._minutes.append(_Minute(now))
        minute = self._minutes[-1]
        minute.requests += 1
        minute.failed += code >= 500 or code == CLIENT_LEFT
        minute.images.update(kinds)
        if ttft_s is not None:
            samples = minute.ttft.setdefault(reuse, [])
            if len(samples) < TTFT_SAMPLES:
                samples.append(ttft_s)

    def snapshot(self) -> dict[str, Any]:
        """Every minute of the last hour, oldest first, the current one last (still filling); minutes without
        requests are zeros. ``hit_rate``: the share of the minute's images planned as exact or approximate reuse
        (null without images); ``ttft_ms``: the median a reuse label (absent without streamed requests)."""
        now = int(self._clock() // MINUTE_S)
        kept = {minute.minute: minute for minute in self._minutes}
        minutes = []
        for at in range(now - HOUR_MINUTES + 1, now + 1):
            minute = kept.get(at) or _Minute(at)
            images = sum(minute.images.values())
            minutes.append({
                "at": at * MINUTE_S, "requests": minute.requests, "failed": minute.failed,
                "images": {kind: minute.images[kind] for kind in KINDS},
                "hit_rate": round((images - minute.images["miss"]) / images, 4) if images else None,
                "ttft_ms": {label: round(1000 * statistics.median(samples), 1)
                            for label, samples in sorted(minute.ttft.items())}})
        return {"object": "history", "minute_s": MINUTE_S, "minutes": minutes}


class RequestMetrics:
    """Requests served, by endpoint and status code, and how long they took, by the reuse their images got
    (``reuse``: planner.KINDS, "none", "mixed" or "video"; set by the chat route in the request's state)."""

    def __init__(self, registry: CollectorRegistry, recent: int = 200) -> None:
        # The last requests that ran the model, newest last (GET /admin/recent, the operator page).
        self.recent: deque[dict[str, Any]] = deque(maxlen=recent)
        self.last_hour = LastHour()  # GET /admin/history, the operator page's charts
        self.requests = Counter("revisit_requests", "HTTP requests served, by endpoint and status code (499: the "
                                "client left before the response ended).", ["endpoint", "code"], registry=registry)
        self.duration = Histogram("revisit_request_duration_seconds", "From the request's arrival to the end of its "
                                  "response (a stream's last chunk), chat completions by reuse kind.",
                                  ["endpoint", "reuse"], buckets=LATENCY_BUCKETS, registry=registry)
        self.fallbacks = Counter("revisit_reuse_fallbacks", "Images a worker did not run as planned, by what was "
                                 "planned and why (plan.outcome.CAUSES): computed as after a miss, or partly "
                                 "(degraded).", ["planned", "cause", "ran"], registry=registry)
        self.unreported = Counter("revisit_reuse_unreported", "Planned requests whose worker reported nothing of "
                                  "what it ran (x-revisit-reuse then says what was planned).", registry=registry)
        self.video_frames = Counter("revisit_video_frames", "Frames the model samples from requested videos, by "
                                    "where they were seen before: as a stored image, in an earlier video of the "
                                    "namespace, or new. Videos run as plain SGLang; this is what reuse of their "
                                    "frames would serve.", ["seen"], registry=registry)
        self.video_patches = Counter("revisit_video_patches", "Temporal patches (two sampled frames, one grid of "
                                     "tokens) of requested videos, by what an earlier video of the namespace had: "
                                     "the same patch (exact), a near-duplicate within the match guard "
                                     "(approximate), or nothing (miss). Videos run as plain SGLang; this is what "
                                     "reuse of their patches would serve.", ["seen"], registry=registry)
        self.first_token = Histogram("revisit_time_to_first_token_seconds", "Streamed chat completions: from the "
                                     "request's arrival to its first streamed chunk, by reuse kind.", ["reuse"],
                                     buckets=LATENCY_BUCKETS, registry=registry)

    @staticmethod
    def endpoint(path: str) -> str:
        return next((e for e in ENDPOINTS if path == e or path.startswith(e + "/")), "other")


# Seconds: an exact lookup takes microseconds, a paraphrase one an embedding (milliseconds on a CPU).
LOOKUP_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)


class ResponseCacheMetrics:
    """The response cache's figures (gateway/response_cache), counted as they happen: the cache itself lives on
    the event loop, and /metrics is read on the cache thread."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lookups = Counter("revisit_response_cache_lookups", "Response cache lookups by level (exact, paraphrase, "
                               "similar) and result: hit, miss, or veto (a candidate the guard refused).",
                               ["level", "result"], registry=registry)
        self.vetoes = Counter("revisit_response_cache_vetoes", "Candidates the guard refused, by level and what "
                              "differed (negation, number, entity, contrast).", ["level", "reason"],
                              registry=registry)
        self.skipped = Counter("revisit_response_cache_skipped", "Requests the response cache could not serve or "
                               "keep, by why (sampling, choices, no_question, session, logprobs).", ["reason"],
                               registry=registry)
        self.false_hits = Counter("revisit_response_cache_false_hits", "Hits reported wrong "
                                  "(POST /admin/response-cache/false-hits), by the level that served them.",
                                  ["level"], registry=registry)
        self.events = Counter("revisit_response_cache_events", "Answers stored, replaced, evicted, expired, flushed "
                              "or too large to keep.", ["event"], registry=registry)
        self.lookup_seconds = Histogram("revisit_response_cache_lookup_seconds", "What looking up one level cost.",
                                        ["level"], buckets=LOOKUP_BUCKETS, registry=registry)
        self.entries = Gauge("revisit_response_cache_entries", "Answers held.", registry=registry)
        self.bytes = Gauge("revisit_response_cache_bytes", "Bytes the answers held take.", registry=registry)


class RequestTimer:
    """ASGI middleware that records each HTTP request in the app's RequestMetrics once its response ends."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: list[int] = []
        first: list[float] = []
        ended = False

        async def timed_send(message: dict) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if not first and body:
                    first.append(time.perf_counter())
                # A stream's last event sent is its end, as the dispatcher counts it: a client that leaves as soon
                # as it has read it (OpenAI's client does) was served all the same, whether or not the empty frame
                # after it still reaches it.
                ended = not message.get("more_body", False) or body.endswith(STREAM_END)
            await send(message)

        failed: BaseException | None = None
        try:
            await self.app(scope, receive, timed_send)
        except BaseException as exc:
            failed = exc
            raise
        finally:
            if status and ended:
                code = str(status[0])
            elif status or failed is None or isinstance(failed, asyncio.CancelledError):
                code = str(CLIENT_LEFT)  # the client left (or the response was cut) before it ended
            else:
                code = "500"
            self._record(scope, started, code, first[0] if first else None)

    @staticmethod
    def _record(scope: dict, started: float, code: str, first: float | None) -> None:
        app = scope.get("app")
        services = getattr(getattr(app, "state", None), "services", None)
        metrics: RequestMetrics | None = getattr(services, "requests", None)
        if metrics is None:
            return
        endpoint = RequestMetrics.endpoint(scope.get("path", ""))
        metrics.requests.labels(endpoint, code).inc()
        state = scope.get("state") or {}
        reuse = state.get("reuse", NO_IMAGE) if endpoint in COMPLETING else ""
        duration = time.perf_counter() - started
        metrics.duration.labels(endpoint, reuse).observe(duration)
        streamed_first = first - started if state.get("stream") and first is not None and code == "200" else None
        if streamed_first is not None:
            metrics.first_token.labels(reuse).observe(streamed_first)
        if endpoint in COMPLETING:
            metrics.last_hour.record(int(code), state.get("image_kinds", ()), reuse, streamed_first)
            metrics.recent.append({"at": time.time(), "endpoint": endpoint, "code": int(code), "reuse": reuse,
                                   "stream": bool(state.get("stream")), "duration_s": round(duration, 4),
                                   "ttft_s": round(streamed_first, 4) if streamed_first is not None else None})


def build_registry(policy: CachePolicy, planner: Planner | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(PolicyCollector(policy))
    if planner is not None:
        registry.register(PlannerCollector(planner))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)
