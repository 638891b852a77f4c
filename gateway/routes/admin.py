"""The operator's REST API under /admin, and /metrics.

Every /admin route needs ``Authorization: Bearer <REVISIT_ADMIN_TOKEN>``: a missing or
wrong token is a 401; with no token configured the admin API is disabled and answers 403.
/metrics is open (Prometheus scrapers rarely carry tokens) unless
``REVISIT_METRICS_REQUIRE_TOKEN=1``, which puts it behind the same token.

Routes:
  GET    /admin/stats                    the policy's figures, the planner's counts and the match index's size
                                         (the same as /metrics); each worker's measured costs (worker_costs)
  GET    /admin/entries?limit&cursor&tier entries sorted by key; ``next_cursor`` pages on
  GET    /admin/entries/{key}            one entry
  DELETE /admin/entries/{key}?force=     drop it (409 when pinned, unless force=true)
  POST   /admin/entries/{key}/pin        pin;  DELETE on the same path unpins
  GET    /admin/recent?limit=            the last requests that ran the model, newest first
  GET    /admin/history                  the last hour a minute at a time: requests, failures, images by plan
                                         kind and the hit rate, streamed TTFT medians by reuse label
  GET    /admin/presets                  the preset priors in use
  POST   /admin/presets                  replace them: {"keys": {key: w}, "families": {label: w}}
  POST   /admin/flush?force=             drop every entry (pinned ones only with force=true)
  DELETE /admin/response-cache?namespace= drop the response cache's answers (of one namespace, when given)
  POST   /admin/response-cache/false-hits report a wrong cached answer: {"id": "<the response's id>"}; counted
                                         under the level that served it, and its entry dropped
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Annotated, Literal, TypeVar

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.books import BooksError, SharedBooks
from gateway.cache import CacheManager
from gateway.errors import ClientError, InvalidRequest, StoreUnavailable, Unauthorized
from gateway.metrics import exposition, planner_stats
from gateway.policy import (
    CacheEntry,
    CachePolicy,
    EntryPinned,
    InvalidPriors,
    PresetPriors,
    Tier,
    UnknownEntry,
    decision_dict,
    is_entry_key,
)
from gateway.response_cache import ResponseCache
from store import StoreError

MAX_PAGE = 1000
T = TypeVar("T")


class AdminDisabled(ClientError):
    status_code = 403
    error_type = "permission_error"

    def __init__(self) -> None:
        super().__init__(
            "The admin API is disabled: set REVISIT_ADMIN_TOKEN to enable it.", code="admin_disabled"
        )


class EntryNotFound(ClientError):
    status_code = 404

    def __init__(self, key: str):
        super().__init__(f"No cache entry with key '{key}'.", param="key", code="entry_not_found")


class EntryConflict(ClientError):
    status_code = 409

    def __init__(self, message: str):
        super().__init__(message, param="key", code="entry_pinned")


class ResponseCacheOff(ClientError):
    status_code = 404

    def __init__(self) -> None:
        super().__init__("The response cache is off: set REVISIT_RESPONSE_CACHE_NAMESPACES to enable it.",
                         code="response_cache_off")


class UnknownResponse(ClientError):
    status_code = 404

    def __init__(self, response_id: str):
        super().__init__(f"No recent response-cache hit has the id '{response_id[:80]}'.", param="id",
                         code="unknown_response")


def check_admin_token(request: Request) -> None:
    """Raise unless the request carries the configured admin bearer token."""
    expected = request.app.state.services.config.admin_token
    if not expected:
        raise AdminDisabled()
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("Missing admin token: send 'Authorization: Bearer <token>'.", code="missing_token")
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise Unauthorized("Invalid admin token.", code="invalid_token")


def check_metrics_token(request: Request) -> None:
    if request.app.state.services.config.metrics_require_token:
        check_admin_token(request)


router = APIRouter(prefix="/admin", dependencies=[Depends(check_admin_token)])
metrics_router = APIRouter(dependencies=[Depends(check_metrics_token)])


def _cache(request: Request) -> CacheManager:
    return request.app.state.services.cache


async def _on_cache_thread(request: Request, work: Callable[[CachePolicy, CacheManager], T]) -> T:
    """Run ``work(policy, cache)`` where the books live: on the cache thread, never on the event loop. The store
    or the shared books away is a 503."""
    cache = _cache(request)
    try:
        return await cache.run(work, cache.policy, cache)
    except (StoreError, BooksError) as exc:
        raise StoreUnavailable(f"the cache's store or books did not answer: {exc}", code="store_unavailable") \
            from exc


def _checked_key(key: str) -> str:
    if not is_entry_key(key):
        raise InvalidRequest(f"'{key}' is not a cache key (64 lowercase hex digits).", param="key")
    return key


def _entry_body(policy: CachePolicy, entry: CacheEntry) -> dict:
    return {"object": "cache.entry", **entry.as_dict(), "preset_score": policy.preset_score(entry)}


@metrics_router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = request.app.state.services.metrics
    text = await _on_cache_thread(request, lambda policy, cache: exposition(registry))
    return Response(text, media_type=CONTENT_TYPE_LATEST)


@router.get("/stats")
async def stats(request: Request) -> dict:
    services = request.app.state.services
    planner = services.planner
    # The response cache lives on the event loop: read here, not on the cache thread.
    responses = services.responses.stats() if services.responses is not None else {"enabled": False}
    return {"object": "cache.stats", **await _on_cache_thread(
        request, lambda policy, cache: {**policy.stats().as_dict(), **planner_stats(planner),
                                        "books": books_status(policy)}),
        "response_cache": responses, "admission": services.admission.stats(),
        "worker_turns": services.turns.stats(),
        "worker_costs": services.costs.snapshot() if services.costs is not None else None}


def books_status(policy: CachePolicy) -> dict:
    """Whether the books are shared with other replicas and, when they are, this replica's place in their log."""
    return policy.status() if isinstance(policy, SharedBooks) else {"shared": False}


