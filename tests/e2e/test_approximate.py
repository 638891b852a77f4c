"""Approximate matching through the gateway, with the real openai client and real SGLang CPU workers: a
near-duplicate of a stored image is planned as approximate and executed so by the workers (alias K/V reused,
what it computed stored as a derived entry, which its next sight hits exactly), another tenant's near-duplicate
is not, and a restarted gateway (a real ``revisit gateway`` process over the same store) still finds the alias."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid

import httpx
import openai
import pytest
from PIL import Image, ImageDraw

from tests.conftest import MODEL_ID, STORE_ENV, free_port, start_gateway_process, worker_events
from tests.e2e.test_reuse import executed, wait_stored
from tests.images_lib import load, png_data_url
from tests.waiting import wait_until

pytestmark = pytest.mark.sglang

CELL = 28


def page(seed: int) -> Image.Image:
    """A text page of 8 x 12 tokens (scikit-image's page.png) with one line of text that depends on seed."""
    image = load("page.png").convert("RGB").resize((12 * CELL, 8 * CELL), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    draw.rectangle((2 * CELL, 5 * CELL + 2, 6 * CELL, 5 * CELL + 24), fill=(255, 255, 255))
    draw.text((2 * CELL + 2, 5 * CELL + 6), f"total: {seed * 7919 % 10000:04d}", fill=(0, 0, 0))
    return image


def ask(base_url: str, api_key: str, image: Image.Image, mode: str | None = None):
    with openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=300) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_ID, max_tokens=4, temperature=0,
            extra_headers={"x-revisit-reuse-mode": mode} if mode else None,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                                   {"type": "text", "text": "What is the total?"}]}])
        return raw.headers, raw.parse()


def plans_metric(base_url: str, kind: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=30).text):
        if family.name == "revisit_plans":
            return sum(s.value for s in family.samples if s.labels.get("kind") == kind)
    return 0.0


def test_a_near_duplicate_is_approximate_for_its_tenant_only(gateway) -> None:
    me, them = (f"sk-{uuid.uuid4().hex}" for _ in range(2))
    headers, _ = ask(gateway.url, me, page(1))
    assert headers["x-revisit-reuse"] == "miss"
    first_key = headers["x-revisit-image-keys"]
    wait_stored(gateway, first_key)

    approximate_before = plans_metric(gateway.url, "approximate")
    before = worker_events(gateway.config.workers)
    headers, reply = ask(gateway.url, me, page(2))  # the same page with one number changed
    kind, _, similarity = headers["x-revisit-reuse"].partition(";similarity=")
    assert kind == "approximate" and 0.9 <= float(similarity) < 1.0
    assert reply.choices[0].message.content is not None and reply.id.startswith("chatcmpl-")
    done = executed(gateway, before, approximate_executed=1, derived_stored=1)
    # The worker encoded only the changed tokens and their margin (the default partial vision pass; the alias'
    # encoder output elsewhere), ran the warmup, reused the alias' K/V for B, and stored what it computed as a
    # derived entry (not what a full prefill computes, and marked so), never as a miss's entry.
    assert (done["approximate_executed"], done["approximate_fallback"], done["vision_images"]) == (1, 0, 0)
    assert done["vision_partial_images"] == 1 and 0 < done["vision_partial_tokens"] < 96
    assert done["approximate_rows_reused"] > 0 and done["approximate_rows_recomputed"] > 0
    assert (done["stored"], done["derived_stored"]) == (0, 1)
    assert done["kept_out_of_prefix_cache"] == 1  # and its K/V out of SGLang's prefix cache
    assert plans_metric(gateway.url, "approximate") == approximate_before + 1
    assert gateway.app.state.services.policy.get(first_key).approximate_hits == 1
    # Its next sight is an exact hit on the derived entry, answering as the approximate hit did: executed from the
    # store (SGLang's prefix cache holds no K/V of the approximate hit), and kept out of that cache in turn.
    derived_before = plans_metric(gateway.url, "derived_hit")
    before = worker_events(gateway.config.workers)
    headers, again = ask(gateway.url, me, page(2))
    assert headers["x-revisit-reuse"] == "exact_same_prefix;derived"
    assert again.choices[0].message.content == reply.choices[0].message.content
    assert plans_metric(gateway.url, "derived_hit") == derived_before + 1
    done = executed(gateway, before, exact_executed=1)
    assert (done["exact_executed"], done["exact_served_by_prefix_cache"], done["kept_out_of_prefix_cache"]) == \
        (1, 0, 1)

    headers, _ = ask(gateway.url, them, page(3))
    assert headers["x-revisit-reuse"] == "miss"  # their near-duplicate of my page: never my cache


