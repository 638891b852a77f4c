"""The response cache's parts without a worker: what a request asks (keys, cacheability), the guard, the cache's
levels, bounds and namespaces with the real sentence embedder and the real match index, the stream recorder, the
settings; and the acceptance figure, measured: at the default settings no wrong answer on the oracle's question set
(bench/response_cache.py quality, a smaller draw)."""

from __future__ import annotations

import asyncio
import base64
import sys
from pathlib import Path

import orjson
import pytest
from PIL import Image

from gateway.config import ConfigError, GatewayConfig, MatchSettings, ResponseCacheSettings
from gateway.image_fetch import ImageFetcher
from gateway.intake import Intake
from gateway.matching import extractor_for, scope
from gateway.matching.align import CHANGED
from gateway.matching.matcher import Matcher
from gateway.response_cache import Answer, ResponseCache, StreamRecorder, TextEmbedder, asked, recorded, replay_stream
from gateway.response_cache.guard import ASKING, ASPECT, CONTRAST, ENTITY, NEGATION, NUMBER, veto
from tests.images_lib import encode, small
from tests.openai_schema import assert_valid

ROOT = Path(__file__).resolve().parents[2]
ON = ResponseCacheSettings(namespaces=("*",))


@pytest.fixture(scope="module")
def embedder():
    embedder = TextEmbedder()
    embedder.start().result()  # loaded: lookups never wait for it
    yield embedder
    embedder.close()


@pytest.fixture(scope="module")
def intake():
    config = GatewayConfig(model="m", workers=("http://127.0.0.1:9",))
    return Intake(config, ImageFetcher(config.images), extractor_for(MatchSettings()))


def _url(image: Image.Image, fmt: str = "PNG", **save) -> str:
    mime = "image/png" if fmt == "PNG" else "image/jpeg"
    return f"data:{mime};base64," + base64.b64encode(encode(image, fmt, **save)).decode()


def _body(text: str, *images: str, history: list | None = None, **fields) -> bytes:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    content.append({"type": "text", "text": text})
    return orjson.dumps({"model": "m", "messages": [*(history or []), {"role": "user", "content": content}],
                         "temperature": 0, "max_tokens": 8, **fields})


def _process(intake: Intake, raw: bytes, namespace: str = "ns"):
    return asyncio.run(intake.process(raw, namespace=namespace))


