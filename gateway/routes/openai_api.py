"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions and /v1/models."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from gateway.admission import scope_header
from gateway.config import RESPONSE_CACHE_LEVELS, RESPONSE_CACHE_OFF, MatchSettings
from gateway.costs import ModelFacts, Work, image_in, prompt_through, request_work
from gateway.dispatch import COMPLETIONS_PATH, Route, UpstreamRequest
from gateway.errors import InvalidRequest, ModelNotFound, PayloadTooLarge
from gateway.intake import IntakeResult
from gateway.metrics import PLAIN, RESPONSE_CACHED, reuse_label
from gateway.offload import lane, off_loop, on_thread
from gateway.openai_shape import CHAT, TEXT, Shape
from gateway.planner import REUSE_MODES, Planned, outcome_of
from gateway.prompt_size import prompt_tokens_at_least
from gateway.protocol import parse_completion_body
from gateway.response_cache import NOT_LOOKED_UP, Answer, Asked, Found, asked, recorded, replay_stream
from gateway.services import Services
from gateway.tenancy import Caller
from gateway.workers import Worker
from plan import MISS, SELECTORS, ImagePlan, RequestPlan
from plan.outcome import PREFIX_CACHED, Outcome

router = APIRouter()
log = logging.getLogger(__name__)
T = TypeVar("T")

IMAGE_KEYS_HEADER = "x-revisit-image-keys"
REUSE_HEADER = "x-revisit-reuse"  # per image, what the worker ran (Planned.reuse_header)
STORE_TOKENS_HEADER = "x-revisit-store-tokens"  # prompt tokens whose K/V came from the store (Planned.store_tokens)
VIDEO_FRAMES_HEADER = "x-revisit-video-frames"  # per video, its sampled frames and how many were seen before
VIDEO_PATCHES_HEADER = "x-revisit-video-patches"  # per video, its temporal patches and how many were seen, or nearly
SELECTOR_HEADER = "x-revisit-selector"  # a request's choice of selector, where settings allow it
REUSE_MODE_HEADER = "x-revisit-reuse-mode"  # what a request lets the planner reuse (planner.REUSE_MODES)
# Request: the highest response-cache level it accepts (config.RESPONSE_CACHE_LEVELS, or off). Response: what the
# response cache did (response_cache.Found.header).
RESPONSE_CACHE_HEADER = "x-revisit-response-cache"
# SGLang request fields the gateway owns: a client's value would name another request or another tenant's cache.
_GATEWAY_FIELDS = frozenset({"rid", "extra_key"})


class OrjsonResponse(JSONResponse):
    """A JSON answer written by orjson (Starlette's is the standard library's json, eighteen times its time for a
    completion; FastAPI's ORJSONResponse is deprecated)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class EventStream(StreamingResponse):
    """Server-sent events, sent by the request's own task. Starlette's StreamingResponse runs a second task beside
    it to notice the client leaving (uvicorn speaks ASGI 2.3): a task group and a task for every stream. Every
    ``/v1/`` request has that watch already (gateway/admission.py), which cancels this one's task."""

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            raise ClientDisconnect() from None


def _new_id() -> str:
    """A request's id: 128 random bits in hex (uuid4's text without its object, a quarter of its time)."""
    return os.urandom(16).hex()


def _services(request: Request) -> Services:
    return request.app.state.services


def _caller(request: Request) -> Caller:
    """Who calls: identified from their API key, before anything was read, by gateway/admission.py."""
    return request.state.caller


