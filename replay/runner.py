"""Replaying a trace against a running gateway: each request sent as its tenant, at the trace's pace (or as fast
as ``concurrency`` allows), its outcome appended to a results file as it ends.

A run can be stopped and started again with the same results file: requests already there are not sent again
(``resume``). Each result says what the gateway served (``x-revisit-reuse`` per image), how long the first token
and the whole answer took, and the prompt and cached token counts. While it runs, the gateway's ``/admin/stats``
are sampled (with the admin token) for the report's tier traffic and to check the counts against the headers.

Tenants get API keys ``{key_prefix}{tenant}``: a fresh prefix gives a run caches of its own, so that two runs of
one trace (reuse on and off, say) do not serve each other's images. ``mode`` is sent as ``x-revisit-reuse-mode``:
``all`` (the gateway's default), ``exact`` (exact hits only) or ``off`` (plain SGLang).

``replay_interleaved`` replays a trace once per mode at the same time, request by request: each trace request is
sent under every mode back to back, the modes' order turning from one request to the next. Runs one after the other
are not comparable to a few percent on a shared machine (on a 2-core host, whichever mode ran first was 3-7% slower
in TTFT, whichever it was); interleaved, a slow stretch falls on every mode alike. Each mode keeps its own keys, so
its own caches: only the machine is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from replay.trace import ImageFiles, Trace, TraceRequest, image_parts

MODES = ("all", "exact", "off")
PLAIN = "plain"  # an image the gateway planned nothing for (reuse off, or no store): plain SGLang


@dataclass(frozen=True)
class ReplaySettings:
    url: str
    model: str | None = None  # default: the first model the gateway lists
    concurrency: int = 4
    paced: bool = True  # at the trace's recorded times (scaled by speed); else as fast as concurrency allows
    speed: float = 1.0
    mode: str = "all"
    key_prefix: str = "sk-replay-"
    admin_token: str | None = None
    sample_s: float = 2.0  # how often /admin/stats is sampled
    calibration_wait_s: float = 600.0  # how long to wait for the gateway's calibration of its workers
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        if self.concurrency < 1 or self.speed <= 0 or self.sample_s <= 0:
            raise ValueError("concurrency, speed and sample_s must be positive")


@dataclass
class Result:
    """One replayed request."""

    index: int
    tenant: str
    family: str
    sent_s: float  # since the run began
    status: int = 0  # HTTP status; 0: no answer (connection failed, timed out)
    ttft_s: float | None = None  # to the first content (the whole answer when not streamed)
    latency_s: float | None = None
    reuse: list[str] = field(default_factory=list)  # per image, what ran (x-revisit-reuse's kinds; PLAIN without)
    planned: list[str] = field(default_factory=list)  # per image, what was planned (a fallback's planned=)
    derived: int = 0  # images that ran as exact hits on a derived entry (an earlier approximate hit's K/V)
    prefix_cached: int = 0  # images planned for reuse whose rows SGLang's prefix cache held already
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    store_tokens: int = 0  # prompt tokens whose K/V the gateway's plan read from the store (x-revisit-store-tokens)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclass
class Sample:
    at_s: float
    stats: dict[str, Any]  # the gateway's /admin/stats
    bytes_read: int | None = None  # what the workers have read from the store (their store_bytes_read), summed


@dataclass
class Run:
    settings: ReplaySettings
    results: list[Result]
    samples: list[Sample]
    wall_s: float


def read_results(path: Path) -> list[Result]:
    if not path.exists():
        return []
    results = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                results.append(Result(**json.loads(line)))
            except (ValueError, TypeError):
                continue  # a line cut short when a run was killed: that request is sent again
    return results


async def replay(trace: Trace, settings: ReplaySettings, results_path: Path, *,
                 progress: Callable[[int, int], None] | None = None) -> Run:
    """Replay every request of the trace not yet in results_path; returns all results (earlier ones included)."""
    return (await replay_interleaved(trace, [(settings, results_path)], progress=progress))[0]


async def replay_interleaved(trace: Trace, lanes: Sequence[tuple[ReplaySettings, Path]], *,
                             progress: Callable[[int, int], None] | None = None) -> list[Run]:
    """Replay the trace once per lane (its settings and results file) at the same time, request by request (the
    module's docstring), each lane resuming from its own results file; returns one run per lane. The URL, model,
    concurrency (over every lane's requests together), pacing and admin token are the first lane's. The gateway's
    /admin/stats cover every lane at once: they go with one run only, the first that plans (mode other than off)."""
    settings = lanes[0][0]
    done = [{r.index: r for r in read_results(path)} for _, path in lanes]
    # Request by request, every lane's turn; the lanes' order turns with the request's index.
    def turns(index: int) -> list[int]:
        return [(index + j) % len(lanes) for j in range(len(lanes))]

    jobs = [(k, request) for request in trace.requests for k in turns(request.index) if request.index not in done[k]]
    files = ImageFiles(trace.base_dir)
    for _, path in lanes:
        path.parent.mkdir(parents=True, exist_ok=True)
    limits = httpx.Limits(max_connections=settings.concurrency + 2, max_keepalive_connections=settings.concurrency)
    samples: list[Sample] = []
    started = time.monotonic()
    first_t = jobs[0][1].t if jobs else 0.0
    total = len(trace.requests) * len(lanes)
    async with httpx.AsyncClient(base_url=settings.url, timeout=settings.timeout_s, limits=limits) as client:
        model = settings.model or await _first_model(client)
        if jobs:
            await _calibrated(client, settings)
        gate = asyncio.Semaphore(settings.concurrency)
        workers = await _worker_urls(client)
        sampler = asyncio.create_task(_sample(client, settings, samples, started, workers))
        with contextlib.ExitStack() as files_open:
            outs = [files_open.enter_context(_results_file(path)) for _, path in lanes]
            finished = sum(len(d) for d in done)

            async def one(k: int, request: TraceRequest) -> None:
                nonlocal finished
                if settings.paced:
                    delay = (request.t - first_t) / settings.speed - (time.monotonic() - started)
                    if delay > 0:
                        await asyncio.sleep(delay)
                async with gate:
                    result = await _send(client, files, request, model, lanes[k][0], started)
                done[k][request.index] = result
                outs[k].write(json.dumps(asdict(result)) + "\n")
                outs[k].flush()
                finished += 1
                if progress is not None:
                    progress(finished, total)

            try:
                await asyncio.gather(*(one(k, r) for k, r in jobs))
            finally:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
                if settings.admin_token:
                    if (last := await _stats(client, settings)) is not None:
                        samples.append(Sample(time.monotonic() - started, last, await _bytes_read(workers)))
    wall_s = time.monotonic() - started
    counted = next((k for k, (lane, _) in enumerate(lanes) if lane.mode != "off"), 0)  # whose plans the stats count
    return [Run(settings=lane, results=[done[k][i] for i in sorted(done[k])], samples=samples if k == counted else [],
                wall_s=wall_s) for k, (lane, _) in enumerate(lanes)]


@contextlib.contextmanager
def _results_file(path: Path) -> Iterator[TextIO]:
    """A results file opened to append, after a newline where a killed run cut its last line short."""
    with path.open("a") as out:
        if out.tell() and not path.read_bytes().endswith(b"\n"):
            out.write("\n")
        yield out


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _stats(client: httpx.AsyncClient, settings: ReplaySettings) -> dict[str, Any] | None:
    try:
        response = await client.get("/admin/stats", headers={"Authorization": f"Bearer {settings.admin_token}"})
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


async def _calibrated(client: httpx.AsyncClient, settings: ReplaySettings) -> None:
    """Wait (up to ``calibration_wait_s``) until the gateway has measured every healthy worker's costs, so that its
    calibration probes do not run beside, and slow, the first requests of whichever mode runs first. Needs the
    admin token; a gateway that does not calibrate (``worker_costs`` null) is not waited for."""
    if not settings.admin_token:
        return
    deadline = time.monotonic() + settings.calibration_wait_s
    while time.monotonic() < deadline:
        stats = await _stats(client, settings)
        if stats is None or stats.get("worker_costs") is None:  # no admin access, or no calibration to wait for
            return
        measured = stats["worker_costs"].get("workers", {})
        healthy = [w["url"] for w in await _listed_workers(client) if w.get("healthy")]
        if healthy and all((measured.get(url) or {}).get("calibration") for url in healthy):
            return
        await asyncio.sleep(0.5)


async def _sample(client: httpx.AsyncClient, settings: ReplaySettings, samples: list[Sample],
                  started: float, workers: list[str]) -> None:
    if not settings.admin_token:
        return
    while True:
        if (stats := await _stats(client, settings)) is not None:
            samples.append(Sample(time.monotonic() - started, stats, await _bytes_read(workers)))
        await asyncio.sleep(settings.sample_s)


async def _listed_workers(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    """The workers the gateway lists on /health, as it lists them (url, healthy, ...); [] when it cannot be read."""
    try:
        listed = (await client.get("/health")).json().get("workers", [])
    except (httpx.HTTPError, ValueError, AttributeError):
        return []
    return [w for w in listed if isinstance(w, dict) and "url" in w]


async def _worker_urls(client: httpx.AsyncClient) -> list[str]:
    """The workers the gateway lists on /health (their URLs as the gateway reaches them)."""
    return [w["url"] for w in await _listed_workers(client)]


async def _bytes_read(workers: list[str]) -> int | None:
    """The store bytes every worker has read (revisit_worker_events_total{event="store_bytes_read"}), summed; None
    when a worker cannot be reached from here (then the report has no bytes per hit)."""
    from prometheus_client.parser import text_string_to_metric_families

    if not workers:
        return None
    total = 0
    async with httpx.AsyncClient(timeout=10) as client:
        for url in workers:
            try:
                text = (await client.get(url.rstrip("/") + "/metrics")).text
            except httpx.HTTPError:
                return None
            total += int(sum(sample.value for family in text_string_to_metric_families(text)
                             if family.name == "revisit_worker_events" for sample in family.samples
                             if sample.name.endswith("_total") and sample.labels.get("event") == "store_bytes_read"))
    return total


async def _send(client: httpx.AsyncClient, files: ImageFiles, request: TraceRequest, model: str,
                settings: ReplaySettings, started: float) -> Result:
    result = Result(index=request.index, tenant=request.tenant, family=str(request.meta.get("family", "")),
                    sent_s=time.monotonic() - started)
    body = {**files.inline(request.body), "model": model}
    stream = bool(body.get("stream"))
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {settings.key_prefix}{request.tenant}", "x-revisit-reuse-mode": settings.mode}
    begun = time.monotonic()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            result.status = response.status_code
            _read_reuse(result, response.headers.get("x-revisit-reuse", ""))
            result.store_tokens = _count(response.headers.get("x-revisit-store-tokens", ""))
            if response.status_code == 200 and not result.reuse:
                result.reuse = result.planned = [PLAIN] * sum(1 for _ in image_parts(request.body))
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:300]
            elif stream:
                await _read_stream(response, result, begun)
            else:
                payload = json.loads(await response.aread())
                result.ttft_s = time.monotonic() - begun
                _read_usage(result, payload.get("usage"))
        result.latency_s = time.monotonic() - begun
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


async def _read_stream(response: httpx.Response, result: Result, begun: float) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            result.error = str(chunk["error"].get("message", chunk["error"]))[:300]
            return
        choices = chunk.get("choices") or []
        if result.ttft_s is None and any((c.get("delta") or {}).get("content") for c in choices):
            result.ttft_s = time.monotonic() - begun
        _read_usage(result, chunk.get("usage"))
    if result.ttft_s is None:  # an answer with no content (an immediate stop): its end is its first token
        result.ttft_s = time.monotonic() - begun


def _read_usage(result: Result, usage: Any) -> None:
    if isinstance(usage, dict):
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens", result.cached_tokens)


def _count(header: str) -> int:
    return int(header) if header.isdigit() else 0


def _read_reuse(result: Result, header: str) -> None:
    """x-revisit-reuse: per image ``kind[;similarity=..][;derived][;prefix_cached][;degraded=..]`` or
    ``miss;planned=kind;fallback=cause``."""
    for part in filter(None, header.split(",")):
        fields = part.split(";")
        result.derived += "derived" in fields
        result.prefix_cached += "prefix_cached" in fields
        planned = next((f.split("=", 1)[1] for f in fields[1:] if f.startswith("planned=")), fields[0])
        result.reuse.append(fields[0])
        result.planned.append(planned)
