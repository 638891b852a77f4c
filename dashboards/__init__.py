"""The operator's views (to come): a page served by the gateway and Grafana JSON for its Prometheus metrics.

Empty for now; the metrics themselves are served at ``/metrics`` (gateway/metrics.py).
"""
