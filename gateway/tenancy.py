"""Who is calling, and which cache namespace their request belongs to.

The namespace is derived from the caller's API key, never from anything the caller can simply claim: a request
header naming a namespace would let one tenant read another's cached images. An operator lists the keys served
and shares a namespace by mapping several keys to it (:class:`gateway.config.TenantSettings`); in keys mode (the
default) any other key is refused with OpenAI's 401 before the request's body is read.
"""

from __future__ import annotations

import functools
import hashlib
from typing import NamedTuple

from gateway.config import KEYS, TenantSettings, key_digest
from gateway.errors import Unauthorized
from settings.secret import DataPlaneSecret

# The part of a key's digest that names a caller in limits and logs: enough to tell callers apart, useless to
# find the key.
CALLER_ID_CHARS = 16
SCOPES_KEPT = 4096  # namespaces whose cache scope Tenants remembers (the most recently used)


class Caller(NamedTuple):
    """An authenticated caller: their cache namespace, an id of their key (no key: "anonymous"), and the digest that
    stands for their namespace in the workers' caches (:func:`cache_scope`)."""

    namespace: str
    key_id: str
    scope: str


class InvalidApiKey(Unauthorized):
    """OpenAI's answer to a missing or unknown key: a 401 of type invalid_request_error."""

    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


class Tenants:
    """Resolves an ``Authorization`` header to a :class:`Caller`, or refuses it (keys mode)."""

    def __init__(self, settings: TenantSettings, secret: DataPlaneSecret | None = None) -> None:
        self.settings = settings
        self._scope_key = (secret or DataPlaneSecret()).key("cache-scope")
        # cache_scope of a namespace, remembered (a keyed BLAKE2b is a microsecond a request)
        self._scope = functools.lru_cache(maxsize=SCOPES_KEPT)(functools.partial(cache_scope, key=self._scope_key))

    @property
    def open(self) -> bool:
        return self.settings.mode != KEYS

    def identify(self, authorization: str | None) -> Caller:
        """The caller of a request with this ``Authorization`` header value (``Bearer <key>``); InvalidApiKey when
        keys mode does not know the key, or there is none."""
        key = bearer_key(authorization)
        if key is None:
            if self.open:
                default = self.settings.default_namespace
                return Caller(default, "anonymous", self._scope(default))
            raise InvalidApiKey("You didn't provide an API key. Send it in an Authorization header: "
                                "'Authorization: Bearer YOUR_KEY'.")
        digest = key_digest(key)
        namespace = self.settings.keys.get(digest)
        if namespace is None:
            if not self.open:
                raise InvalidApiKey("Incorrect API key provided. Ask the gateway's operator for a key.")
            # Open mode: one namespace per key; the key itself never appears in keys, logs or metrics.
            namespace = "key-" + digest[:24]
        return Caller(namespace, digest[:CALLER_ID_CHARS], self._scope(namespace))


def bearer_key(authorization: str | None) -> str | None:
    """The key in an ``Authorization`` header value: ``Bearer <key>`` (or the bare value); None when empty."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    key = key.strip() if scheme.lower() == "bearer" else authorization.strip()
    return key or None


def cache_scope(namespace: str, key: bytes) -> str:
    """The digest that stands for a namespace in the workers' caches: SGLang's prefix cache (``extra_key``) and
    encoder-output cache (the plan's ``scope``). The namespace itself never reaches a worker, and the digest is keyed
    by the deployment secret: whoever reaches a worker cannot name a tenant's scope from a guess of its namespace."""
    return "revisit-ns-" + hashlib.blake2b(namespace.encode(), key=key, digest_size=12).hexdigest()