async def _read_body(request: Request, limit: int) -> bytearray:
    """The whole body, in one buffer grown in place as it arrives (a large one is resized where it lies, not copied:
    chunks joined at the end held the body twice)."""
    declared = scope_header(request.scope, b"content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    body = bytearray()
    while True:  # the server's messages read as Starlette's Request.stream() does, without an async generator
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        if len(body) + len(chunk) > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        body += chunk
        if not message.get("more_body", False):
            return body


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    services = _services(request)
    config = services.config
    caller = _caller(request)
    namespace = caller.namespace
    selector = _requested_selector(request, config.reuse.match)
    mode = _requested_mode(request)
    wanted = _requested_response_level(request)
    level = config.responses.level_for(namespace, wanted)
    # The body handed over, not kept here: intake lets it go once parsed.
    intake = await services.intake.process(await _read_body(request, config.max_request_bytes), namespace=namespace,
                                           caller=caller.key_id)
    headers = {IMAGE_KEYS_HEADER: ",".join(image.key for image in intake.images)} if intake.images else {}
    question, found = None, NOT_LOOKED_UP
    if services.responses is not None and level != RESPONSE_CACHE_OFF:
        question = asked(intake, any_sampling=config.responses.any_sampling)
        found = await services.responses.lookup(question, level, intake.images)
        headers[RESPONSE_CACHE_HEADER] = found.header()
        if found.entry is not None:
            return _cached_answer(request, services, found, intake, headers)
    elif wanted not in (None, RESPONSE_CACHE_OFF):
        headers[RESPONSE_CACHE_HEADER] = "skipped;reason=not_enabled"
    planned = await services.planner.plan(intake, selector=selector, mode=mode)
    for header, counter, seen in ((VIDEO_FRAMES_HEADER, services.requests.video_frames,
                                   await services.planner.frames_seen(intake)),
                                  (VIDEO_PATCHES_HEADER, services.requests.video_patches,
                                   await services.planner.patches_seen(intake, planned))):
        if seen:
            headers[header] = ",".join(video.header() for video in seen)
            for video in seen:
                for label, count in video.counts().items():
                    counter.labels(label).inc(count)
    # the latency histograms' label (gateway/metrics.py)
    request.state.reuse = reuse_label(planned.kinds, videos=len(intake.videos))
    request.state.image_kinds = planned.kinds  # the operator page's hit rate (metrics.LastHour)
    request.state.stream = intake.params.stream
    request_id = _new_id()
    public_id = f"chatcmpl-{request_id}"
    plan = scoped_plan(planned.plan, intake, caller.scope)
    body = upstream_body(intake.upstream_body, scope=caller.scope,
                         rid=plan.to_rid(request_id, key=services.plan_key) if plan else public_id)
    # Encoded off the loop when large: a decoded image's data URL makes a small body (a fetched image's) megabytes.
    upstream = await UpstreamRequest.encode(body, size_hint=intake.body_bytes + intake.rewritten_bytes)

    costs = services.costs
    # Each image as the worker's own caches keep it: the prompt through it (prefix cache), the image (encoder cache).
    prompts = [prompt_through(caller.scope, digest, image.key)
               for digest, image in zip(intake.prefix_digests, intake.images, strict=True)]
    images = [image_in(caller.scope, image.key) for image in intake.images]

    def on_served(worker: Worker) -> None:
        services.planner.served(intake, worker.url)
        if costs is not None:
            costs.sent(worker.url, prompts, images, [image.grid.tokens for image in intake.images])

    # The worker's time to its first token, when it served this request alone: a sample of its costs (a stream's
    # first event, or a whole answer of one token), with what its caches were taken to hold of its images then.
    first: list[tuple[Worker, float, Held]] = []

    def on_first(worker: Worker, seconds: float) -> None:
        assert costs is not None
        first.append((worker, seconds, Held(*costs.held(worker.url, prompts, images))))

    sampled = costs is not None and not intake.videos and \
        (intake.params.stream or (intake.params.max_tokens or intake.params.max_completion_tokens) == 1)
    route = Route(prefer=planned.prefer, public_id=public_id, on_served=on_served,
                  shape=Shape(CHAT, extras=config.response_extras), on_first=on_first if sampled else None)

    async def after_prefill() -> None:
        ran = None
        if planned.kinds or planned.patch_kinds:  # what the worker reported is taken either way
            reuse, ran = await _what_ran(services, planned, request_id)
            if planned.kinds:
                headers[REUSE_HEADER] = reuse
                headers[STORE_TOKENS_HEADER] = str(planned.store_tokens(ran))
        if first and costs is not None:  # a sample of the worker's costs
            worker, seconds, held = first[0]
            work, kind = _work_that_ran(costs.facts, intake, plan, planned.kinds, ran, held,
                                        padded=worker.pads_extends)
            costs.observe(worker.url, work, seconds, kind=kind)

    return await _answer(request, services, upstream, route, stream=intake.params.stream, headers=headers,
                         after_prefill=after_prefill, keep=_keeper(services, question, found))


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """The indexes of a request's images the worker's prefix cache (``prompts``) and encoder cache (``images``)
    were taken to hold (gateway.costs.SglangCaches)."""

    prompts: frozenset[int] = frozenset()
    images: frozenset[int] = frozenset()


def _work_that_ran(model: ModelFacts, intake: IntakeResult, plan: RequestPlan | None, kinds: Sequence[str],
                   ran: Mapping[int, Outcome] | None, held: Held = Held(), *, padded: bool = False) -> tuple[Work, str]:
    """The request's work as the worker ran it, and its reuse label: an image it computed as after a miss counts as
    plain, and as a miss; images of a request planned nothing (reuse off for it) as "plain". An image SGLang's
    prefix cache served (so the worker reported, or, where it reported nothing, as ``held`` takes it) costs only the
    context it adds, and counts as "prefix_cached"; one computed as plain SGLang computes it whose vision output
    SGLang's encoder cache held (``held``) costs its prefill and no vision pass. ``padded``: the worker's attention
    backend attends over the whole prompt after a cached prefix (costs.request_work)."""
    images, cached, embedded, ran_as = [], [], [], []
    for index, image in enumerate(intake.images):
        image_plan = plan.images[index] if plan is not None and index < len(plan.images) else None
        outcome = outcome_of(ran, index)
        if outcome.ran == PREFIX_CACHED if outcome is not None else index in held.prompts:
            cached.append(image.grid.tokens)
            ran_as.append(PREFIX_CACHED)
            continue
        fell_back = outcome is not None and outcome.fell_back
        computed = fell_back or image_plan is None or image_plan.kind == MISS
        if computed and index in held.images:
            embedded.append(image.grid.tokens)
        else:
            images.append((image.grid.tokens, None if fell_back else image_plan))
        ran_as.append(PLAIN if index >= len(kinds) else "miss" if fell_back else kinds[index])
    return request_work(model, intake.text_chars, images, cached, embedded, padded), reuse_label(ran_as)


def _cached_answer(request: Request, services: Services, found: Found, intake: IntakeResult,
                   headers: dict[str, str]) -> Response:
    """A response-cache hit: the cached answer under a new id, streamed when the request streams."""
    assert found.entry is not None and services.responses is not None
    request.state.reuse = RESPONSE_CACHED
    request.state.stream = intake.params.stream
    public_id = f"chatcmpl-{_new_id()}"
    services.responses.served(public_id, found)
    answer = found.entry.answer
    if intake.params.stream:
        options = intake.params.stream_options
        return EventStream(replay_stream(answer, public_id, include_usage=bool(options and options.include_usage)),
                           headers)
    return OrjsonResponse(answer.completion(public_id), headers=headers)


def _keeper(services: Services, question: Asked | None, found: Found) -> Callable[[Answer], Awaitable[object]] | None:
    """What keeps a missed request's answer in the response cache, when it may be kept."""
    responses = services.responses
    if responses is None or question is None or not question.cacheable:
        return None

    async def keep(answer: Answer) -> None:
        await responses.remember(question, answer, found.embedding)

    return keep


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    """Text completions: no images, so no plan; the same dispatch, errors, tenant scoping and metrics as chat."""
    services = _services(request)
    config = services.config
    caller = _caller(request)
    raw = await _read_body(request, config.max_request_bytes)
    body_bytes = len(raw)
    with lane(services.intake.pool, caller.key_id):  # a large body is parsed in the caller's turn, emptied by it
        size = services.intake.prompt_size
        unparsed = None if size is None else partial(size.check_body, param="prompt")
        body, params = await off_loop(body_bytes, parse_completion_body, raw, config.vocab_size, unparsed,
                                      cost=body_bytes)
    del raw
    if params.model != config.model:
        raise ModelNotFound(params.model)
    if (size := services.intake.prompt_size) is not None:
        size.check(prompt_tokens_at_least(params.prompt, size), param="prompt")
    request.state.reuse = reuse_label(())
    request.state.stream = params.stream
    request_id = _new_id()
    public_id = f"cmpl-{request_id}"
    # A batch of prompts is a batch of SGLang requests: one id each.
    rid: str | list[str] = public_id if params.prompts == 1 else [f"{public_id}-{i}" for i in range(params.prompts)]
    upstream = await UpstreamRequest.encode(upstream_body(body, scope=caller.scope, rid=rid), size_hint=body_bytes,
                                            path=COMPLETIONS_PATH)
    route = Route(public_id=public_id, shape=Shape(TEXT, extras=config.response_extras))
    return await _answer(request, services, upstream, route, stream=params.stream, headers={})


async def _answer(request: Request, services: Services, upstream: UpstreamRequest, route: Route, *, stream: bool,
                  headers: dict[str, str], after_prefill: Callable[[], Awaitable[None]] | None = None,
                  keep: Callable[[Answer], Awaitable[object]] | None = None) -> Response:
    """Send the request to a worker and answer the client: a stream once the worker's first event is in, or the
    whole body. ``after_prefill`` runs once the prompt is prefilled (it may add headers); ``keep`` gets the answer
    once it is complete (the response cache's). It waits first for the caller's turn at the workers
    (gateway/turns.py), which it holds until the response has ended."""
    request.state.ticket.on_release(await services.turns.take(_caller(request).key_id))
    if stream:
        relayed = await services.dispatcher.open_stream(upstream, route)  # returns once the prefill is done
        if after_prefill is not None:
            await after_prefill()
        if keep is not None:
            relayed = recorded(relayed, keep)
        return EventStream(relayed, headers)
    # A client that leaves meanwhile cancels this (gateway/admission.py), and so the upstream request.
    result = await services.dispatcher.complete(upstream, route)
    if after_prefill is not None:
        await after_prefill()
    if keep is not None and (answer := Answer.of(result)) is not None:
        await keep(answer)
    return OrjsonResponse(result, headers=headers)


async def _what_ran(services: Services, planned: Planned, request_id: str) -> tuple[str, dict[int, Outcome] | None]:
    """The reuse header from what the worker reports it ran (plan.outcome), its fallbacks counted and logged, and
    the outcomes (None when the worker reported none). A round trip to the books' server is made on a thread; a
    small file in shared memory is read on the loop (``blocking`` says which)."""
    box = services.outcomes
    reported = box is not None and planned.plan is not None and planned.plan.reported
    ran = None
    if reported and box is not None:
        ran = await on_thread(box.take, request_id) if box.blocking else box.take(request_id)
    if ran is None:
        if reported:
            services.requests.unreported.inc()
        return planned.reuse_header(), None
    for kind, outcome in planned.fallbacks(ran):
        services.requests.fallbacks.labels(kind, outcome.cause or "", outcome.ran).inc()
        log.warning("request %s: an image or video patch planned as %s ran as %s (%s)", request_id, kind,
                    "a full prefill" if outcome.fell_back else "planned, degraded", outcome.cause)
    return planned.reuse_header(ran), ran


def _requested_selector(request: Request, settings: MatchSettings) -> str | None:
    """The selector a request names in its header, checked; None when it names none."""
    name = scope_header(request.scope, SELECTOR_HEADER.encode())
    if name is None:
        return None
    if not settings.allow_selector_header:
        raise InvalidRequest(f"this gateway does not let requests choose the selector ({SELECTOR_HEADER}); "
                             "an operator can allow it with REVISIT_MATCH_ALLOW_SELECTOR_HEADER=1",
                             param=SELECTOR_HEADER, code="selector_not_allowed")
    if name not in SELECTORS:
        raise InvalidRequest(f"{SELECTOR_HEADER} must be one of {', '.join(SELECTORS)}, got {name[:40]!r}",
                             param=SELECTOR_HEADER, code="invalid_selector")
    return name


def _requested_response_level(request: Request) -> str | None:
    """The response-cache level a request names in its header, checked; None when it names none."""
    level = scope_header(request.scope, RESPONSE_CACHE_HEADER.encode())
    if level is None:
        return None
    if level not in (RESPONSE_CACHE_OFF, *RESPONSE_CACHE_LEVELS):
        raise InvalidRequest(f"{RESPONSE_CACHE_HEADER} must be one of {RESPONSE_CACHE_OFF}, "
                             f"{', '.join(RESPONSE_CACHE_LEVELS)}; got {level[:40]!r}", param=RESPONSE_CACHE_HEADER,
                             code="invalid_response_cache_level")
    return level


def _requested_mode(request: Request) -> str:
    mode = scope_header(request.scope, REUSE_MODE_HEADER.encode())
    mode = "all" if mode is None else mode
    if mode not in REUSE_MODES:
        raise InvalidRequest(f"{REUSE_MODE_HEADER} must be one of {', '.join(REUSE_MODES)}, got {mode[:40]!r}",
                             param=REUSE_MODE_HEADER, code="invalid_reuse_mode")
    return mode


def scoped_plan(plan: RequestPlan | None, intake: IntakeResult, scope: str) -> RequestPlan | None:
    """The plan the worker gets, carrying the namespace's cache scope so that SGLang's encoder-output cache is
    never shared between namespaces (engine_ext.executor). A request with images or videos but no reuse plan
    (reuse off, or videos alone) gets one of unstored misses, for the scope alone."""
    if plan is None and (intake.images or intake.videos):
        plan = RequestPlan(images=tuple(
            ImagePlan(key=image.key, kind=MISS, tokens=image.grid.tokens, grid=(image.grid.rows, image.grid.cols),
                      store=False) for image in intake.images))
    return dataclasses.replace(plan, scope=scope) if plan is not None else None


def upstream_body(body: dict[str, Any], *, scope: str, rid: str | list[str]) -> dict[str, Any]:
    """The body SGLang gets: the gateway's request id (which may carry the reuse plan) instead of any the client
    sent, and SGLang's prefix cache scoped to the tenant's namespace, so that no tenant's request is served KV that
    another tenant's request computed. K/V a plan computes differently from a full prefill (moved, derived or
    approximate) need no salt of their own: the worker keeps them out of the prefix cache (engine_ext's
    executor.prefix_cache), while the text before the image still matches what earlier requests left there."""
    upstream = {k: v for k, v in body.items() if k not in _GATEWAY_FIELDS}
    upstream["rid"] = rid
    upstream["extra_key"] = scope
    return upstream


def _model_card(services: Services) -> dict[str, Any]:
    """OpenAI's model object, with the fields vLLM and SGLang add that clients read to size prompts: ``root`` (what
    the model was loaded from) and ``max_model_len`` (its context length), as the workers report them."""
    card = next((w.model_card for w in services.pool.workers if w.healthy and w.model_card), None) or \
        next((w.model_card for w in services.pool.workers if w.model_card), None) or {}
    return {"id": services.config.model, "object": "model", "created": services.started_at, "owned_by": "revisit",
            "root": card.get("root", services.config.model), "parent": None,
            "max_model_len": card.get("max_model_len")}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_services(request))]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict[str, Any]:
    services = _services(request)
    if model != services.config.model:
        raise ModelNotFound(model)
    return _model_card(services)