@router.get("/entries")
async def list_entries(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: str | None = None,
    tier: Literal["dram", "lmdb", "mooncake"] | None = None,
) -> dict:
    """Entries sorted by key; pass the answer's ``next_cursor`` as ``cursor`` for the next page."""
    if cursor is not None:
        _checked_key(cursor)

    def page_of(policy: CachePolicy, cache: CacheManager) -> dict:
        page = policy.entries(after=cursor, limit=limit + 1, tier=Tier(tier) if tier else None)
        has_more = len(page) > limit
        page = page[:limit]
        return {
            "object": "list",
            "data": [_entry_body(policy, entry) for entry in page],
            "has_more": has_more,
            "next_cursor": page[-1].key if has_more else None,
        }

    return await _on_cache_thread(request, page_of)


@router.get("/entries/{key}")
async def get_entry(request: Request, key: str) -> dict:
    _checked_key(key)
    try:
        return await _on_cache_thread(request, lambda policy, cache: _entry_body(policy, policy.get(key)))
    except UnknownEntry:
        raise EntryNotFound(key) from None


@router.delete("/entries/{key}")
async def delete_entry(request: Request, key: str, force: bool = False) -> dict:
    _checked_key(key)
    try:
        decisions = await _on_cache_thread(request, lambda policy, cache: cache.remove(key, force=force))
    except UnknownEntry:
        raise EntryNotFound(key) from None
    except EntryPinned as exc:
        raise EntryConflict(str(exc)) from None
    return {"object": "cache.entry.deleted", "key": key, "deleted": True,
            "decisions": [decision_dict(d) for d in decisions]}


@router.post("/entries/{key}/pin")
async def pin_entry(request: Request, key: str) -> dict:
    return await _set_pinned(request, key, pinned=True)


@router.delete("/entries/{key}/pin")
async def unpin_entry(request: Request, key: str) -> dict:
    return await _set_pinned(request, key, pinned=False)


