"""Reuse through the gateway: plans chosen from the store, executed by the real workers, isolated per tenant."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import httpx
import pytest

from gateway.images import token_grid
from gateway.tenancy import cache_scope
from plan import PUBLIC_PLAN_KEY, RID_PREFIX, ImagePlan, RequestPlan
from tests.conftest import worker_events
from tests.images_lib import data_url, encode, small
from tests.waiting import wait_until

pytestmark = pytest.mark.sglang

QUESTION = "What is in this image?"


@pytest.fixture(scope="module")
def picture() -> str:
    return data_url(encode(small("chelsea.png", (196, 196))))


def ask(gateway, preamble: str, picture: str, *, key: str = "sk-tenant-a", tokens: int = 12,
        extra: dict | None = None) -> httpx.Response:
    body = {"model": "revisit-tiny", "max_tokens": tokens, "temperature": 0, **(extra or {}),
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": preamble}, {"type": "image_url", "image_url": {"url": picture}},
                {"type": "text", "text": QUESTION}]}]}
    response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response


def wait_stored(gateway, key: str) -> None:
    store = gateway.app.state.services.cache.store  # LMDB allows one open environment per process: the gateway's
    wait_until(lambda: store.contains(key), f"the worker to store {key[:16]}")


def executed(gateway, before: Counter, **expected: int) -> Counter:
    """The workers' execution events since before; waits (bounded) for the expected counts, as a miss's entry is
    written after its answer."""
    deadline = time.monotonic() + 60
    while True:
        delta = worker_events(gateway.config.workers)
        delta.subtract(before)
        if all(delta[event] >= count for event, count in expected.items()) or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def flush_worker_prefix_caches(gateway, api_key: str | None = None) -> None:
    """Empty SGLang's radix caches, so a hit is served by this project's reuse rather than SGLang's own (``api_key``:
    workers that take only the key the deployment secret derives)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for url in gateway.config.workers:
        deadline = time.monotonic() + 30
        # SGLang refuses (400) while a request is still being finished; the previous answer may just have left
        while (status := httpx.post(url + "/flush_cache", headers=headers, timeout=30).status_code) == 400:
            assert time.monotonic() < deadline, "the worker never became idle"
            time.sleep(0.2)
        assert status == 200


def miss_then_exact_hit(gateway, picture: str, grid_tokens: int) -> tuple[str, httpx.Response, httpx.Response]:
    """The picture asked about twice: a miss, stored; then, with the workers' prefix caches emptied, an exact
    same-prefix hit that reuses every image row and answers as the miss did. Returns (key, first, again)."""
    before = worker_events(gateway.config.workers)
    first = ask(gateway, "Look:", picture)
    key = first.headers["x-revisit-image-keys"]
    assert first.headers["x-revisit-reuse"] == "miss"
    wait_stored(gateway, key)
    done = executed(gateway, before, miss=1, stored=1)
    assert (done["miss"], done["stored"], done["vision_images"], done["exact_executed"]) == (1, 1, 1, 0)

    flush_worker_prefix_caches(gateway)
    before = worker_events(gateway.config.workers)
    again = ask(gateway, "Look:", picture)
    assert again.headers["x-revisit-reuse"] == "exact_same_prefix"
    assert first.headers["x-revisit-store-tokens"] == "0"
    assert again.headers["x-revisit-store-tokens"] == str(grid_tokens)  # every image token read from the store
    assert again.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    done = executed(gateway, before, exact_executed=1)
    assert (done["exact_executed"], done["exact_fallback"], done["vision_images"], done["miss"]) == (1, 0, 0, 0)
    assert done["exact_rows_reused"] == grid_tokens  # every image row
    assert done["kept_out_of_prefix_cache"] == 0  # what a full prefill computes: SGLang may keep it
    return key, first, again


