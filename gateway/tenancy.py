"""Which cache namespace a request belongs to.

The namespace is derived from the caller's credentials, never from anything the caller
can simply claim: a request header naming a namespace would let one tenant read
another's cached images. An operator shares a namespace by mapping several API keys to
it (``GatewayConfig.namespaces``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping


def namespace_for(authorization: str | None, *, mapping: Mapping[str, str], default: str) -> str:
    """The namespace for an ``Authorization`` header value (``Bearer <key>``) or its absence."""
    if not authorization:
        return default
    scheme, _, key = authorization.partition(" ")
    key = key.strip() if scheme.lower() == "bearer" else authorization.strip()
    if not key:
        return default
    if key in mapping:
        return mapping[key]
    # One namespace per key; the key itself never appears in keys, logs or metrics.
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def cache_scope(namespace: str) -> str:
    """The digest that stands for a namespace in the workers' caches: SGLang's prefix cache (``extra_key``) and
    encoder-output cache (the plan's ``scope``). The namespace itself never reaches a worker."""
    return "revisit-ns-" + hashlib.blake2b(namespace.encode(), digest_size=12).hexdigest()
