"""The response cache's entries and lookups (see the package docstring for the levels).

Entries live in this process's memory, bounded by ``max_bytes`` (least recently used leave first) and ``ttl_s``;
a gateway restart starts it empty. Every index is per namespace (each key names it), so no lookup can reach
another namespace's answers. Event loop only: lookups that need the sentence embedder or the match index wait for
the embedder's thread or the cache thread, and change nothing meanwhile.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import orjson

from gateway.config import RESPONSE_CACHE_LEVELS, RESPONSE_CACHE_OFF, ResponseCacheSettings
from gateway.images import CanonicalImage
from gateway.matching.align import CHANGED
from gateway.matching.matcher import Lookup, Matcher
from gateway.response_cache.asked import Asked
from gateway.response_cache.embedder import TextEmbedder
from gateway.response_cache.guard import VETOES, Salient, veto_salient

if TYPE_CHECKING:
    from gateway.metrics import ResponseCacheMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")
EXACT, PARAPHRASE, SIMILAR = RESPONSE_CACHE_LEVELS
HIT, MISS, VETO = "hit", "miss", "veto"  # a level's lookup results
_SERVED = 65536  # hits remembered by response id, for false-hit reports
_ENTRY_OVERHEAD = 1024  # bytes an entry costs besides its answer, question and embedding


@dataclass(frozen=True, slots=True)
class Answer:
    """A finished chat completion as the cache keeps it: one choice, text only."""

    model: str
    message: dict[str, Any]  # role, content, and the (null) fields the response shape gave it
    finish_reason: str | None
    usage: dict[str, Any] | None
    system_fingerprint: str | None = None

    @classmethod
    def of(cls, body: dict[str, Any]) -> Answer | None:
        """From a (shaped) completion body; None when it is not one the cache keeps: several choices, tool calls,
        logprobs, or any content beside text."""
        choices = body.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        message = choice.get("message")
        if not isinstance(message, dict) or message.get("role") != "assistant" or \
                not isinstance(message.get("content"), str) or choice.get("logprobs") is not None:
            return None
        if any(value not in (None, [], {}) for name, value in message.items() if name not in ("role", "content")):
            return None  # tool calls, reasoning, audio, a refusal: kept out of replayed streams
        usage = body.get("usage")
        return cls(model=str(body.get("model", "")), message=message, finish_reason=choice.get("finish_reason"),
                   usage=usage if isinstance(usage, dict) else None,
                   system_fingerprint=body.get("system_fingerprint"))

    def _usage(self) -> dict[str, Any] | None:
        """The first answer's token counts, every prompt token counted as cached (none was computed again)."""
        if self.usage is None:
            return None
        usage = copy.deepcopy(self.usage)
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            details = usage.get("prompt_tokens_details")
            usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}),
                                              "cached_tokens": prompt}
        return usage

    def completion(self, public_id: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": public_id, "object": "chat.completion", "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "message": copy.deepcopy(self.message), "logprobs": None,
                         "finish_reason": self.finish_reason}]}
        if (usage := self._usage()) is not None:
            body["usage"] = usage
        if self.system_fingerprint is not None:
            body["system_fingerprint"] = self.system_fingerprint
        return body

    def chunks(self, public_id: str, *, include_usage: bool) -> Iterator[dict[str, Any]]:
        """The answer as a stream: the role, the content, the finish reason and (when asked) the usage."""
        head = {"id": public_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model}
        if self.system_fingerprint is not None:
            head["system_fingerprint"] = self.system_fingerprint

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]}

        yield chunk({"role": "assistant", "content": ""})
        if self.message["content"]:
            yield chunk({"content": self.message["content"]})
        yield chunk({}, self.finish_reason)
        if include_usage and (usage := self._usage()) is not None:
            yield {**head, "choices": [], "usage": usage}


@dataclass(eq=False, slots=True)
class Entry:
    id: int
    namespace: str
    exact_key: str
    context_key: str
    question: str
    salient: Salient
    embedding: np.ndarray | None
    image_keys: tuple[str, ...]
    answer: Answer
    size: int
    created: float
    hits: int = 0


