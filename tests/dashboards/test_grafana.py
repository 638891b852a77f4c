"""The Grafana dashboard parses, and every metric it names is one the gateway exports, of the right type."""

from __future__ import annotations

import json
import re

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dashboards import GRAFANA_DASHBOARD
from gateway.app import create_app
from gateway.config import GatewayConfig

SUFFIXES = {"_total": ("counter",), "_bucket": ("histogram",), "_sum": ("histogram",), "_count": ("histogram",)}


def exported() -> dict[str, str]:
    """Metric family -> type, as the gateway's /metrics declares them."""
    app = create_app(GatewayConfig(model="m", workers=("http://127.0.0.1:9",)))
    with TestClient(app) as client:
        text = client.get("/metrics").text
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def test_every_metric_the_dashboard_names_is_exported():
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    families = exported()
    named = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            named |= set(re.findall(r"\brevisit_[a-z0-9_]+", target["expr"]))
    assert len(named) >= 10
    for name in sorted(named):
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        family = name.removesuffix(suffix) if suffix else name
        assert family in families, f"{name}: the gateway exports no {family}"
        expected = SUFFIXES[suffix] if suffix else ("gauge",)
        assert families[family] in expected, f"{name}: {family} is a {families[family]}"
