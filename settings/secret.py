"""The deployment's secret: what authenticates everything on the data plane that decides which KV a request gets.

Stored entries (store/seal.py), the plans that ride to the workers in SGLang's request id (plan/request.py), and
the books, match-index features (gateway/books) and outcomes (plan/outcome.py) shared through Redis or Valkey are
each authenticated with a key derived from one secret that the gateways and the workers share and nobody else
holds (``REVISIT_STORE_SECRET_FILE``: a file of at least 32 random bytes, or 64 hex digits; ``revisit keys secret
FILE`` makes one). Whoever can reach the store, the books' server or a worker can then read what they hold, but
cannot make a gateway or a worker use anything they placed there.

Without a secret (a laptop's ``revisit serve``) the same checks run under public keys: they still catch damage,
but not forgery.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from blake3 import blake3

MIN_SECRET_BYTES = 32
_PERSON = b"revisit-secret"  # blake2b's personalisation: these keys are for nothing else


class SecretError(ValueError):
    """The secret file cannot be read or is too short."""


class DataPlaneSecret:
    """The secret (or its absence), and the keys derived from it for each purpose. Its repr shows no key."""

    def __init__(self, material: bytes | None = None) -> None:
        if material is not None and len(material) < MIN_SECRET_BYTES:
            raise SecretError(f"the secret must be at least {MIN_SECRET_BYTES} bytes")
        if material is not None and len(material) > 64:  # BLAKE2b takes keys of at most 64 bytes
            material = hashlib.blake2b(material, digest_size=64).digest()
        self._material = material

    @property
    def configured(self) -> bool:
        return self._material is not None

    def key(self, purpose: str) -> bytes:
        """A 32-byte key for one purpose ("entry", "plan", "books", ...): a keyed BLAKE2b of the purpose. Without a
        secret, a public one (integrity only)."""
        return hashlib.blake2b(purpose.encode(), key=self._material or b"", digest_size=32, person=_PERSON).digest()

    def __repr__(self) -> str:
        return f"DataPlaneSecret(configured={self.configured})"

    @classmethod
    def read(cls, path: Path | None) -> DataPlaneSecret:
        """The secret in ``path`` (raw bytes, or hex text of them, surrounding whitespace ignored); no secret for
        None. Raises SecretError naming the file (never its content)."""
        if path is None:
            return cls()
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise SecretError(f"cannot read the secret file {path}: {exc.strerror or exc}") from None
        text = raw.strip()
        try:
            material = bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            material = raw
        if len(material) < MIN_SECRET_BYTES:
            raise SecretError(f"the secret file {path} holds {len(material)} bytes; at least {MIN_SECRET_BYTES} "
                              "random bytes are needed (`revisit keys secret FILE` makes one)")
        return cls(material)

    @staticmethod
    def create(path: Path) -> None:
        """Write a new secret (32 random bytes as hex) to ``path``, readable by its owner only; never overwrites."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as file:
            file.write(secrets.token_hex(MIN_SECRET_BYTES) + "\n")


def worker_api_key(secret: DataPlaneSecret) -> str | None:
    """The API key SGLang workers are started with (``--api-key``) and the gateway sends them: derived from the
    secret, so that nothing but a gateway holding it can post to a worker. None without a secret."""
    return "revisit-worker-" + secret.key("worker-api-key").hex() if secret.configured else None


def mac(key: bytes, *parts: bytes | memoryview, size: int = 32) -> bytes:
    """Keyed BLAKE3 (its MAC mode, under a 32-byte key) over ``parts``, each length-prefixed (so no two part lists
    give the same input), truncated to ``size`` bytes. BLAKE3 because an entry's header area is large (4096 tokens x
    36 layers of 8-byte checksums: 1.2 MB) and every read checks it: ~0.3 ms, against ~0.75 ms for HMAC-SHA256 on
    SHA-NI hardware and ~1.5 ms for BLAKE2b (bench/data_plane_mac.py)."""
    state = blake3(key=key)
    for part in parts:
        state.update(len(part).to_bytes(8, "little"))
        state.update(part)
    return state.digest(length=size)


def same_mac(expected: bytes, given: bytes) -> bool:
    """Compare two MACs in constant time."""
    return hmac.compare_digest(expected, given)