def _answer(text: str) -> Answer:
    return Answer(model="m", message={"role": "assistant", "content": text, "refusal": None}, finish_reason="stop",
                  usage={"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32})


# --- what is asked ---


def test_exact_keys_follow_what_changes_the_answer(intake):
    cat = _url(small("chelsea.png"))
    base = asked(_process(intake, _body("What is this?", cat)))
    assert base.cacheable and base.question == "What is this?"
    same = asked(_process(intake, _body("  What   is this? ", cat, stream=True, user="someone")))
    assert same.exact_key == base.exact_key  # white space, streaming and the user field change no answer
    for other in (_body("what is this?", cat), _body("What is this?", cat, max_tokens=9),
                  _body("What is this?", _url(small("coffee.png"))), _body("What is this?", cat, top_p=0.5)):
        assert asked(_process(intake, other)).exact_key != base.exact_key
    assert asked(_process(intake, _body("What is this?", cat), namespace="other")).exact_key != base.exact_key
    # The context leaves the question out, and nothing else.
    assert asked(_process(intake, _body("What animal is it?", cat))).context_key() == base.context_key()
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert asked(_process(intake, _body("What is this?", cat, history=history))).context_key() != base.context_key()


def test_what_is_not_cached(intake):
    cat = _url(small("chelsea.png"))
    reasons = {
        "sampling": _body("What is this?", cat, temperature=0.7),
        "choices": _body("What is this?", cat, n=2),
        "logprobs": _body("What is this?", cat, logprobs=True),
    }
    for reason, raw in reasons.items():
        assert asked(_process(intake, raw)).uncacheable == reason
    assert asked(_process(intake, _body("What is this?", cat, temperature=0.7, seed=3))).cacheable
    assert asked(_process(intake, _body("What is this?", cat, temperature=0.7)), any_sampling=True).cacheable
    unsampled = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert asked(_process(intake, unsampled)).uncacheable == "sampling"  # no temperature: the model's default


def test_the_embedder_gives_what_sentence_transformers_gives(embedder):
    """Cosines sentence-transformers 6.2 gave for these pairs with the same weights (its embeddings and these
    differed by 1.5e-8 at most, measured once side by side; it is not installed here, see the embedder's module)."""
    pairs = {("What is shown in this picture?", "What is shown in this image?"): 0.955360,
             ("Do both halves of this picture look the same?", "Do both halves of this picture look different?"):
                 0.982776,
             ("What animal is this?", "Which animal is this?"): 0.966114}
    for (a, b), cosine in pairs.items():
        vectors = embedder.encode([a, b])
        assert abs(float(vectors[0] @ vectors[1]) - cosine) < 1e-4, (a, b)
        assert abs(float((vectors * vectors).sum(axis=1).max()) - 1.0) < 1e-5  # unit length
    assert embedder.dimensions == 384


# --- the guard ---


@pytest.mark.parametrize("question, cached, reason", [
    ("What does field K show?", "What is the value of field K?", None),
    ("Which value is shown in the K field?", "Read me the value of field K.", None),
    ("Are K and L equal?", "Do fields K and L hold the same value?", None),
    ("What colour is the car?", "Which hue does the car have?", None),
    ("What is the value of field M?", "What is the value of field K?", ENTITY),
    ("Do K and L hold different values?", "Do K and L hold the same value?", CONTRAST),
    ("Are K and L not the same?", "Are K and L the same?", NEGATION),
    ("Isn't it red?", "Is it red?", NEGATION),
    ("What does K show in the second panel?", "What does K show in the first panel?", NUMBER),
    ("What is in image 2?", "What is in image 1?", NUMBER),
    ("Is it in Paris?", "Is it in London?", ENTITY),
    ('Does it say "open"?', 'Does it say "close"?', ENTITY),
    ("Where is field K?", "What is field K?", ASKING),
    ("What kind of value does field K hold?", "What value does field K hold?", ASPECT),
])
def test_the_guard(question, cached, reason):
    assert veto(question, cached) == reason
    assert veto(cached, question) == reason


# --- the cache ---


def test_levels_escalate_and_stop_at_what_the_request_allows(intake, embedder):
    cat = _url(small("chelsea.png", (112, 112)))
    first = _process(intake, _body("What animal is this?", cat))
    match = MatchSettings()
    matcher = Matcher(match, scope=scope("m", intake._config.processor, extractor_for(match)), features=None)
    for image in first.images:
        matcher.add(image.key, "ns", image.features)
    cache = ResponseCache(ON, embedder=embedder, matcher=matcher)
    paraphrase = _process(intake, _body("Which animal is this?", cat))
    jpeg = _process(intake, _body("Which animal is this?", _url(small("chelsea.png", (112, 112)), "JPEG", quality=95)))
    theirs = _process(intake, _body("What animal is this?", cat), namespace="theirs")

    async def run() -> None:
        assert (await cache.lookup(asked(first), "similar", first.images)).header() == "miss"
        await cache.remember(asked(first), _answer("a cat"))
        found = await cache.lookup(asked(first), "exact")
        assert found.header() == "exact" and found.entry is not None
        assert found.entry.answer.completion("chatcmpl-x")["usage"]["prompt_tokens_details"] == {"cached_tokens": 30}

        assert (await cache.lookup(asked(paraphrase), "exact")).header() == "miss"
        found = await cache.lookup(asked(paraphrase), "paraphrase")
        assert found.header().startswith("paraphrase;similarity=0.9")

        assert (await cache.lookup(asked(jpeg), "paraphrase", jpeg.images)).header() == "miss"
        found = await cache.lookup(asked(jpeg), "similar", jpeg.images)
        assert found.level == "similar" and found.image_similarity is not None and found.image_similarity > 0.95
        # Another tenant never sees it, at any level.
        assert (await cache.lookup(asked(theirs), "similar", theirs.images)).entry is None

    asyncio.run(run())
    stats = cache.stats()
    assert stats["levels"]["exact"]["hits"] == 1 and stats["levels"]["paraphrase"]["hits"] == 1
    assert stats["levels"]["similar"]["hits"] == 1 and stats["entries"] == 1


def test_a_changed_picture_is_not_similar(intake, embedder):
    """One swatch redrawn in a colour of nearly the same grey level (orange to pink): a near-duplicate for KV reuse,
    but the response cache's similar level needs every token unchanged, colour included."""
    base = Image.new("RGB", (112, 112), (240, 240, 240))
    base.paste((245, 130, 20), (28, 28, 56, 56))
    edited = base.copy()
    edited.paste((245, 120, 190), (28, 28, 56, 56))
    first = _process(intake, _body("What colour is the square?", _url(base)))
    match = MatchSettings()
    matcher = Matcher(match, scope="s", features=None)
    matcher.add(first.images[0].key, "ns", first.images[0].features)
    cache = ResponseCache(ON, embedder=embedder, matcher=matcher)
    again = _process(intake, _body("What colour is the square?", _url(edited)))
    lookup = matcher.lookup("ns", again.images[0].key, again.images[0].features)
    assert lookup.matches and lookup.matches[0].alignment.count(CHANGED) == 1  # found; the swatch is changed

    async def run() -> None:
        await cache.remember(asked(first), _answer("orange"))
        assert (await cache.lookup(asked(again), "similar", again.images)).entry is None

    asyncio.run(run())


def test_bounds_expiry_replacement_and_flush(intake, embedder):
    now = [0.0]
    settings = ResponseCacheSettings(namespaces=("*",), ttl_s=10, max_bytes=64 * 1024, bucket_size=3)
    cache = ResponseCache(settings, embedder=embedder, clock=lambda: now[0])
    cat = _url(small("chelsea.png", (56, 56)))
    requests = [asked(_process(intake, _body(f"Question number {i}?", cat))) for i in range(5)]

    async def run() -> None:
        for request in requests:
            await cache.remember(request, _answer("x"))
        assert len(cache) == 3  # one context holds the newest three questions
        assert (await cache.lookup(requests[0], "exact")).entry is None
        assert (await cache.lookup(requests[4], "exact")).entry is not None
        await cache.remember(requests[4], _answer("y"))  # the same request again: replaced
        assert len(cache) == 3 and cache.events["replaced"] == 1
        assert (await cache.lookup(requests[4], "exact")).entry.answer.message["content"] == "y"
        big = Answer(model="m", message={"role": "assistant", "content": "z" * 300_000, "refusal": None},
                     finish_reason="stop", usage=None)
        assert await cache.remember(requests[1], big) is None and cache.events["too_large"] == 1
        now[0] = 11.0
        assert (await cache.lookup(requests[4], "exact")).entry is None and cache.events["expired"] == 1

    asyncio.run(run())
    assert cache.flush("nobody") == 0 and cache.flush() == 2 and len(cache) == 0 and cache.bytes == 0


def test_false_hit_reports_drop_the_entry(intake, embedder):
    cache = ResponseCache(ON, embedder=embedder)
    request = asked(_process(intake, _body("What is this?", _url(small("coffee.png", (56, 56))))))

    async def run() -> None:
        await cache.remember(request, _answer("a cup"))
        found = await cache.lookup(request, "exact")
        cache.served("chatcmpl-1", found)
        assert cache.report_false_hit("chatcmpl-1") == {"level": "exact", "removed": True}
        assert cache.report_false_hit("chatcmpl-1") is None
        assert (await cache.lookup(request, "exact")).entry is None

    asyncio.run(run())
    assert cache.stats()["levels"]["exact"]["false_hits"] == 1


def test_streams_are_recorded_only_when_they_end_well():
    answer = _answer("two words")

    async def replayed(include_usage: bool) -> list[bytes]:
        return [item async for item in replay_stream(answer, "chatcmpl-r", include_usage=include_usage)]

    stream = asyncio.run(replayed(True))
    chunks = [orjson.loads(item[6:]) for item in stream[:-1]]
    assert stream[-1] == b"data: [DONE]\n\n" and {c["id"] for c in chunks} == {"chatcmpl-r"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "two words"
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 30} and chunks[-1]["choices"] == []
    for chunk in chunks:  # exactly OpenAI's shapes, as the worker's relayed chunks are
        assert_valid(chunk, "CreateChatCompletionStreamResponse")
    assert_valid(answer.completion("chatcmpl-c"), "CreateChatCompletionResponse")
    assert all("usage" not in orjson.loads(i[6:]) for i in asyncio.run(replayed(False))[:-1])

    kept: list[Answer] = []

    async def keep(got: Answer) -> None:
        kept.append(got)

    async def source(items):
        for item in items:
            yield item

    async def relay(items) -> list[bytes]:
        return [item async for item in recorded(source(items), keep)]

    assert asyncio.run(relay(stream)) == stream  # passed through unchanged
    assert kept[0].message["content"] == "two words" and kept[0].finish_reason == "stop"
    assert kept[0].usage == chunks[-1]["usage"]
    error = b'data: {"error": {"message": "the worker failed mid-stream"}}\n\n'
    asyncio.run(relay([*stream[:2], error, b"data: [DONE]\n\n"]))
    cut = asyncio.run(relay(stream[:2]))  # no finish reason, no [DONE]
    assert len(kept) == 1 and len(cut) == 2
    recorder = StreamRecorder()
    recorder.read(b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "t"}]}}]}')
    assert recorder.answer() is None


