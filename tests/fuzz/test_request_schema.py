"""Malformed and odd chat and text-completion requests through the real gateway and workers: every one gets a 4xx
or a 200, never a 5xx or a hang, and the gateway stays healthy. Hypothesis builds the bodies from the schemas'
fields, with wrong types, missing and unknown fields, odd content parts and extreme numbers; raw bodies that are
not JSON at all are tried too."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.images_lib import data_url, encode, small

pytestmark = pytest.mark.sglang

IMAGE = data_url(encode(small("chelsea.png", (56, 56))))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.text(max_size=20))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                    max_leaves=12)
URLS = st.one_of(st.just(IMAGE), st.just("data:image/png;base64,AAAA"), st.just("data:text/plain;base64,aGk="),
                 st.just("http://127.0.0.1:1/x.png"), st.just("file:///etc/passwd"), st.text(max_size=30))
PARTS = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=40), JSON)}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.one_of(st.fixed_dictionaries({"url": URLS}), JSON)}),
    st.fixed_dictionaries({"type": st.one_of(st.text(max_size=12), JSON)}),
    JSON,
)
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "developer"]), JSON)},
    optional={"content": st.one_of(st.text(max_size=40), st.lists(PARTS, max_size=3), JSON),
              "name": JSON}), max_size=3)
KNOWN = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.just("revisit-tiny"), JSON),
    "messages": st.one_of(MESSAGES, JSON),
    "max_tokens": st.one_of(st.integers(-5, 3), JSON),
    "max_completion_tokens": st.one_of(st.integers(-5, 3), JSON),
    "temperature": st.one_of(st.floats(-5, 5, allow_nan=False), JSON),
    "top_p": st.one_of(st.floats(-1, 2, allow_nan=False), JSON),
    "n": st.one_of(st.integers(-2, 2), JSON),
    "stream": st.one_of(st.booleans(), JSON),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=5), JSON),
    "logprobs": st.one_of(st.booleans(), JSON),
    "top_logprobs": st.one_of(st.integers(-2, 25), JSON),
    "seed": st.one_of(st.integers(-2**64, 2**64), JSON),
    "stream_options": JSON,
    "response_format": JSON,
    "tools": JSON,
})
BODIES = st.builds(lambda known, unknown: {**unknown, **known}, KNOWN,  # plus fields the schema does not have
                   st.dictionaries(st.text(min_size=1, max_size=12), JSON, max_size=2))
TEXT_KNOWN = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.just("revisit-tiny"), JSON),
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3),
                        st.lists(st.integers(-5, 200_000), max_size=5), st.lists(st.lists(st.integers(0, 100),
                                                                                            max_size=3), max_size=2),
                        JSON),
    "max_tokens": st.one_of(st.integers(-5, 3), JSON),
    "temperature": st.one_of(st.floats(-5, 5, allow_nan=False), JSON),
    "n": st.one_of(st.integers(-2, 2), JSON),
    "stream": st.one_of(st.booleans(), JSON),
    "echo": st.one_of(st.booleans(), JSON),
    "logprobs": st.one_of(st.integers(-2, 8), JSON),
    "stop": st.one_of(st.text(max_size=5), JSON),
    "suffix": JSON,
})
TEXT_BODIES = st.builds(lambda known, unknown: {**unknown, **known}, TEXT_KNOWN,
                        st.dictionaries(st.text(min_size=1, max_size=12), JSON, max_size=2))
RAW = st.one_of(st.binary(max_size=200), st.just(b"{"), st.just(b"[" * 5000 + b"]" * 5000),
                st.just(b'{"messages": "' + b"a" * 10000), st.just(b"\xff\xfe{}"))


def small_enough(body: dict) -> dict:
    """Budgets a valid request could take a long time to spend are kept at a few tokens and choices."""
    for field, most in (("max_tokens", 3), ("max_completion_tokens", 3), ("n", 2)):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > most:
            body[field] = most
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 3
    return body


def answered(gateway, content: bytes, path: str = "/v1/chat/completions") -> int:
    with httpx.Client(timeout=120) as client:
        response = client.post(gateway.url + path, content=content,
                               headers={"Content-Type": "application/json"})
        status = response.status_code
        assert status < 500, (status, content[:300], response.text[:300])
        if status == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
            assert "[DONE]" in response.text or '"error"' in response.text
        elif status != 200:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    return status


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(body=BODIES)
def test_every_chat_body_is_a_client_error_or_served(gateway, body) -> None:
    answered(gateway, json.dumps(small_enough(body)).encode())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(body=TEXT_BODIES)
def test_every_completions_body_is_a_client_error_or_served(gateway, body) -> None:
    answered(gateway, json.dumps(small_enough(body)).encode(), "/v1/completions")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=RAW)
def test_every_raw_body_is_a_client_error(gateway, raw) -> None:
    assert 400 <= answered(gateway, raw) < 500


def test_the_gateway_is_healthy_after_the_fuzzing(gateway) -> None:
    assert httpx.get(gateway.url + "/health").status_code == 200
    body = {"model": "revisit-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
    assert httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