@dataclass(frozen=True, slots=True)
class Found:
    """What a lookup found: a level's hit (``entry``), or why none."""

    level: str  # the level that served it; MISS when none did; RESPONSE_CACHE_OFF when not looked up
    entry: Entry | None = None
    similarity: float | None = None  # the questions' cosine (paraphrase, similar)
    image_similarity: float | None = None  # the near-duplicate's (similar)
    reason: str | None = None  # a miss's: why it was not looked up (asked.SKIP_REASONS) or the last veto
    embedding: np.ndarray | None = field(default=None, repr=False)  # the question's, when computed

    @property
    def hit(self) -> bool:
        return self.entry is not None

    def header(self) -> str:
        """``x-revisit-response-cache``: ``exact``, ``paraphrase;similarity=0.9312``,
        ``similar;similarity=0.9411;image_similarity=0.9987``, ``miss`` (``;veto=<why>``), ``skipped;reason=...``."""
        if self.entry is None:
            if self.reason is not None and self.reason not in VETOES:
                return f"skipped;reason={self.reason}"
            return MISS + (f";veto={self.reason}" if self.reason else "")
        parts = [self.level]
        if self.similarity is not None and self.level != EXACT:
            parts.append(f"similarity={_floor(self.similarity)}")
        if self.image_similarity is not None:
            parts.append(f"image_similarity={_floor(self.image_similarity)}")
        return ";".join(parts)


def _floor(value: float) -> str:
    return f"{int(value * 10_000) / 10_000:.4f}"  # rounded down: a paraphrase never reads as 1


NOT_LOOKED_UP = Found(RESPONSE_CACHE_OFF)


