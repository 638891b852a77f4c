"""The worker site (``engine_ext.WORKER_SITE``): a directory the launcher puts first on every SGLang worker's
``PYTHONPATH``, CPU and GPU alike.

Python imports its ``sitecustomize`` at the start of every process of the worker (the HTTP server with its
tokenizer manager and multimodal processor, the scheduler, the detokenizer, and any process SGLang spawns or
forks), which is how code reaches processes that SGLang starts itself. It is a package only so that an installed
copy of the project carries it; nothing imports it as one.
"""
