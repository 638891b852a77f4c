"""The objects one gateway app holds for its lifetime, built and torn down in the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client import CollectorRegistry

from gateway.admission import Admission
from gateway.books import BookLog, BooksError, BooksUnavailable, SharedBooks, SharedFeatureStore
from gateway.cache import CacheManager
from gateway.calibration import WorkerCosts
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.image_fetch import ImageFetcher
from gateway.intake import Intake
from gateway.loop_lag import LoopLag
from gateway.matching import extractor_for, scope
from gateway.matching.matcher import FeatureRecords, Matcher
from gateway.matching.moved import MovedImages
from gateway.memory import MemoryTrim
from gateway.metrics import RequestMetrics, ResponseCacheMetrics, build_registry
from gateway.offload import keep_gil_turns_short
from gateway.planner import Planner
from gateway.policy import CachePolicy
from gateway.policy.policy import DEFAULT_TIERS
from gateway.prompt_size import PromptSize
from gateway.response_cache import ResponseCache, TextEmbedder
from gateway.tenancy import Tenants
from gateway.turns import WorkerTurns
from gateway.upstream import UpstreamClient
from gateway.workers import WorkerPool
from plan import plan_key
from plan.outcome import Outcomes, outcome_box
from settings.secret import worker_api_key
from store import FeatureStore, TieredStore, open_store

log = logging.getLogger(__name__)
REBUILD_CHUNK = 2048  # records restored per turn on the cache thread
# Idle connections to workers are dropped after this long: sooner than SGLang closes them (its uvicorn keeps an idle
# connection SGLANG_TIMEOUT_KEEP_ALIVE = 5 s), so that no request goes out on a connection the worker is closing,
# which would fail at once and take a healthy worker out of rotation.
UPSTREAM_KEEP_ALIVE_S = 2.0


@dataclass(slots=True)
class Services:
    config: GatewayConfig
    client: httpx.AsyncClient
    pool: WorkerPool
    fetcher: ImageFetcher
    intake: Intake
    dispatcher: Dispatcher
    cache: CacheManager
    planner: Planner
    metrics: CollectorRegistry
    requests: RequestMetrics
    loop_lag: LoopLag
    tenants: Tenants
    admission: Admission
    turns: WorkerTurns  # each key's turns at the workers (gateway/turns.py)
    memory: MemoryTrim  # gives a large body's or image's freed memory back (gateway/memory.py)
    plan_key: bytes  # plans are authenticated with it (plan.plan_key), under the secret the workers share
    outcomes: Outcomes | None = None  # what workers ran, per request (plan.outcome); None without a store
    responses: ResponseCache | None = None  # answers served without the model; None when off everywhere
    costs: WorkerCosts | None = None  # each worker's costs (gateway/calibration.py); None without the model's facts
    started_at: int = field(default_factory=lambda: int(time.time()))
    _rebuild: asyncio.Task[None] | None = None
    _books: asyncio.Task[None] | None = None
    _follow: asyncio.Task[None] | None = None

    @classmethod
    def build(cls, config: GatewayConfig) -> Services:
        # With a deployment secret the workers take requests only with the API key derived from it.
        api_key = worker_api_key(config.secret)
        authorization = {"Authorization": f"Bearer {api_key}"} if api_key is not None else None
        # Health checks and calibration (a few requests at a time): httpx, pooled keep-alive connections, explicit
        # timeouts.
        client = httpx.AsyncClient(
            headers=authorization,
            timeout=httpx.Timeout(config.upstream_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=64,
                                keepalive_expiry=UPSTREAM_KEEP_ALIVE_S),
        )
        # The completions: the gateway's own client (gateway/upstream.py; httpx took most of the time a text request
        # spent in the gateway). Its timeout bounds the wait for an answer and the gap between two streamed pieces.
        completions = UpstreamClient(connections=config.max_connections, timeout_s=config.upstream_timeout_s,
                                     connect_timeout_s=config.connect_timeout_s, keepalive_s=UPSTREAM_KEEP_ALIVE_S,
                                     headers=authorization)
        pool = WorkerPool(
            config.workers, client, interval_s=config.health_interval_s, timeout_s=config.health_timeout_s
        )
        fetcher = ImageFetcher(config.images)
        reuse = config.reuse
        # The store the workers write: shared-memory files and LMDB on this host, and/or the mooncake tier every host
        # shares (see store/config.py).
        store_config = reuse.store if reuse.enabled else None
        store = open_store(store_config) if store_config is not None else None
        tiers = reuse.store.tiers if reuse.store is not None else DEFAULT_TIERS  # the books manage these
        policy: CachePolicy
        books_address = config.books_address  # the URL with the server's password, if any, in it (shown masked)
        if store_config is not None and books_address is not None:
            # Books shared with other replicas (gateway/books): the policy's changes and the match index's go
            # through one log in the books' server.
            policy = SharedBooks(config.policy, BookLog(books_address, name=store_config.name, secret=config.secret),
                                 tiers=tiers)
        else:
            policy = CachePolicy(config.policy, tiers=tiers)
        matcher, extractor = None, None
        if store_config is not None and reuse.match.enabled:
            # Approximate matching: every new image gets per-token features; they persist beside the store (in the
            # books' server when the books are shared). Not synced at each commit: a crash may lose the last
            # records, which only means those images cannot be aliases; a synced write per miss would hold up the
            # cache thread.
            extractor = extractor_for(reuse.match)
            features: FeatureRecords = SharedFeatureStore(books_address, name=store_config.name,
                                                          secret=config.secret) \
                if isinstance(policy, SharedBooks) and books_address is not None \
                else FeatureStore(store_config.features_path, sync=False)
            matcher = Matcher(reuse.match, scope=scope(config.model, config.processor, extractor), features=features)
            if isinstance(policy, SharedBooks):
                matcher.on_indexed, matcher.on_forgotten = policy.announce_indexed, policy.announce_forgotten
                policy.learn, policy.forget = matcher.learn, matcher.forget
        cache = CacheManager(policy, store=store, on_gone=matcher.remove if matcher is not None else None)
        # Each worker's costs, measured when it comes up (gateway/calibration.py): the planner sends only plans
        # predicted to pay.
        costs = WorkerCosts(config.model_facts, config.model, config.processor, pool, client, config.images) \
            if config.model_facts is not None and config.calibrate else None
        if costs is not None:
            pool.on_up = costs.came_up
        moved = MovedImages(extractor, config.processor.factor, reuse.match) if extractor is not None else None
        planner = Planner(cache, reuse, matcher, costs if config.plan_by_cost else None, moved,
                          reuse_patches=config.videos.reuse_patches)
        registry = build_registry(policy, planner)
        response_metrics = ResponseCacheMetrics(registry)  # exported, at zero, when the response cache is off
        responses = None
        if config.responses.enabled:
            # The sentence embedder (only past the exact level) loads at start, in seconds; the similar level uses
            # the match index, if any.
            embedder = TextEmbedder(config.responses.embedder_path) if config.responses.max_level != "exact" \
                else None
            responses = ResponseCache(config.responses, embedder=embedder, matcher=planner.matcher,
                                      on_cache_thread=cache.run, metrics=response_metrics)
        memory = MemoryTrim()
        turns = WorkerTurns(config.admission.worker_requests_per_key)
        pool.on_devices = turns.workers_run_on
        intake = Intake(config, fetcher, extractor, memory=memory,
                        prompt_size=PromptSize(config.max_token_chars, context=pool.context_length))
        admission = Admission(config.admission, config.max_request_bytes)
        admission.share_budget_with(intake.pool)  # one memory budget per key: its bodies, parses and decodings
        return cls(
            config=config,
            client=client,
            pool=pool,
            fetcher=fetcher,
            intake=intake,
            dispatcher=Dispatcher(pool, completions),
            cache=cache,
            planner=planner,
            metrics=registry,
            requests=RequestMetrics(registry),
            loop_lag=LoopLag(registry, config.loop_lag_interval_s),
            tenants=Tenants(config.tenants, config.secret),
            admission=admission,
            turns=turns,
            memory=memory,
            plan_key=plan_key(config.secret),
            outcomes=outcome_box(reuse.store.outcomes_path, reuse.store.outcomes_address, name=reuse.store.name,
                                 secret=config.secret)
            if store is not None and reuse.store is not None else None,
            responses=responses,
            costs=costs,
        )

    @property
    def policy(self) -> CachePolicy:
        return self.cache.policy

    async def start(self) -> None:
        if self.tenants.open:
            log.warning("open mode: any API key is served, each in a namespace of its own, and requests without "
                        "one share the namespace %r; anyone who reaches this gateway is a tenant (list keys in "
                        "REVISIT_API_KEYS_FILE to serve only them)", self.config.tenants.default_namespace)
        keep_gil_turns_short()
        self.loop_lag.start()
        if self.responses is not None and self.responses.embedder is not None:
            self.responses.embedder.start()
        loop = asyncio.get_running_loop()
        if isinstance(self.policy, SharedBooks):
            # Join the shared books before serving: their snapshot and every event since (a BooksError here stops
            # the start, as a store that cannot be opened does).
            started = time.perf_counter()
            try:
                await self.cache.run(self.policy.load)
            except BooksUnavailable as exc:
                if _refused_credentials(exc):
                    raise BooksUnavailable(
                        f"the shared books' server {self.policy.log.url} refused this gateway's password: "
                        "REVISIT_BOOKS_PASSWORD_FILE must name a file holding the password the server requires "
                        f"({exc.__cause__})") from exc
                raise
            log.info("joined the shared books at %s: %d entries, %d events applied, in %.2f s",
                     self.policy.log.prefix, len(self.policy), self.policy.applied, time.perf_counter() - started)
            self._follow = loop.create_task(self._follow_books(self.policy))
        await self.pool.start()
        matcher, store = self.planner.matcher, self.cache.store
        if store is not None:
            self._books = loop.create_task(self._keep_books(store))
        if matcher is not None and store is not None:
            self._rebuild = loop.create_task(self._rebuild_index(matcher, store))

    async def _keep_books(self, store: TieredStore) -> None:
        """The cache books follow the store, which outlives the gateway and is written by the workers: at start
        every entry a previous run left is booked where it lies (so it is counted, protected and evictable), and
        every ``books_interval_s`` the entries workers wrote since are taken in and the ones lost let go. In
        chunks on the cache thread, so requests are planned in between."""
        first = True
        while True:
            started = time.perf_counter()
            try:
                keys = await self.cache.run(lambda: self.cache.oldest_first(list(store.keys())))
                restored = 0
                for at in range(0, len(keys), REBUILD_CHUNK):
                    restored += (await self.cache.run(self.cache.take_in, keys[at:at + REBUILD_CHUNK])).restored
                lost = await self.cache.run(self.cache.drop_lost, set(keys))
                if self.outcomes is not None:
                    await self.cache.run(self.outcomes.sweep)  # outcomes whose gateway died before taking them
                if first:
                    log.info("cache books rebuilt from the store: %d entries taken in, %d lost, in %.2f s",
                             restored, lost, time.perf_counter() - started)
                    first = False
            except asyncio.CancelledError:
                raise
            except Exception:  # the books stay as they are until the next pass; the gateway keeps serving
                log.exception("reconciling the cache books with the store failed")
            await asyncio.sleep(self.config.books_interval_s)

    async def _follow_books(self, books: SharedBooks) -> None:
        """Apply the other replicas' changes to this one's books every books_follow_interval_s."""
        while True:
            try:
                await self.cache.run(books.catch_up)
            except asyncio.CancelledError:
                raise
            except BooksError as exc:  # the server is away: serve on the books as they are, and try again
                log.warning("could not follow the shared books: %s", exc)
                await asyncio.sleep(1.0)
            await asyncio.sleep(self.config.books_follow_interval_s)

    async def _rebuild_index(self, matcher: Matcher, store: TieredStore) -> None:
        """The match index from the features beside the store, in chunks on the cache thread, so that requests
        are planned in between (a 100k-image index takes tens of seconds: bench/matching.py); until it is done a
        near-duplicate of a not yet restored image is planned as a miss."""
        started = time.perf_counter()
        records = await self.cache.run(matcher.persisted, store.contains)
        for at in range(0, len(records), REBUILD_CHUNK):
            await self.cache.run(matcher.restore, records[at:at + REBUILD_CHUNK])
        log.info("match index rebuilt from the store: %d images in %.2f s", len(records),
                 time.perf_counter() - started)

    async def aclose(self) -> None:
        for task in (self._rebuild, self._books, self._follow):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.loop_lag.stop()
        await self.pool.stop()
        if self.costs is not None:
            await self.costs.aclose()
        if self.responses is not None and self.responses.embedder is not None:
            self.responses.embedder.close()
        await asyncio.to_thread(self.cache.close)
        if self.planner.matcher is not None and self.planner.matcher.features is not None:
            self.planner.matcher.features.close()
        if isinstance(self.policy, SharedBooks):
            self.policy.log.close()
        await self.intake.aclose()
        await self.fetcher.aclose()
        await self.dispatcher.aclose()
        await self.client.aclose()


def _refused_credentials(exc: BaseException) -> bool:
    """Whether the books' server refused the client's password (or its lack of one), not merely failed to answer."""
    import redis

    return isinstance(exc.__cause__, redis.AuthenticationError)