class ResponseCache:
    def __init__(self, settings: ResponseCacheSettings, *, embedder: TextEmbedder | None = None,
                 matcher: Matcher | None = None,
                 on_cache_thread: Callable[..., Awaitable[Any]] | None = None,
                 metrics: ResponseCacheMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.embedder = embedder
        self.matcher = matcher  # the approximate-match index (the similar level); its calls go to the cache thread
        self._on_cache_thread = on_cache_thread
        self._clock = clock
        self.metrics = metrics  # Prometheus' copies of the counts below (read on the scraping thread)
        self._ids = itertools.count(1)
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._by_exact: dict[str, Entry] = {}
        self._by_context: dict[str, OrderedDict[int, Entry]] = {}
        self._contexts_of_image: dict[str, Counter[str]] = defaultdict(Counter)  # image key -> context keys
        self._served: OrderedDict[str, tuple[str, int]] = OrderedDict()  # response id -> (level, entry id)
        self.bytes = 0
        self._pending: set[asyncio.Task[None]] = set()  # embeddings of entries kept while the embedder loaded
        self.lookups: Counter[tuple[str, str]] = Counter()  # (level, HIT / MISS / VETO)
        self.vetoes: Counter[tuple[str, str]] = Counter()  # (level, guard.VETOES)
        self.skipped: Counter[str] = Counter()  # asked.SKIP_REASONS
        self.false_hits: Counter[str] = Counter()  # level
        self.events: Counter[str] = Counter()  # stored, replaced, evicted, expired, flushed, too_large
        self.observe: Callable[[str, float], None] | None = None  # called with (level, seconds) per level looked up
        if metrics is not None:
            metrics.entries.set_function(lambda: len(self._entries))
            metrics.bytes.set_function(lambda: self.bytes)

    # --- lookups ---

    async def lookup(self, asked: Asked, level: str, images: Sequence[CanonicalImage] = ()) -> Found:
        """Escalate from exact up to ``level``; the first hit wins."""
        if level == RESPONSE_CACHE_OFF:
            return NOT_LOOKED_UP
        if not asked.cacheable:
            self.skipped[asked.uncacheable or ""] += 1
            if self.metrics is not None:
                self.metrics.skipped.labels(asked.uncacheable or "").inc()
            return Found(MISS, reason=asked.uncacheable)
        top = RESPONSE_CACHE_LEVELS.index(level)
        started = time.perf_counter()
        entry = self._fresh(self._by_exact.get(asked.exact_key))
        self._count(EXACT, HIT if entry is not None else MISS, started)
        if entry is not None:
            return self._hit(Found(EXACT, entry, similarity=1.0))
        if top < 1 or self.embedder is None:
            return Found(MISS)
        started = time.perf_counter()
        embedding = await self._embed(asked.namespace, asked.question, wait=False)
        if embedding is None:  # no embedder, or not loaded yet: a request never waits for it
            return Found(MISS)
        salient = Salient.of(asked.question)
        found = self._closest(PARAPHRASE, asked.context_key(), embedding, salient,
                              self.settings.paraphrase_threshold)
        self._count(PARAPHRASE, _result(found), started)
        if found.hit or top < 2 or self.matcher is None or not images:
            return self._hit(found) if found.hit else Found(MISS, reason=found.reason, embedding=embedding)
        started = time.perf_counter()
        similar = await self._similar(asked, embedding, salient, images)
        self._count(SIMILAR, _result(similar), started)
        if similar.hit:
            return self._hit(similar)
        return Found(MISS, reason=similar.reason or found.reason, embedding=embedding)

    def _closest(self, level: str, context_key: str, embedding: np.ndarray, salient: Salient,
                 threshold: float) -> Found:
        """The most similar cached question of the context at ``threshold`` or above that the guard lets pass."""
        bucket = self._by_context.get(context_key)
        if not bucket:
            return Found(level)
        entries = [e for e in list(bucket.values()) if self._fresh(e) is not None and e.embedding is not None]
        if not entries:
            return Found(level)
        scores = np.stack([e.embedding for e in entries if e.embedding is not None]) @ embedding
        vetoed = None
        for index in np.argsort(-scores):
            score = float(scores[index])
            if score < threshold:
                break
            entry = entries[int(index)]
            reason = veto_salient(salient, entry.salient) if self.settings.guard else None
            if reason is None:
                return Found(level, entry, similarity=score)
            vetoed = vetoed or reason
            self.vetoes[(level, reason)] += 1
            if self.metrics is not None:
                self.metrics.vetoes.labels(level, reason).inc()
        return Found(level, reason=vetoed)

    async def _similar(self, asked: Asked, embedding: np.ndarray, salient: Salient,
                       images: Sequence[CanonicalImage]) -> Found:
        """The paraphrase lookup in the context where each image that has a near-duplicate with cached answers
        (at most ``similar_max_changed`` tokens changed) is named by that near-duplicate."""
        assert self.matcher is not None
        substitute: dict[str, str] = {}
        similarities: list[float] = []
        for image in images:
            if image.features is None or image.key in substitute:
                continue
            lookup: Lookup = await self._cache_thread(self.matcher.lookup, asked.namespace, image.key,
                                                      image.features)
            for match in lookup.matches:
                if match.alias != image.key and match.alias in self._contexts_of_image and \
                        match.alignment.count(CHANGED) <= self.settings.similar_max_changed:
                    substitute[image.key] = match.alias
                    similarities.append(match.alignment.similarity)
                    break
        if not substitute:
            return Found(SIMILAR)
        found = self._closest(SIMILAR, asked.context_key(substitute), embedding, salient,
                              self.settings.similar_text_threshold)
        return Found(SIMILAR, found.entry, similarity=found.similarity, image_similarity=min(similarities),
                     reason=found.reason) if found.hit else Found(SIMILAR, reason=found.reason)

    async def _embed(self, namespace: str, question: str, *, wait: bool = True) -> np.ndarray | None:
        """The question's embedding, remembered for ``namespace`` only (a question another namespace asked is no
        faster: embedder.py); None without an embedder, while it loads unless ``wait``, or when it failed (logged:
        the paraphrase and similar levels then miss, and answers are kept for the exact level alone)."""
        if self.embedder is None or self.embedder.state == "failed" or \
                (not wait and self.embedder.state != "ready"):
            return None
        try:
            return await self.embedder.embed(question, namespace=namespace)
        except Exception:
            log.exception("response cache: the sentence embedder failed")
            return None

    async def _cache_thread(self, work: Callable[..., T], /, *args: Any) -> T:
        if self._on_cache_thread is None:
            return work(*args)
        return await self._on_cache_thread(work, *args)

    def _hit(self, found: Found) -> Found:
        assert found.entry is not None
        found.entry.hits += 1
        self._entries.move_to_end(found.entry.id)
        return found

    def _count(self, level: str, result: str, started: float) -> None:
        self.lookups[(level, result)] += 1
        elapsed = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.lookups.labels(level, result).inc()
            self.metrics.lookup_seconds.labels(level).observe(elapsed)
        if self.observe is not None:
            self.observe(level, elapsed)

    def _fresh(self, entry: Entry | None) -> Entry | None:
        if entry is not None and self._clock() - entry.created > self.settings.ttl_s:
            self._forget(entry)
            self._event("expired", 1)
            return None
        return entry

    def _event(self, name: str, count: int = 1) -> None:
        self.events[name] += count
        if self.metrics is not None and count:
            self.metrics.events.labels(name).inc(count)

    # --- storing ---

    async def remember(self, asked: Asked, answer: Answer, embedding: np.ndarray | None = None) -> Entry | None:
        """Keep ``answer`` for what was asked (replacing an answer to the same exact request)."""
        if not asked.cacheable:
            return None
        if embedding is None:
            embedding = await self._embed(asked.namespace, asked.question, wait=False)
        answer_bytes = len(orjson.dumps(answer.message)) + len(orjson.dumps(answer.usage))
        size = answer_bytes + 2 * len(asked.question) + (embedding.nbytes if embedding is not None else 0) + \
            _ENTRY_OVERHEAD
        if answer_bytes > self.settings.max_answer_bytes or size > self.settings.max_bytes:
            self._event("too_large", 1)
            return None
        if (old := self._by_exact.get(asked.exact_key)) is not None:
            self._forget(old)
            self._event("replaced", 1)
        entry = Entry(id=next(self._ids), namespace=asked.namespace, exact_key=asked.exact_key,
                      context_key=asked.context_key(), question=asked.question, salient=Salient.of(asked.question),
                      embedding=embedding, image_keys=asked.image_keys, answer=answer, size=size,
                      created=self._clock())
        self._entries[entry.id] = entry
        self._by_exact[entry.exact_key] = entry
        bucket = self._by_context.setdefault(entry.context_key, OrderedDict())
        bucket[entry.id] = entry
        while len(bucket) > self.settings.bucket_size:
            self._forget(next(iter(bucket.values())))
            self._event("evicted", 1)
        for key in entry.image_keys:
            self._contexts_of_image[key][entry.context_key] += 1
        self.bytes += size
        self._event("stored", 1)
        if embedding is None and self.embedder is not None and self.embedder.state != "failed":
            self._embed_later(entry)
        while self.bytes > self.settings.max_bytes and self._entries:
            self._forget(next(iter(self._entries.values())))
            self._event("evicted", 1)
        return entry

    def _embed_later(self, entry: Entry) -> None:
        """Give an entry kept while the embedder was loading its embedding once it is ready (its answer is served
        at the exact level meanwhile)."""

        async def fill() -> None:
            vector = await self._embed(entry.namespace, entry.question)
            if vector is not None and self._entries.get(entry.id) is entry and entry.embedding is None:
                entry.embedding = vector
                entry.size += vector.nbytes
                self.bytes += vector.nbytes

        task = asyncio.get_running_loop().create_task(fill())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _forget(self, entry: Entry) -> None:
        if self._entries.pop(entry.id, None) is None:
            return
        self.bytes -= entry.size
        if self._by_exact.get(entry.exact_key) is entry:
            del self._by_exact[entry.exact_key]
        bucket = self._by_context.get(entry.context_key)
        if bucket is not None:
            bucket.pop(entry.id, None)
            if not bucket:
                del self._by_context[entry.context_key]
        for key in entry.image_keys:
            contexts = self._contexts_of_image.get(key)
            if contexts is not None:
                contexts[entry.context_key] -= 1
                if contexts[entry.context_key] <= 0:
                    del contexts[entry.context_key]
                if not contexts:
                    del self._contexts_of_image[key]

    # --- operators and clients ---

    def served(self, response_id: str, found: Found) -> None:
        """Remember which entry answered ``response_id``, for a false-hit report."""
        if found.entry is None:
            return
        self._served[response_id] = (found.level, found.entry.id)
        while len(self._served) > _SERVED:
            self._served.popitem(last=False)

    def report_false_hit(self, response_id: str) -> dict[str, Any] | None:
        """A client or operator says the cached answer ``response_id`` got was wrong: counted under its level, and
        the entry that served it is dropped. None when no recent hit had that id."""
        served = self._served.pop(response_id, None)
        if served is None:
            return None
        level, entry_id = served
        self.false_hits[level] += 1
        if self.metrics is not None:
            self.metrics.false_hits.labels(level).inc()
        entry = self._entries.get(entry_id)
        if entry is not None:
            self._forget(entry)
        log.warning("response cache: false hit reported for %s (%s level)", response_id, level)
        return {"level": level, "removed": entry is not None}

    def flush(self, namespace: str | None = None) -> int:
        """Drop every entry (of ``namespace``, when given); returns how many."""
        doomed = [e for e in self._entries.values() if namespace is None or e.namespace == namespace]
        for entry in doomed:
            self._forget(entry)
        self._event("flushed", len(doomed))
        return len(doomed)

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, Any]:
        levels = {}
        for level in RESPONSE_CACHE_LEVELS:
            levels[level] = {"hits": self.lookups[(level, HIT)], "misses": self.lookups[(level, MISS)],
                             "vetoes": self.lookups[(level, VETO)],
                             "vetoes_by_reason": {r: self.vetoes[(level, r)] for r in VETOES},
                             "false_hits": self.false_hits[level]}
        return {"enabled": self.settings.enabled, "namespaces": list(self.settings.namespaces),
                "embedder": self.embedder.state if self.embedder is not None else "none",
                "entries": len(self._entries), "bytes": self.bytes, "capacity_bytes": self.settings.max_bytes,
                "levels": levels, "skipped": dict(self.skipped),
                **{name: self.events[name] for name in ("stored", "replaced", "evicted", "expired", "flushed",
                                                        "too_large")}}


def _result(found: Found) -> str:
    return HIT if found.hit else VETO if found.reason is not None else MISS