def test_settings():
    settings = ResponseCacheSettings.from_env({"REVISIT_RESPONSE_CACHE_NAMESPACES": "a,b",
                                               "REVISIT_RESPONSE_CACHE_MAX_LEVEL": "paraphrase"})
    assert settings.level_for("a", "similar") == "paraphrase" and settings.level_for("a", None) == "off"
    assert settings.level_for("c", "exact") == "off" and settings.level_for("b", "exact") == "exact"
    assert not ResponseCacheSettings().enabled
    for bad in ({"REVISIT_RESPONSE_CACHE_DEFAULT_LEVEL": "most"}, {"REVISIT_RESPONSE_CACHE_PARAPHRASE_THRESHOLD": "2"},
                {"REVISIT_RESPONSE_CACHE_TTL_S": "0"}, {"REVISIT_RESPONSE_CACHE_COLOUR": "1"}):
        with pytest.raises(ConfigError):
            ResponseCacheSettings.from_env(bad)
    with pytest.raises(ConfigError, match="config.json"):
        TextEmbedder(Path("/nonexistent"))


def test_the_defaults_serve_no_wrong_answer_on_the_oracles_questions():
    """The acceptance measure, on a smaller draw than the bench's (30 groups, about 450 probes; the bench's seeds
    0 to 2 gave none either): every hit at the default settings answers as the oracle itself does."""
    sys.path.insert(0, str(ROOT))
    from bench.response_cache import OracleAnswers, evaluate, make_groups, prepare

    groups = make_groups(30, seed=5)
    prepared = asyncio.run(prepare(groups, OracleAnswers()))
    embedder = TextEmbedder()
    embedder.start().result()
    try:
        tally = asyncio.run(evaluate(prepared, ON, embedder))
    finally:
        embedder.close()
    assert prepared.truth_agreement > 0.95  # the oracle reads the panels
    assert tally.hits["exact"] == len(groups)  # every repeat
    assert tally.hits["paraphrase"] > 0 and tally.hits["similar"] > 0
    assert sum(tally.wrong.values()) == 0, tally.as_dict()


def test_nothing_waits_for_the_embedder_to_load(intake, embedder):
    """While the embedder loads, lookups go as far as the exact level, and answers kept then get their embedding
    once it is ready."""
    loading = TextEmbedder(embedder.path)
    cache = ResponseCache(ON, embedder=loading)
    request = asked(_process(intake, _body("What animal is this?", _url(small("chelsea.png", (56, 56))))))
    paraphrase = asked(_process(intake, _body("Which animal is this?", _url(small("chelsea.png", (56, 56))))))

    async def run() -> None:
        assert loading.state == "idle"
        entry = await cache.remember(request, _answer("a cup"))
        assert entry is not None and entry.embedding is None
        assert (await cache.lookup(paraphrase, "paraphrase")).entry is None  # did not wait
        await asyncio.wrap_future(loading.start())
        for _ in range(200):
            if entry.embedding is not None:
                break
            await asyncio.sleep(0.05)
        assert entry.embedding is not None and loading.state == "ready"
        assert (await cache.lookup(paraphrase, "paraphrase")).level == "paraphrase"

    try:
        asyncio.run(run())
    finally:
        loading.close()
