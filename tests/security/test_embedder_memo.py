"""The response cache's sentence embedder remembers questions per namespace: a question one tenant asked makes no
other tenant's request faster, so a tenant timing its own requests (a memo hit takes microseconds, a miss tens of
milliseconds of the model) cannot learn what another asked. Counted, not timed: every text that reaches the model
is one memo miss."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gateway.config import ResponseCacheSettings
from gateway.response_cache import Asked, ResponseCache, TextEmbedder

QUESTION = "Which diagnosis does this scan show?"


@pytest.fixture(scope="module")
def embedder():
    embedder = TextEmbedder()
    embedder.start().result()
    yield embedder
    embedder.close()


@pytest.fixture
def model_calls(embedder, monkeypatch) -> list[str]:
    """Every text the embedder hands to its model, in order (a spy on the model's forward pass)."""
    texts: list[str] = []
    forward = embedder._forward

    def spy(batch: list[str]) -> np.ndarray:
        texts.extend(batch)
        return forward(batch)

    monkeypatch.setattr(embedder, "_forward", spy)
    return texts


def _asked(namespace: str, question: str) -> Asked:
    return Asked(namespace=namespace, exact_key=f"{namespace}/{question}", question=question, image_keys=(),
                 uncacheable=None, _fields={}, _history=[], _last={"role": "user"})


def test_a_question_another_namespace_asked_is_no_memo_hit(embedder, model_calls):
    """Through the response cache, as requests reach it: tenant A asks, then tenant B asks the same question."""
    cache = ResponseCache(ResponseCacheSettings(namespaces=("*",)), embedder=embedder)
    question = QUESTION + " (through the cache)"

    async def run() -> None:
        await cache.lookup(_asked("tenant-a", question), "paraphrase")
        assert model_calls == [question]  # A's first ask: computed
        await cache.lookup(_asked("tenant-a", question), "paraphrase")
        assert model_calls == [question]  # A again: remembered for A
        found = await cache.lookup(_asked("tenant-b", question), "paraphrase")
        assert model_calls == [question, question], "B's lookup was served from A's memo (a timing oracle)"
        assert found.entry is None

    asyncio.run(run())


def test_the_memo_is_keyed_by_namespace(embedder):
    async def run() -> None:
        before = embedder.computed
        a = await embedder.embed(QUESTION, namespace="a")
        assert embedder.computed == before + 1
        assert np.array_equal(await embedder.embed(QUESTION, namespace="a"), a)  # a hit for A
        assert embedder.computed == before + 1
        b = await embedder.embed(QUESTION, namespace="b")  # a miss for B: the model runs again
        assert embedder.computed == before + 2
        assert np.allclose(a, b, atol=1e-5)  # the same embedding, computed for B
        embedder.encode([QUESTION, QUESTION + "?"], namespace="c")
        assert embedder.computed == before + 4  # encode keeps to its namespace too

    asyncio.run(run())


def test_the_bound_counts_every_namespace():
    """One bound over all namespaces, least recently used first out."""
    small = TextEmbedder(memo=2)
    small.start().result()

    async def run() -> None:
        await small.embed(QUESTION, namespace="a")
        await small.embed(QUESTION, namespace="b")
        await small.embed(QUESTION, namespace="a")  # A's is now the most recently used
        await small.embed(QUESTION, namespace="c")  # B's leaves
        computed = small.computed
        await small.embed(QUESTION, namespace="a")
        await small.embed(QUESTION, namespace="c")
        assert small.computed == computed  # both kept
        await small.embed(QUESTION, namespace="b")
        assert small.computed == computed + 1  # evicted, computed again

    try:
        asyncio.run(run())
    finally:
        small.close()
