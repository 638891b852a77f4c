"""The gateway's HTTP routes: the OpenAI API, the admin API with /metrics, and /health."""
