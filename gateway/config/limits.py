"""How much work callers may have the gateway do at once (gateway/admission.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from gateway.config.errors import ConfigError
from settings import PREFIX, EnvReader

ADMISSION_ENV_PREFIX = PREFIX + "ADMISSION_"


@dataclass(frozen=True, kw_only=True)
class AdmissionLimits:
    """``REVISIT_ADMISSION_<FIELD>``. Requests (``/v1/...``) in flight, and the bytes of their bodies held, overall
    and per API key: past a limit a request gets OpenAI's 429 (``Retry-After: 1``), so one caller cannot take
    the gateway's memory or CPU from the others; a declared body that its key's budget has no room for yet first
    waits for room, unread, for up to ``body_timeout_s`` (the 429 after). A body that no budget could ever take
    (more than the per-key budget, or than ``REVISIT_MAX_REQUEST_BYTES``) is a 413 instead. ``body_timeout_s``
    bounds reading a request's whole body (a 408 after it), however slowly the client sends it.
    ``worker_requests_per_key`` bounds how many of a key's requests are at the workers at once while another key has
    requests for them (gateway/turns.py); the others wait at the gateway. Unset, it follows the workers' devices:
    2 while they are all CPU workers, 16 otherwise."""

    max_requests: int = 1024
    max_requests_per_key: int = 64
    max_body_bytes: int = 2 << 30
    max_body_bytes_per_key: int = 64 << 20
    body_timeout_s: float = 60.0
    worker_requests_per_key: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value <= 0:
                raise ConfigError(f"{ADMISSION_ENV_PREFIX}{f.name.upper()} must be positive")
        if self.max_requests_per_key > self.max_requests or self.max_body_bytes_per_key > self.max_body_bytes:
            raise ConfigError("a per-key admission limit must not exceed the overall one")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> AdmissionLimits:
        return cls(**EnvReader(environ, error=ConfigError).fields(cls, ADMISSION_ENV_PREFIX))
