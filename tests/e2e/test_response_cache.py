"""The response cache through the gateway, with the official openai client and real SGLang workers: exact,
paraphrase and similar hits, streamed and not, the guard's veto, tenant isolation, multi-turn safety, the header,
and the admin API (stats, false-hit reports, flush) and /metrics.

A hit runs no model: the workers' served counts stay as they were. Answers are the tiny model's (random weights,
greedy): what matters here is that a hit returns exactly the answer the first request got.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ResponseCacheSettings
from store import StoreConfig
from tests.conftest import gateway_config, remove_store_memory, run_gateway
from tests.images_lib import data_url, encode, small
from tests.openai_schema import assert_valid

pytestmark = pytest.mark.sglang

TOKEN = "response-cache-admin"
HEADER = "x-revisit-response-cache"
QUESTION = "What is shown in this picture?"
PARAPHRASE = "What is shown in this image?"  # cosine 0.955 to QUESTION
# Cosines of 0.98 with all-MiniLM-L6-v2: above any threshold, and the opposite question.
SAME_HALVES = "Do both halves of this picture look the same?"
NEGATED = "Do both halves of this picture not look the same?"
CONTRARY = "Do both halves of this picture look different?"


@pytest.fixture(scope="module")
def cached_gateway(workers, model_path, tmp_path_factory):
    """A gateway with the response cache on in every namespace (requests still opt in by the header), over the
    session's workers. Its store is its own (an LMDB environment opens once per process, and the session's gateway
    may hold the shared one): the similar level needs the match index, which lives beside a store. The workers
    keep writing entries to the shared store, so KV reuse plans only misses here; the response cache is the same."""
    dram = Path(tempfile.mkdtemp(prefix="revisit-responses-", dir="/dev/shm"))
    store = StoreConfig(dram_dir=dram, lmdb_dir=tmp_path_factory.mktemp("responses-lmdb"))
    server = run_gateway(gateway_config(model_path, [w.url for w in workers], store=store, admin_token=TOKEN,
                                        responses=ResponseCacheSettings(namespaces=("*",))))
    try:
        deadline = time.monotonic() + 120
        while _admin(server, "GET", "/admin/stats").json()["response_cache"]["embedder"] != "ready":
            assert time.monotonic() < deadline, "the sentence embedder did not load"
            time.sleep(0.2)  # until then, lookups skip the paraphrase and similar levels
        yield server
    finally:
        server.stop()
        remove_store_memory(store)


def _client(gateway, key: str = "sk-responses") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=300)


def _served(gateway) -> int:
    return sum(w.served for w in gateway.app.state.services.pool.workers)


def _wait_served(gateway, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _served(gateway) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _served(gateway) == count


def _messages(image_url: str, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                         {"type": "text", "text": text}]}]


def _ask(client: openai.OpenAI, gateway, messages: list[dict], level: str | None = "similar", **extra):
    headers = {HEADER: level} if level is not None else {}
    raw = client.chat.completions.with_raw_response.create(
        model=gateway.config.model, messages=messages, max_tokens=8, temperature=0, extra_headers=headers, **extra)
    return raw.headers.get(HEADER), raw.parse(), raw.http_response.json()


def _ask_streamed(client: openai.OpenAI, gateway, messages: list[dict], level: str = "similar"):
    raw = client.chat.completions.with_raw_response.create(
        model=gateway.config.model, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={HEADER: level})
    chunks = list(raw.parse())
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    return raw.headers.get(HEADER), content, finish, usage, {c.id for c in chunks}


def _admin(gateway, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, gateway.url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30,
                         **kwargs)


@pytest.fixture(scope="module")
def astronaut_url() -> str:
    return data_url(encode(small("astronaut.png", (112, 112))))


def test_exact_and_paraphrase_hits_return_the_first_answer_without_the_model(cached_gateway, astronaut_url):
    client = _client(cached_gateway)
    header, first, _ = _ask(client, cached_gateway, _messages(astronaut_url, QUESTION))
    assert header == "miss"
    served = _served(cached_gateway)

    header, again, body = _ask(client, cached_gateway, _messages(astronaut_url, "  What is shown in this  picture?"))
    assert header == "exact"  # white space is normalised
    assert_valid(body, "CreateChatCompletionResponse")
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.choices[0].finish_reason == first.choices[0].finish_reason
    assert again.id != first.id and again.id.startswith("chatcmpl-")
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens

    header, paraphrased, _ = _ask(client, cached_gateway, _messages(astronaut_url, PARAPHRASE))
    assert header.startswith("paraphrase;similarity=0.") and float(header.split("=")[1]) >= 0.9
    assert paraphrased.choices[0].message.content == first.choices[0].message.content
    assert _served(cached_gateway) == served  # no worker ran either

    # Negated, or asking the contrary: the embeddings are close, the guard vetoes the hit, and the model answers.
    assert _ask(client, cached_gateway, _messages(astronaut_url, SAME_HALVES))[0] == "miss"
    header, _, _ = _ask(client, cached_gateway, _messages(astronaut_url, NEGATED))
    assert header == "miss;veto=negation"
    header, _, _ = _ask(client, cached_gateway, _messages(astronaut_url, CONTRARY))
    assert header == "miss;veto=contrast"
    assert _served(cached_gateway) == served + 3


def test_streams_are_replayed_and_recorded(cached_gateway):
    client = _client(cached_gateway)
    image = data_url(encode(small("coffee.png", (112, 84))))
    messages = _messages(image, "Describe the cup.")
    served = _served(cached_gateway) + 1
    header, content, finish, usage, ids = _ask_streamed(client, cached_gateway, messages)
    assert header == "miss" and finish and len(usage) == 1
    _wait_served(cached_gateway, served)  # a worker's stream is counted once its relay has ended

    # The streamed miss was recorded: the same question, not streamed, is an exact hit with the same answer.
    header, completion, _ = _ask(client, cached_gateway, messages)
    assert header == "exact" and completion.choices[0].message.content == content
    assert completion.choices[0].finish_reason == finish[0]

    # And a streamed hit is replayed as a stream: one id, the content, the finish reason, the usage.
    header, replayed, replayed_finish, replayed_usage, replayed_ids = _ask_streamed(client, cached_gateway, messages)
    assert header == "exact" and replayed == content and replayed_finish == finish
    assert len(replayed_ids) == 1 and replayed_ids != ids
    assert replayed_usage[0].prompt_tokens == usage[0].prompt_tokens
    assert replayed_usage[0].completion_tokens == usage[0].completion_tokens
    assert _served(cached_gateway) == served


def test_a_re_encoded_image_is_a_similar_hit(cached_gateway):
    """The same picture uploaded again as a JPEG: another exact key, a near-duplicate with no token changed."""
    client = _client(cached_gateway)
    picture = small("chelsea.png", (112, 112))
    header, first, _ = _ask(client, cached_gateway, _messages(data_url(encode(picture)), "What animal is this?"))
    assert header == "miss"
    served = _served(cached_gateway)
    jpeg = data_url(encode(picture, "JPEG", quality=95), "image/jpeg")
    header, again, _ = _ask(client, cached_gateway, _messages(jpeg, "Which animal is this?"))  # cosine 0.966
    assert header.startswith("similar;similarity=") and "image_similarity=0.9" in header
    assert again.choices[0].message.content == first.choices[0].message.content
    assert _served(cached_gateway) == served
    # Asked only up to paraphrase, the same request runs on the model.
    header, _, _ = _ask(client, cached_gateway, _messages(jpeg, "Which animal is this?"), level="paraphrase")
    assert header == "miss" and _served(cached_gateway) == served + 1


def test_no_tenant_reads_another_tenants_answers(cached_gateway, astronaut_url):
    mine, theirs = _client(cached_gateway, "sk-tenant-a"), _client(cached_gateway, "sk-tenant-b")
    messages = _messages(astronaut_url, "Is there a person here?")
    assert _ask(mine, cached_gateway, messages)[0] == "miss"
    assert _ask(mine, cached_gateway, messages)[0] == "exact"
    assert _ask(theirs, cached_gateway, messages)[0] == "miss"  # the same bytes, the same question: another tenant
    assert _ask(theirs, cached_gateway, messages)[0] == "exact"  # ... which now has its own answer


def test_only_what_the_request_allows(cached_gateway, astronaut_url):
    client = _client(cached_gateway)
    messages = _messages(astronaut_url, QUESTION)
    assert _ask(client, cached_gateway, messages)[0] in ("miss", "exact")  # cached by the first test or now
    header, _, _ = _ask(client, cached_gateway, messages, level=None)  # no header: this gateway's default is off
    assert header is None
    assert _ask(client, cached_gateway, messages, level="off")[0] is None
    served = _served(cached_gateway)
    # Sampled answers are neither served nor kept.
    raw = client.chat.completions.with_raw_response.create(
        model=cached_gateway.config.model, messages=messages, max_tokens=4, temperature=0.7,
        extra_headers={HEADER: "exact"})
    assert raw.headers[HEADER] == "skipped;reason=sampling" and _served(cached_gateway) == served + 1
    # A seed makes sampling repeatable: cached.
    seeded = dict(max_tokens=4, temperature=0.7, seed=7)
    raw = client.chat.completions.with_raw_response.create(model=cached_gateway.config.model, messages=messages,
                                                           extra_headers={HEADER: "exact"}, **seeded)
    assert raw.headers[HEADER] == "miss"
    raw = client.chat.completions.with_raw_response.create(model=cached_gateway.config.model, messages=messages,
                                                           extra_headers={HEADER: "exact"}, **seeded)
    assert raw.headers[HEADER] == "exact"
    # A different max_tokens can change the answer: another exact key.
    assert _ask(client, cached_gateway, messages, max_completion_tokens=3)[0] == "miss"
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(client, cached_gateway, messages, level="sometimes")
    assert refused.value.code == "invalid_response_cache_level"


def test_an_answer_is_never_served_after_another_conversation(cached_gateway, astronaut_url):
    client = _client(cached_gateway)

    def conversation(earlier_answer: str) -> list[dict]:
        return [*_messages(astronaut_url, "Look at this."), {"role": "assistant", "content": earlier_answer},
                {"role": "user", "content": "And what colour is it?"}]

    assert _ask(client, cached_gateway, conversation("A rocket."))[0] == "miss"
    assert _ask(client, cached_gateway, conversation("A rocket."))[0] == "exact"
    assert _ask(client, cached_gateway, conversation("A suit."))[0] == "miss"  # the same question, another history


def test_a_gateway_without_it_says_so(gateway, astronaut_url):
    client = _client(gateway)
    header, _, _ = _ask(client, gateway, _messages(astronaut_url, QUESTION), level="exact")
    assert header == "skipped;reason=not_enabled"
    assert httpx.get(gateway.url + "/health").status_code == 200


def test_admin_counts_reports_and_flushes(cached_gateway):
    client = _client(cached_gateway, "sk-admin-checks")
    messages = _messages(data_url(encode(small("rocket.jpg", (84, 112)))), "Where is this going?")
    assert _ask(client, cached_gateway, messages)[0] == "miss"
    before = _admin(cached_gateway, "GET", "/admin/stats").json()["response_cache"]
    header, hit, _ = _ask(client, cached_gateway, messages)
    assert header == "exact"
    stats = _admin(cached_gateway, "GET", "/admin/stats").json()["response_cache"]
    assert stats["enabled"] and stats["entries"] >= 1 and stats["bytes"] > 0
    assert stats["levels"]["exact"]["hits"] == before["levels"]["exact"]["hits"] + 1
    assert stats["levels"]["paraphrase"]["misses"] >= 1
    # A sampled request is counted as skipped, under its reason.
    raw = client.chat.completions.with_raw_response.create(
        model=cached_gateway.config.model, messages=messages, max_tokens=4, temperature=0.7,
        extra_headers={HEADER: "exact"})
    assert raw.headers[HEADER] == "skipped;reason=sampling"
    skipped = _admin(cached_gateway, "GET", "/admin/stats").json()["response_cache"]["skipped"]
    assert skipped["sampling"] == before["skipped"].get("sampling", 0) + 1

    # The client says the hit was wrong: counted under its level, and the answer is dropped.
    reported = _admin(cached_gateway, "POST", "/admin/response-cache/false-hits", json={"id": hit.id})
    assert reported.status_code == 200 and reported.json() == {"object": "response_cache.false_hit", "id": hit.id,
                                                               "level": "exact", "removed": True}
    assert _admin(cached_gateway, "POST", "/admin/response-cache/false-hits",
                  json={"id": hit.id}).json()["error"]["code"] == "unknown_response"
    assert _admin(cached_gateway, "POST", "/admin/response-cache/false-hits", json=["x"]).status_code == 400
    assert _admin(cached_gateway, "GET", "/admin/stats").json()["response_cache"]["levels"]["exact"][
        "false_hits"] == before["levels"]["exact"]["false_hits"] + 1
    assert _ask(client, cached_gateway, messages)[0] == "miss"

    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(
        httpx.get(cached_gateway.url + "/metrics").text) for s in f.samples}
    assert metrics[("revisit_response_cache_false_hits_total", (("level", "exact"),))] >= 1
    assert metrics[("revisit_response_cache_lookups_total", (("level", "exact"), ("result", "hit")))] >= 1
    assert metrics[("revisit_response_cache_entries", ())] >= 1
    assert ("revisit_request_duration_seconds_count", (("endpoint", "/v1/chat/completions"),
                                                       ("reuse", "response_cache"))) in metrics

    flushed = _admin(cached_gateway, "DELETE", "/admin/response-cache").json()
    assert flushed["removed"] >= 1 and flushed["remaining"] == 0
    assert _ask(client, cached_gateway, messages)[0] == "miss"
    assert _admin(cached_gateway, "DELETE", "/admin/response-cache", params={"namespace": "nobody"}).json()[
        "removed"] == 0
