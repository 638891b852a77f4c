"""x-revisit-selector: a request may choose the selector only where the operator allows it."""

from __future__ import annotations

import httpx

from gateway.config import GatewayConfig, MatchSettings, ReuseSettings, TenantSettings
from tests.conftest import run_gateway

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def post(url: str, selector: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=BODY, headers={"x-revisit-selector": selector}, timeout=10)


def gateway(allow: bool):
    reuse = ReuseSettings(enabled=False, match=MatchSettings(allow_selector_header=allow))
    return run_gateway(GatewayConfig(model="m", workers=("http://127.0.0.1:9",), health_interval_s=30.0, reuse=reuse,
                                     tenants=TenantSettings.open()))


def test_the_header_is_refused_unless_allowed() -> None:
    server = gateway(allow=False)
    try:
        response = post(server.url, "cacheblend")
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "selector_not_allowed" and error["param"] == "x-revisit-selector"
        assert "REVISIT_MATCH_ALLOW_SELECTOR_HEADER" in error["message"]
        assert httpx.post(server.url + "/v1/chat/completions", json=BODY, timeout=10).status_code == 503  # no worker
    finally:
        server.stop()


def test_an_allowed_header_must_name_a_selector() -> None:
    server = gateway(allow=True)
    try:
        response = post(server.url, "magic")
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_selector"
        assert post(server.url, "vlcache").status_code == 503  # accepted; then no worker is healthy
    finally:
        server.stop()
