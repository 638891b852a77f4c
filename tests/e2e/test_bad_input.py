"""Client mistakes: each gets a 4xx with an OpenAI error body, and the gateway stays healthy."""

from __future__ import annotations

import httpx
import pytest
from PIL import Image

from tests.conftest import gateway_config, run_gateway
from tests.images_lib import data_url, encode, small
from tests.openai_schema import assert_valid

pytestmark = pytest.mark.sglang

TINY_PNG = data_url(encode(small("astronaut.png", (56, 56))))


def chat_body(model: str, *parts: dict, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": list(parts)}],
            "max_completion_tokens": 2, **extra}


def image_part(url) -> dict:
    return {"type": "image_url", "image_url": url if not isinstance(url, str) else {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def huge_png() -> str:
    # 8000 x 6000 = 48 M pixels in a few KB of PNG: over the default 40 M pixel cap
    return data_url(encode(Image.new("1", (8000, 6000))))


CASES = {
    "bare-string image_url": (
        lambda m: chat_body(m, {"type": "image_url", "image_url": TINY_PNG}, text_part("hi")), 400, "image_url"),
    "corrupt base64": (
        lambda m: chat_body(m, image_part("data:image/png;base64,iVBORw0KGgo%%%%"), text_part("hi")), 400, "base64"),
    "non-image bytes": (
        lambda m: chat_body(m, image_part(data_url(b"GIF89 not really an image at all", "image/gif"))), 422,
        "not a recognised image"),
    "image over the pixel cap": (lambda m: chat_body(m, image_part(huge_png())), 413, "pixels"),
    "private-address URL": (
        lambda m: chat_body(m, image_part("http://169.254.169.254/latest/meta-data/x.png")), 400, "non-public"),
    "loopback URL": (lambda m: chat_body(m, image_part("http://127.0.0.1:1/x.png")), 400, "non-public"),
    "unknown model": (lambda m: chat_body("no-such-model", text_part("hi")), 404, "does not exist"),
    "too many images": (lambda m: chat_body(m, *[image_part(TINY_PNG)] * 17), 400, "at most 16"),
    "missing messages": (lambda m: {"model": m}, 400, "messages"),
    "empty messages": (lambda m: {"model": m, "messages": []}, 400, "messages"),
    "bad role": (lambda m: {"model": m, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    "unsupported part type": (
        lambda m: chat_body(m, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}), 400,
        "not supported"),
    "image in a system message": (
        lambda m: {"model": m, "messages": [{"role": "system", "content": [image_part(TINY_PNG)]}]}, 400,
        "only allowed in user"),
    "negative max_tokens": (lambda m: chat_body(m, text_part("hi"), max_tokens=-1), 400, "max_tokens"),
    "temperature out of range": (lambda m: chat_body(m, text_part("hi"), temperature=7), 400, "temperature"),
    "stream_options without stream": (
        lambda m: chat_body(m, text_part("hi"), stream_options={"include_usage": True}), 400, "stream_options"),
    "ftp URL": (lambda m: chat_body(m, image_part("ftp://example.com/a.png")), 400, "data: URL or an http"),
}


def assert_healthy(gateway) -> None:
    assert httpx.get(gateway.url + "/health").status_code == 200
    ok = httpx.post(gateway.url + "/v1/chat/completions", timeout=120,
                    json=chat_body(gateway.config.model, image_part(TINY_PNG), text_part("hi")))
    assert ok.status_code == 200, ok.text


def assert_error(response: httpx.Response, status: int, fragment: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert_valid(body, "ErrorResponse")
    assert fragment.lower() in body["error"]["message"].lower(), body
    assert body["error"]["type"]


@pytest.mark.parametrize("case", list(CASES))
def test_client_mistake_is_a_4xx_with_an_openai_error_body(gateway, case):
    build, status, fragment = CASES[case]
    response = httpx.post(gateway.url + "/v1/chat/completions", json=build(gateway.config.model), timeout=60)
    assert_error(response, status, fragment)


@pytest.mark.parametrize("payload", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_json(gateway, payload):
    response = httpx.post(gateway.url + "/v1/chat/completions", content=payload,
                          headers={"content-type": "application/json"})
    assert_error(response, 400, "json")


def test_unknown_route_and_method(gateway):
    assert_error(httpx.get(gateway.url + "/v1/nothing"), 404, "not found")
    response = httpx.get(gateway.url + "/v1/chat/completions")
    assert response.status_code == 405 and "error" in response.json()


def test_openai_client_raises_typed_errors(client, gateway):
    import openai

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=gateway.config.model,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "data:x"}]}],
        )
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(
            model=gateway.config.model,
            messages=[{"role": "user", "content": [image_part(data_url(b"hello world"))]}],
        )


def test_request_body_cap(gateway, model_path, workers):
    small_gateway = run_gateway(gateway_config(model_path, [w.url for w in workers], max_request_bytes=10_000))
    try:
        body = chat_body(small_gateway.config.model, image_part(data_url(b"\0" * 20_000)))
        assert_error(httpx.post(small_gateway.url + "/v1/chat/completions", json=body), 413, "exceeds")
    finally:
        small_gateway.stop()


def test_gateway_is_healthy_after_the_bad_requests(gateway):
    assert_healthy(gateway)
