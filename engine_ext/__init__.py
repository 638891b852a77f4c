"""The engine extension: what runs inside each unmodified SGLang worker, and nothing else.

SGLang loads :mod:`engine_ext.models` as its external model package (``SGLANG_EXTERNAL_MODEL_PACKAGE``); those
classes route every extend batch through :mod:`engine_ext.executor`, which executes the reuse plan each request
carries (:mod:`plan`) and reads and writes image entries in the shared store (:mod:`store`).

- :mod:`engine_ext.models`: Qwen2.5-VL and Qwen3-VL classes registered under SGLang's own class names.
- :mod:`engine_ext.executor`: plan execution (rows of each image in a batch, store reads and writes, the
  layer-by-layer decoder for reused rows and its attention over the KV pool).
- :mod:`engine_ext.selection`: which tokens an approximate plan recomputes, reuses and drops (shared with
  ``offline.reference``, so the two decide alike).
- :mod:`engine_ext.vision`: the partial vision pass (the tower over some tokens' patches at their true positions).
- :mod:`engine_ext.rope`: moving cached keys to new positions, as a whole or per M-RoPE axis (shared with
  ``offline.reference``).
- :mod:`engine_ext.video_decoder`: the workers' video decoder (PyAV, as the gateway's), installed in every worker
  process by the worker site's ``sitecustomize`` (:data:`WORKER_SITE`, first on each worker's ``PYTHONPATH``).

It never imports the gateway; the gateway never imports it. Starting workers is :mod:`launcher`'s job.
"""

from pathlib import Path

# The launcher puts this directory first on every worker's PYTHONPATH (engine_ext/worker_site/sitecustomize.py).
WORKER_SITE = Path(__file__).resolve().parent / "worker_site"
