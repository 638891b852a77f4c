"""Images by http(s) URL: fetched by the gateway under its limits, keyed like the same pixels inline."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import ImageLimits
from tests.conftest import gateway_config, run_gateway
from tests.http_server import serve
from tests.images_lib import data_url, encode, small

pytestmark = pytest.mark.sglang

PICTURE = small("coins.png", (112, 84))
PNG = encode(PICTURE)


def chat(url: str, image: str) -> httpx.Response:
    body = {"model": "revisit-tiny", "max_completion_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": "What is this?"}]}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def permissive_gateway(workers, model_path):
    """Loopback image hosts are allowed here, as an operator would for an internal image store."""
    server = run_gateway(gateway_config(model_path, [w.url for w in workers],
                                        images=ImageLimits(allow_private_urls=True)))
    try:
        yield server
    finally:
        server.stop()


def test_http_image_is_fetched_and_keyed_like_the_inline_one(permissive_gateway):
    with serve({"/coins.png": (200, {"Content-Type": "image/png"}, PNG)}) as host:
        by_url = chat(permissive_gateway.url, host + "/coins.png")
    inline = chat(permissive_gateway.url, data_url(PNG))
    assert by_url.status_code == 200, by_url.text
    assert by_url.headers["x-revisit-image-keys"] == inline.headers["x-revisit-image-keys"]
    assert by_url.json()["usage"]["prompt_tokens"] == inline.json()["usage"]["prompt_tokens"]


def test_missing_remote_image_is_a_client_error(permissive_gateway):
    with serve({}) as host:
        response = chat(permissive_gateway.url, host + "/gone.png")
    assert response.status_code == 400
    assert "HTTP 404" in response.json()["error"]["message"]


def test_tenants_get_different_keys_for_the_same_image(gateway):
    keys = []
    for api_key in ("sk-tenant-a", "sk-tenant-b", "sk-tenant-a"):
        body = {"model": gateway.config.model, "max_completion_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}]}]}
        response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {api_key}"})
        assert response.status_code == 200
        keys.append(response.headers["x-revisit-image-keys"])
    assert keys[0] != keys[1] and keys[0] == keys[2]