async def _set_pinned(request: Request, key: str, *, pinned: bool) -> dict:
    _checked_key(key)
    try:
        return await _on_cache_thread(
            request, lambda policy, cache: _entry_body(policy, cache.set_pinned(key, pinned)))
    except UnknownEntry:
        raise EntryNotFound(key) from None


@router.get("/recent")
async def recent(request: Request, limit: Annotated[int, Query(ge=1, le=200)] = 50) -> dict:
    """What the last requests that ran the model got: when, the endpoint, the status, the reuse label
    (gateway/metrics.py), the time to the first streamed token and the whole time."""
    kept = request.app.state.services.requests.recent
    return {"object": "list", "data": list(reversed(kept))[:limit]}


@router.get("/history")
async def history(request: Request) -> dict:
    """The last hour a minute at a time (metrics.LastHour), for the operator page's charts."""
    return request.app.state.services.requests.last_hour.snapshot()


async def _json_body(request: Request) -> object:
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise InvalidRequest(f"The body is not valid JSON: {exc}") from None


@router.get("/presets")
async def get_presets(request: Request) -> dict:
    return await _on_cache_thread(request, lambda policy, cache: _presets_body(policy))


@router.post("/presets")
async def set_presets(request: Request) -> dict:
    """Replace the priors. Body: ``{"keys": {<key>: weight}, "families": {<label>: weight}}``, weights > 0."""
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object with 'keys' and/or 'families'.")
    unknown = sorted(set(body) - {"keys", "families"})
    if unknown:
        raise InvalidRequest(f"Unknown field '{unknown[0]}'; expected 'keys' and/or 'families'.", param=unknown[0])
    for name in ("keys", "families"):
        if not isinstance(body.get(name, {}), dict):
            raise InvalidRequest(f"'{name}' must be an object mapping names to weights.", param=name)
    try:
        priors = PresetPriors(keys=body.get("keys", {}), families=body.get("families", {}))
    except InvalidPriors as exc:
        raise InvalidRequest(str(exc), param=exc.param) from None

    def replace(policy: CachePolicy, cache: CacheManager) -> dict:
        policy.set_priors(priors)
        return _presets_body(policy)

    return await _on_cache_thread(request, replace)


def _responses(request: Request) -> ResponseCache:
    responses = request.app.state.services.responses
    if responses is None:
        raise ResponseCacheOff()
    return responses


@router.delete("/response-cache")
async def flush_responses(request: Request, namespace: str | None = None) -> dict:
    removed = _responses(request).flush(namespace)
    return {"object": "response_cache.flush", "removed": removed, "namespace": namespace,
            "remaining": len(_responses(request))}


@router.post("/response-cache/false-hits")
async def report_false_hit(request: Request) -> dict:
    """Body: ``{"id": "chatcmpl-..."}``, the id of a response the cache served (kept for its last 65,536 hits)."""
    body = await _json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("id"), str) or set(body) != {"id"}:
        raise InvalidRequest("The body must be {\"id\": \"<the id of a response the cache served>\"}.", param="id")
    reported = _responses(request).report_false_hit(body["id"])
    if reported is None:
        raise UnknownResponse(body["id"])
    return {"object": "response_cache.false_hit", "id": body["id"], **reported}


def _presets_body(policy: CachePolicy) -> dict:
    return {"object": "cache.presets", **policy.priors.as_dict(), "preset": policy.stats().preset.as_dict()}


@router.post("/flush")
async def flush(request: Request, force: bool = False) -> dict:
    def drop_all(policy: CachePolicy, cache: CacheManager) -> dict:
        before = policy.stats()
        decisions = cache.flush(force=force)
        after = policy.stats()
        freed = sum(u.bytes for u in before.tiers.values()) - sum(u.bytes for u in after.tiers.values())
        stored = sum(1 for _ in cache.store.keys()) if cache.store is not None else len(policy)
        return {"object": "cache.flush", "evicted": len(decisions), "evicted_bytes": freed, "remaining": len(policy),
                "remaining_in_store": stored}

    return await _on_cache_thread(request, drop_all)
