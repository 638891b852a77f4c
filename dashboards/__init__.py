"""The operator's views: a page the gateway serves at /dashboard, and a Grafana dashboard for its metrics.

- ``operator.html``: one static page, no build step. It reads the admin API live (``/admin/stats``,
  ``/admin/presets``, ``/admin/recent``) with the admin token, which the operator types in or passes once as
  ``/dashboard#token=...`` (kept for the tab, taken out of the address bar), and ``/health`` for the workers. The
  page itself holds no figures: without the token the admin API refuses it, and it says so.
- ``grafana/revisit.json``: a Grafana dashboard over the gateway's Prometheus metrics (``/metrics``);
  tests/dashboards checks that every metric it names is one the gateway exports.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

GRAFANA_DASHBOARD = Path(__file__).with_name("grafana") / "revisit.json"


def operator_page() -> bytes:
    return resources.files(__name__).joinpath("operator.html").read_bytes()
