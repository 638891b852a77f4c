"""The gateway: an asyncio FastAPI app in front of unmodified SGLang workers, which plans KV reuse per image.

In the order a request meets them:

- :mod:`gateway.routes`: ``openai_api`` (/v1/chat/completions, /v1/models), ``admin`` (/admin, /metrics),
  ``health``.
- :mod:`gateway.json_body`, :mod:`gateway.protocol`, :mod:`gateway.intake`: parse a body's JSON within bounds,
  validate it as a chat request, resolve its images.
- :mod:`gateway.image_fetch`, :mod:`gateway.images`, :mod:`gateway.image_memo`: fetch (data: and http(s) URLs,
  with caps), canonicalise, key and grid each image; remember repeat uploads.
- :mod:`gateway.tenancy`: the caller's cache namespace from its API key.
- :mod:`gateway.planner`: one reuse plan per image (:mod:`plan`), from the store.
- :mod:`gateway.cache`, :mod:`gateway.policy`: the cache policy's books and the thread that applies its decisions
  to the store (:mod:`store`).
- :mod:`gateway.workers`, :mod:`gateway.dispatch`, :mod:`gateway.openai_shape`: the worker pool, sending and
  relaying, OpenAI-shaped answers.
- :mod:`gateway.offload`, :mod:`gateway.loop_lag`: keeping work off the event loop, and measuring that it is.
- :mod:`gateway.metrics`, :mod:`gateway.errors`: Prometheus figures; the one exception tree and its error bodies.
- :mod:`gateway.config`, :mod:`gateway.services`, :mod:`gateway.app`: settings, the objects an app holds, the app.
- :mod:`gateway.cli`, :mod:`gateway.embedded`: ``revisit gateway`` and ``revisit serve`` (the gateway plus local
  workers, the one place that reaches into :mod:`launcher` and :mod:`bundled`).

It never imports the engine extension: plans travel to workers as :class:`plan.RequestPlan` in SGLang's request
id, image KV through the store.
"""
