"""The admin REST API and /metrics against a real gateway server (no SGLang worker needed)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig, PolicySettings, TenantSettings
from gateway.policy import PresetPriors, Region, Tier
from tests.conftest import GatewayServer, run_gateway

TOKEN = "admin-token-for-tests"
DOWN_WORKER = "http://127.0.0.1:9"  # nothing listens: the gateway starts, /health says 503
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def key(i: int) -> str:
    return f"{i:064x}"


def config(**overrides) -> GatewayConfig:
    settings = {
        "model": "revisit-tiny",
        "workers": (DOWN_WORKER,),
        "health_interval_s": 30.0,
        "policy": PolicySettings(dram_capacity_bytes=100, lmdb_capacity_bytes=1000, preset_fraction=0.2),
        "tenants": TenantSettings.open(),
        **overrides,
    }
    return GatewayConfig(**settings)


@pytest.fixture(scope="module")
def server() -> Iterator[GatewayServer]:
    running = run_gateway(config(admin_token=TOKEN))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def policy(server):
    """The live policy, emptied before each test (counters keep growing across tests)."""
    live = server.app.state.services.policy
    live.flush(force=True)
    live.set_priors(PresetPriors())
    return live


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=10) as client:
        yield client


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


ADMIN_ROUTES = [
    ("GET", "/admin/stats"),
    ("GET", "/admin/entries"),
    ("GET", f"/admin/entries/{key(1)}"),
    ("DELETE", f"/admin/entries/{key(1)}"),
    ("POST", f"/admin/entries/{key(1)}/pin"),
    ("DELETE", f"/admin/entries/{key(1)}/pin"),
    ("GET", "/admin/presets"),
    ("POST", "/admin/presets"),
    ("GET", "/admin/recent"),
    ("GET", "/admin/history"),
    ("POST", "/admin/flush"),
]


@pytest.mark.parametrize("method,path", ADMIN_ROUTES)
@pytest.mark.parametrize(
    "headers,code",
    [({}, "missing_token"), ({"Authorization": "Bearer wrong-token"}, "invalid_token"),
     ({"Authorization": TOKEN}, "missing_token")],
)
def test_admin_routes_need_the_token(server, method, path, headers, code):
    response = httpx.request(method, server.url + path, headers=headers, content=b"{")
    assert_error(response, 401, code)


def test_auth_is_checked_before_parameters(server):
    response = httpx.get(server.url + "/admin/entries?limit=0")
    assert_error(response, 401)


def test_admin_api_is_disabled_without_a_token():
    running = run_gateway(config())
    try:
        for method, path in ADMIN_ROUTES:
            response = httpx.request(method, running.url + path, headers=AUTH)
            error = assert_error(response, 403, "admin_disabled")
            assert "REVISIT_ADMIN_TOKEN" in error["message"]
        assert httpx.get(running.url + "/metrics").status_code == 200
        assert httpx.get(running.url + "/health").status_code == 503
    finally:
        running.stop()


def test_metrics_can_require_the_token():
    running = run_gateway(config(admin_token=TOKEN, metrics_require_token=True))
    try:
        assert_error(httpx.get(running.url + "/metrics"), 401)
        assert httpx.get(running.url + "/metrics", headers=AUTH).status_code == 200
    finally:
        running.stop()


def test_stats_report_the_policy(http, policy):
    policy.insert(key(1), 10)
    policy.record_exact_hit(key(1))
    policy.record_approximate_hit(key(1))
    body = http.get("/admin/stats").json()
    assert body["object"] == "cache.stats"
    assert body["tiers"]["dram"]["entries"] == 1 and body["tiers"]["dram"]["bytes"] == 10
    assert body["tiers"]["dram"]["capacity_bytes"] == 100 and body["preset"]["capacity_bytes"] == 20
    assert body["hits"]["exact"]["dram"] >= 1 and body["hits"]["approximate"]["dram"] >= 1
    assert set(body["decisions"]) == {"admit", "reject", "promote", "demote", "reserve", "evict"}


def test_entries_page_by_cursor(http, policy):
    for i in range(1, 8):
        policy.insert(key(i), 10)
    seen, cursor = [], None
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = http.get("/admin/entries", params=params).json()
        seen += [entry["key"] for entry in page["data"]]
        if not page["has_more"]:
            assert page["next_cursor"] is None
            break
        cursor = page["next_cursor"]
    assert seen == [key(i) for i in range(1, 8)]
    entry = http.get("/admin/entries", params={"limit": 1}).json()["data"][0]
    assert entry["object"] == "cache.entry" and entry["tier"] == "dram" and entry["size_bytes"] == 10


def test_entries_filter_by_tier(http, policy):
    for i in range(1, 10):  # main DRAM holds 8 x 10 bytes; the first one falls to LMDB
        policy.insert(key(i), 10)
    l3 = http.get("/admin/entries", params={"tier": "lmdb"}).json()["data"]
    assert [entry["key"] for entry in l3] == [key(1)]


@pytest.mark.parametrize(
    "params,param",
    [({"limit": 0}, "query.limit"), ({"limit": 1001}, "query.limit"), ({"tier": "l1"}, "query.tier"),
     ({"cursor": "nope"}, "key")],
)
def test_entries_refuse_bad_parameters(http, policy, params, param):
    error = assert_error(http.get("/admin/entries", params=params), 400)
    assert error["param"] == param


def test_get_one_entry(http, policy):
    policy.insert(key(1), 10, family="docs")
    body = http.get(f"/admin/entries/{key(1)}").json()
    assert body["key"] == key(1) and body["family"] == "docs" and body["region"] == "main"
    assert_error(http.get(f"/admin/entries/{key(2)}"), 404, "entry_not_found")
    assert_error(http.get("/admin/entries/XYZ"), 400)


def test_delete_entry(http, policy):
    policy.insert(key(1), 10)
    body = http.delete(f"/admin/entries/{key(1)}").json()
    assert body["deleted"] and body["decisions"] == [
        {"kind": "evict", "key": key(1), "tier": "dram", "reason": "removed"}
    ]
    assert key(1) not in policy
    assert_error(http.delete(f"/admin/entries/{key(1)}"), 404, "entry_not_found")
    assert_error(http.delete("/admin/entries/short"), 400)


def test_pinned_entries_need_force_to_delete(http, policy):
    policy.insert(key(1), 10)
    pinned = http.post(f"/admin/entries/{key(1)}/pin").json()
    assert pinned["pinned"] is True
    assert_error(http.delete(f"/admin/entries/{key(1)}"), 409, "entry_pinned")
    assert http.delete(f"/admin/entries/{key(1)}", params={"force": "true"}).status_code == 200
    assert key(1) not in policy


def test_pin_and_unpin(http, policy):
    policy.insert(key(1), 10)
    assert http.post(f"/admin/entries/{key(1)}/pin").json()["pinned"] is True
    assert policy.get(key(1)).pinned
    assert http.delete(f"/admin/entries/{key(1)}/pin").json()["pinned"] is False
    assert not policy.get(key(1)).pinned
    assert_error(http.post(f"/admin/entries/{key(9)}/pin"), 404, "entry_not_found")
    assert_error(http.delete(f"/admin/entries/{key(9)}/pin"), 404, "entry_not_found")


def test_presets_round_trip_and_drive_the_reserved_share(http, policy):
    assert http.get("/admin/presets").json()["keys"] == {}
    body = http.post("/admin/presets", json={"keys": {key(1): 2.0}, "families": {"docs": 1.5}}).json()
    assert body["keys"] == {key(1): 2.0} and body["families"] == {"docs": 1.5}
    assert http.get("/admin/presets").json()["families"] == {"docs": 1.5}
    policy.insert(key(1), 10)
    for i in range(100, 120):
        policy.insert(key(i), 10)
    entry = policy.get(key(1))
    assert (entry.tier, entry.region) == (Tier.DRAM, Region.PRESET)
    assert http.get("/admin/presets").json()["preset"]["entries"] == 1
    assert http.get(f"/admin/entries/{key(1)}").json()["preset_score"] == 2.0


@pytest.mark.parametrize(
    "payload,param",
    [
        (b"not json", None),
        (b"[1, 2]", None),
        (b'{"weights": {}}', "weights"),
        (b'{"keys": [1]}', "keys"),
        (b'{"keys": {"abc": 1}}', "keys"),
        (b'{"families": {"docs": -1}}', "families.docs"),
        (b'{"families": {"docs": NaN}}', "families.docs"),
    ],
)
def test_presets_refuse_bad_input(http, policy, payload, param):
    policy.set_priors(PresetPriors(families={"kept": 1.0}))
    response = http.post("/admin/presets", content=payload, headers={"content-type": "application/json"})
    assert assert_error(response, 400)["param"] == param
    assert policy.priors.families == {"kept": 1.0}


def test_flush(http, policy):
    for i in range(1, 4):
        policy.insert(key(i), 10)
    policy.pin(key(3))
    body = http.post("/admin/flush").json()
    assert (body["evicted"], body["evicted_bytes"], body["remaining"]) == (2, 20, 1)
    assert http.post("/admin/flush", params={"force": "true"}).json()["remaining"] == 0


def _samples(text: str) -> dict[tuple, float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_match_admin_stats(http, policy, server):
    policy.set_priors(PresetPriors(families={"docs": 3.0}))
    policy.insert(key(1), 10, family="docs")
    for i in range(100, 120):
        policy.insert(key(i), 10)
        policy.record_approximate_hit(key(i))
    policy.record_exact_hit(key(100))
    policy.pin(key(119))
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    samples = _samples(metrics.text)
    stats = http.get("/admin/stats").json()
    for tier, usage in stats["tiers"].items():
        for field, value in usage.items():
            assert samples[(f"revisit_cache_{field}", (("tier", tier),))] == value
    for field in ("entries", "bytes", "capacity_bytes"):
        assert samples[(f"revisit_cache_preset_{field}", ())] == stats["preset"][field]
    for hit_type, by_tier in stats["hits"].items():
        for tier, count in by_tier.items():
            assert samples[("revisit_cache_hits_total", (("tier", tier), ("type", hit_type)))] == count
    for kind, count in stats["decisions"].items():
        assert samples[("revisit_cache_decisions_total", (("kind", kind),))] == count
    for tier, by_reason in stats["evictions"].items():
        for reason, count in by_reason.items():
            assert samples[("revisit_cache_evictions_total", (("reason", reason), ("tier", tier)))] == count
    assert samples[("revisit_cache_protections_used_total", ())] == stats["protections_used"]
    assert stats["preset"]["entries"] == 1 and stats["tiers"]["dram"]["pinned_entries"] == 1


def test_stats_and_metrics_count_plans_and_the_match_index(http, server):
    planner = server.app.state.services.planner
    planner.counts.update({"approximate": 3})
    planner.refused.update({"similarity": 2, "changed_share": 1})
    stats = http.get("/admin/stats").json()
    assert {"miss", "exact_same_prefix", "exact_moved", "approximate", "admitted"} <= set(stats["plans"])
    assert stats["plans"]["approximate"] >= 3
    assert stats["refused"]["similarity"] >= 2 and stats["refused"]["changed_share"] >= 1
    assert set(stats["refused"]) == {"similarity", "changed_share", "notes", "cost", "alias_gone"}
    assert stats["matching"] == {"enabled": False, "indexed": 0, "damaged_records": 0}  # this gateway has no store
    assert stats["books"] == {"shared": False} and stats["plans"]["store_unavailable"] == 0
    samples = _samples(httpx.get(server.url + "/metrics").text)
    for kind, count in stats["plans"].items():
        assert samples[("revisit_plans_total", (("kind", kind),))] == count
    for reason, count in stats["refused"].items():
        assert samples[("revisit_plan_refusals_total", (("reason", reason),))] == count
    assert samples[("revisit_match_index_entries", ())] == 0


def test_two_apps_in_one_process_keep_their_own_metrics(server, policy):
    other = run_gateway(config(admin_token=TOKEN))
    try:
        other.app.state.services.policy.insert(key(5), 10)
        mine = _samples(httpx.get(server.url + "/metrics").text)
        theirs = _samples(httpx.get(other.url + "/metrics").text)
        assert theirs[("revisit_cache_entries", (("tier", "dram"),))] == 1
        assert mine[("revisit_cache_entries", (("tier", "dram"),))] == 0
    finally:
        other.stop()


def test_metric_names_follow_prometheus_conventions(server):
    """Prometheus' naming rules (https://prometheus.io/docs/practices/naming/): one prefix, snake case, counters
    ending in _total, base units (seconds, bytes) named as suffixes, no unit on a ratio or a count."""
    httpx.get(server.url + "/v1/models")  # a request, so the request families have samples
    families = list(text_string_to_metric_families(httpx.get(server.url + "/metrics").text))
    assert {f.name for f in families} >= {"revisit_requests", "revisit_request_duration_seconds",
                                          "revisit_time_to_first_token_seconds", "revisit_reuse_fallbacks",
                                          "revisit_cache_entries", "revisit_plans"}
    for family in families:
        assert re.fullmatch(r"revisit_[a-z0-9_]+", family.name), family.name
        assert not re.search(r"(milliseconds|_ms|kilobytes|_kb|_mb|percent)(_|$)", family.name), family.name
        if family.type == "counter":
            assert all(s.name in (family.name + "_total", family.name + "_created") for s in family.samples)
        if family.type == "histogram":
            assert family.name.endswith(("_seconds", "_bytes")), family.name


def test_recent_lists_the_last_requests_that_ran_the_model_newest_first(server, http):
    httpx.post(server.url + "/v1/completions", json={"model": "revisit-tiny", "prompt": "hi"}, timeout=30)
    httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=30)
    httpx.get(server.url + "/v1/models", timeout=30)  # runs no model: not listed
    newest, older = http.get("/admin/recent", params={"limit": 2}).json()["data"]
    assert (newest["endpoint"], newest["code"]) == ("/v1/chat/completions", 400)
    assert (older["endpoint"], older["code"]) == ("/v1/completions", 503)  # no worker is up
    assert newest["at"] >= older["at"] and newest["duration_s"] >= 0 and newest["ttft_s"] is None
    assert_error(http.get("/admin/recent", params={"limit": 0}), 400)


def test_history_counts_this_minute_s_requests_that_ran_the_model(server, http):
    before = http.get("/admin/history").json()["minutes"][-1]
    httpx.post(server.url + "/v1/completions", json={"model": "revisit-tiny", "prompt": "hi"}, timeout=30)
    httpx.get(server.url + "/v1/models", timeout=30)  # runs no model: not counted
    history = http.get("/admin/history").json()
    assert history["object"] == "history" and len(history["minutes"]) == 60
    now = history["minutes"][-1]
    if now["at"] == before["at"]:  # (else the minute turned between the two reads: the new one has only this)
        now = {**now, "requests": now["requests"] - before["requests"], "failed": now["failed"] - before["failed"]}
    assert (now["requests"], now["failed"]) == (1, 1)  # no worker is up: a 503
    assert now["hit_rate"] is None and now["ttft_ms"] == {}
    assert [m["at"] for m in history["minutes"]] == list(range(now["at"] - 59 * 60, now["at"] + 1, 60))


def test_every_metric_the_grafana_dashboard_charts_is_one_the_gateway_exports(server) -> None:
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parents[2] / "dashboards/grafana/revisit.json").read_text())
    def family(name: str) -> str:
        return re.sub(r"_(total|bucket|sum|count)$", "", name)

    charted = {family(name) for panel in dashboard["panels"] for target in panel.get("targets", ())
               for name in re.findall(r"revisit_[a-z0-9_]+", target["expr"])}
    exported = {family(name) for name in re.findall(r"^# TYPE (revisit_[a-z0-9_]+) ",
                                                      httpx.get(server.url + "/metrics").text, re.M)}
    assert "revisit_plan_refusals" in charted and charted <= exported, sorted(charted - exported)
