"""The operator's views: a page served by the gateway and Grafana JSON for its Prometheus metrics."""