def test_a_restarted_gateway_still_finds_the_alias(gateway, model_path, tmp_path) -> None:
    tenant = f"sk-{uuid.uuid4().hex}"
    port = free_port()
    env = {**STORE_ENV, "REVISIT_MODEL": MODEL_ID, "REVISIT_MODEL_DIR": str(model_path),
           "REVISIT_WORKERS": ",".join(gateway.config.workers), "REVISIT_HEALTH_INTERVAL_S": "0.5",
           "REVISIT_ADMIN_TOKEN": "admin-token-for-tests", "REVISIT_PLAN_BY_COST": "0",
           "REVISIT_CALIBRATE": "0"}
    url = f"http://127.0.0.1:{port}"

    logs = []

    def start() -> subprocess.Popen:
        logs.append(tmp_path / f"gateway-{len(logs)}.log")
        return start_gateway_process(env, port, log_file=logs[-1])

    process = start()
    try:
        headers, _ = ask(url, tenant, page(10))
        assert headers["x-revisit-reuse"] == "miss"
        alias = headers["x-revisit-image-keys"]
        wait_stored(gateway, alias)
    finally:
        stop(process)
    assert "Application shutdown complete" in logs[0].read_text()
    process = start()
    try:
        # the index is restored in the background after start
        wait_until(lambda: "match index rebuilt" in logs[1].read_text(), "the match index to be rebuilt")
        headers, _ = ask(url, tenant, page(11))
        assert headers["x-revisit-reuse"].startswith("approximate;similarity=")
        assert plans_metric(url, "approximate") == 1
        stats = httpx.get(url + "/admin/stats", headers={"Authorization": "Bearer admin-token-for-tests"},
                          timeout=30).json()
        assert stats["plans"]["approximate"] == 1 and stats["plans"]["miss"] == 0
    finally:
        stop(process)
    rebuilt = [line for line in logs[1].read_text().splitlines() if "match index rebuilt" in line]
    assert rebuilt and int(rebuilt[0].split("store: ")[1].split()[0]) >= 1


def stop(process: subprocess.Popen) -> None:
    """SIGTERM: uvicorn shuts the app down (closing the store), then re-raises the signal, so the process ends
    with it."""
    process.terminate()
    assert process.wait(timeout=30) in (0, -signal.SIGTERM)


def test_a_request_may_ask_for_less_reuse(gateway) -> None:
    """x-revisit-reuse-mode: ``exact`` plans a near-duplicate as a miss, ``off`` plans nothing at all (plain
    SGLang: nothing reused, stored or counted), and the answers stay plain SGLang's."""
    me = f"sk-{uuid.uuid4().hex}"
    headers, _ = ask(gateway.url, me, page(11))
    first_key = headers["x-revisit-image-keys"]
    wait_stored(gateway, first_key)
    headers, _ = ask(gateway.url, me, page(12), mode="exact")
    assert headers["x-revisit-reuse"] == "miss"
    wait_stored(gateway, headers["x-revisit-image-keys"])

    before = {kind: plans_metric(gateway.url, kind) for kind in ("miss", "exact_same_prefix")}
    events = worker_events(gateway.config.workers)
    headers, off = ask(gateway.url, me, page(11), mode="off")  # stored, and not reused
    assert "x-revisit-reuse" not in headers and headers["x-revisit-image-keys"] == first_key
    headers, _ = ask(gateway.url, me, page(13), mode="off")  # new, and not stored
    assert "x-revisit-reuse" not in headers
    assert {kind: plans_metric(gateway.url, kind) for kind in before} == before
    # Nothing stored: a negative, so a window for a late write to show rather than a wait for something to happen.
    time.sleep(1.0)
    assert worker_events(gateway.config.workers)["stored"] == events["stored"]
    headers, again = ask(gateway.url, me, page(11))
    # planned exact; SGLang's prefix cache may hold it whole from the plain request (";prefix_cached")
    assert headers["x-revisit-reuse"].split(";")[0] == "exact_same_prefix"
    assert off.choices[0].message.content == again.choices[0].message.content
    assert ask(gateway.url, me, page(13))[0]["x-revisit-reuse"].split(";")[0] in ("miss", "approximate")  # not exact
    with pytest.raises(openai.BadRequestError) as info:
        ask(gateway.url, me, page(11), mode="some")
    assert info.value.body["code"] == "invalid_reuse_mode"