def cached_tokens(response: httpx.Response) -> int:
    """The prompt tokens SGLang's prefix cache served."""
    return (response.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_a_repeated_image_is_reused_exactly_then_position_independently(gateway, picture) -> None:
    grid_tokens = token_grid(196, 196, gateway.config.processor).tokens
    key, first, again = miss_then_exact_hit(gateway, picture, grid_tokens)

    preamble = f"Before that, a much longer preamble came along ({uuid.uuid4().hex}). Look:"
    before, per_worker = worker_events(gateway.config.workers), {url: worker_events([url])
                                                                  for url in gateway.config.workers}
    moved = ask(gateway, preamble, picture)
    assert moved.headers["x-revisit-reuse"] == "exact_moved"
    assert moved.json()["choices"][0]["message"]["content"]
    # The text before the image matches what the tenant's earlier requests left in SGLang's prefix cache (the
    # chat template's opening at least): a plan costs no prefix.
    assert cached_tokens(moved) > 0
    done = executed(gateway, before, exact_executed=1)
    assert (done["exact_executed"], done["exact_fallback"], done["vision_images"]) == (1, 0, 0)
    assert done["kept_out_of_prefix_cache"] == 1
    served = [url for url, seen in per_worker.items()
              if worker_events([url])["exact_executed"] > seen["exact_executed"]]
    assert len(served) == 1

    # The moved K/V are not what a full prefill computes: the worker kept them out of its prefix cache, so the same
    # prompt again, on the same worker, is executed again rather than served them; the text before the image went
    # in (computed as a full prefill computes it), and serves the second one.
    before, on_it = worker_events(gateway.config.workers), worker_events(served)
    twice = ask(gateway, preamble, picture)
    assert twice.headers["x-revisit-reuse"] == "exact_moved"
    done = executed(gateway, before, exact_executed=1)
    assert worker_events(served)["exact_executed"] == on_it["exact_executed"] + 1, "the gateway chose the other worker"
    assert done["exact_served_by_prefix_cache"] == 0
    usage = twice.json()["usage"]
    assert cached_tokens(moved) < cached_tokens(twice) <= usage["prompt_tokens"] - grid_tokens, usage

    entry = gateway.app.state.services.policy.get(key)
    assert entry.exact_hits == 3 and entry.size_bytes == gateway.app.state.services.cache.store.size_of(key)
    for response in (first, again, moved):
        assert response.json()["id"].startswith("chatcmpl-") and RID_PREFIX not in response.text


def test_an_image_larger_than_the_model_keeps_reaches_the_worker_at_its_size_and_is_reused_exactly(gateway) -> None:
    width, height = 1200, 1000  # 1.2 Mpx, more than the bundled model keeps: the gateway resizes it
    assert width * height > gateway.config.processor.max_pixels
    picture = data_url(encode(small("chelsea.png", (width, height))))
    # The worker's grid is the gateway's (it gets the pixels at the model's size): every row of it reused.
    miss_then_exact_hit(gateway, picture, token_grid(height, width, gateway.config.processor).tokens)


def test_tenants_never_share_cached_images_or_prefixes(gateway) -> None:
    picture = data_url(encode(small("ihc.png", (168, 168))))
    me, them = (f"sk-{uuid.uuid4().hex}" for _ in range(2))  # tenants no other test has used
    mine = ask(gateway, "Look:", picture, key=me)
    wait_stored(gateway, mine.headers["x-revisit-image-keys"])
    repeat = ask(gateway, "Look:", picture, key=me)
    theirs = ask(gateway, "Look:", picture, key=them)
    assert theirs.headers["x-revisit-image-keys"] != mine.headers["x-revisit-image-keys"]
    assert theirs.headers["x-revisit-reuse"] == "miss"
    # SGLang's own prefix cache is scoped per tenant too: the same prompt from another tenant reuses nothing.
    cached = [r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in (repeat, theirs)]
    assert cached[0] > 0 and cached[1] == 0
    # My repeat was planned exact, and sent to the worker that computed the miss, whose prefix cache held the whole
    # image: nothing read from the store, and the headers say so (not counted as the store's tokens).
    assert cached[0] >= repeat.json()["usage"]["prompt_tokens"] - 1
    assert repeat.headers["x-revisit-reuse"] == "exact_same_prefix;prefix_cached"
    assert repeat.headers["x-revisit-store-tokens"] == "0"


def test_a_client_cannot_smuggle_a_plan_or_a_cache_scope(gateway, picture) -> None:
    victim = ask(gateway, "Look:", picture, key="sk-tenant-a")
    victim_key = victim.headers["x-revisit-image-keys"]
    wait_stored(gateway, victim_key)
    assert victim_key in gateway.app.state.services.policy  # the victim's entry is in the books
    forged = RequestPlan(images=(ImagePlan(key=victim_key, kind="exact", tokens=49, grid=(7, 7)),))
    for field, value in (("rid", forged.to_rid("forged", key=PUBLIC_PLAN_KEY)),
                         ("extra_key", cache_scope("default", b""))):
        body = {"model": "revisit-tiny", "max_tokens": 4, field: value, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": QUESTION}]}]}
        refused = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=300,
                             headers={"Authorization": "Bearer sk-tenant-c"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    attacker = ask(gateway, "Look:", picture, key="sk-tenant-c")
    assert attacker.headers["x-revisit-reuse"] == "miss"
    assert attacker.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0


def test_streamed_answers_carry_the_public_id(gateway, picture) -> None:
    body = {"model": "revisit-tiny", "max_tokens": 4, "temperature": 0, "stream": True, "n": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                                      {"type": "text", "text": QUESTION}]}]}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=300) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert lines and RID_PREFIX not in "".join(lines)
    ids = {line.split('"id":"', 1)[1].split('"', 1)[0] for line in lines}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")


def test_a_damaged_entry_is_served_as_a_miss_and_the_response_says_so(gateway) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from store.entry import parse_header

    def fallbacks() -> float:
        text = httpx.get(gateway.url + "/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "revisit_reuse_fallbacks_total" and s.labels == {
                       "planned": "exact_same_prefix", "cause": "entry_damaged", "ran": "full_prefill"})

    image = data_url(encode(small("rocket.jpg", (168, 168))))
    first = ask(gateway, "Look:", image, key="sk-tenant-damage")
    key = first.headers["x-revisit-image-keys"]
    wait_stored(gateway, key)
    entry_file = gateway.config.reuse.store.dram_path / f"{key}.kv"
    data = bytearray(entry_file.read_bytes())
    data[parse_header(memoryview(data)).header.encoder_range.start + 5] ^= 0xFF  # the encoder output: the header
    entry_file.write_bytes(bytes(data))  # still reads, so the gateway plans an exact hit the worker cannot run
    flush_worker_prefix_caches(gateway)
    before, counted = worker_events(gateway.config.workers), fallbacks()
    again = ask(gateway, "Look:", image, key="sk-tenant-damage")
    assert again.headers["x-revisit-reuse"] == "miss;planned=exact_same_prefix;fallback=entry_damaged"
    assert again.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert fallbacks() == counted + 1
    done = executed(gateway, before, exact_fallback=1)
    assert done["exact_fallback"] == 1 and done["fallback:exact:entry_damaged"] == 1
    assert done["encoder_from_store"] == 0 and done["exact_executed"] == 0  # nothing of the damaged entry used
