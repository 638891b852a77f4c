"""Who may use the gateway, and which cache namespace each caller gets.

Two modes:

- ``keys`` (the default for ``revisit gateway`` and compose): only API keys the operator listed are served; any
  other key, or none, is refused with OpenAI's 401. Each listed key maps to a namespace; several keys may share one.
- ``open`` (``revisit serve`` on a laptop, unless keys are listed): any key is served, a listed key in its
  namespace, any other in a namespace of its own derived from the key, and requests without one in
  ``default_namespace``. Anyone who can reach the gateway is a tenant, so this mode is for one user.

Keys are held as SHA-256 digests, so a key file need not contain the keys themselves: a line of it is
``<namespace> sha256:<hex digest>`` (or ``<namespace> <key>``); ``revisit keys new NAMESPACE`` makes a key and
its line.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config.errors import ConfigError

KEYS = "keys"
OPEN = "open"
AUTH_MODES = (KEYS, OPEN)
# A key listed in plain text must be at least this long: placeholders such as "EMPTY" or "my-key" are what
# clients send when they were told any key will do, and must never identify a tenant.
MIN_KEY_CHARS = 16
DIGEST_PREFIX = "sha256:"
_DIGEST = re.compile(r"[0-9a-f]{64}")
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def key_digest(key: str) -> str:
    """The hex SHA-256 of an API key: how keys are held and compared."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class TenantSettings:
    """The API keys served and their namespaces. ``keys`` maps a key's digest (:func:`key_digest`) to its
    namespace."""

    mode: str = KEYS
    keys: Mapping[str, str] = field(default_factory=dict)
    default_namespace: str = "default"  # open mode: requests that carry no key

    def __post_init__(self) -> None:
        if self.mode not in AUTH_MODES:
            raise ConfigError(f"auth mode must be one of {', '.join(AUTH_MODES)}, got {self.mode!r}")
        for digest, namespace in self.keys.items():
            if not _DIGEST.fullmatch(digest):
                raise ConfigError("API keys are held as lowercase hex SHA-256 digests (gateway.config.key_digest)")
            _check_namespace(namespace)
        _check_namespace(self.default_namespace)

    @classmethod
    def open(cls, keys: Mapping[str, str] | None = None) -> TenantSettings:
        """Open mode; ``keys``: plain API key -> namespace, for keys that share or name a namespace."""
        return cls(mode=OPEN, keys={key_digest(k): ns for k, ns in (keys or {}).items()})

    @classmethod
    def with_keys(cls, keys: Mapping[str, str]) -> TenantSettings:
        """Keys mode serving exactly these plain API keys (key -> namespace)."""
        return cls(mode=KEYS, keys={key_digest(_checked_key(k)): ns for k, ns in keys.items()})

    def require_keys(self) -> None:
        """Raise ConfigError when keys mode lists no key (it would refuse every request)."""
        if self.mode == KEYS and not self.keys:
            raise ConfigError(
                "no API keys are configured, and REVISIT_AUTH=keys (the default for `revisit gateway`) serves only "
                "listed keys: set REVISIT_API_KEYS_FILE to a file of '<namespace> <key or sha256:digest>' lines "
                "(`revisit keys new NAMESPACE` makes a key and its line), or REVISIT_AUTH=open to serve any key "
                "(for a machine of one user only)")


def read_key_file(path: Path) -> dict[str, str]:
    """A key file's entries as digest -> namespace. Lines are ``<namespace> <key>`` or ``<namespace>
    sha256:<hex>``; blank lines and ``#`` comments are skipped. A malformed line, a short plain key or a key listed
    twice is a ConfigError naming the line (never the key)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc.strerror or exc}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"{path}, line {number}"
        if len(parts) != 2:
            raise ConfigError(f"{where}: expected '<namespace> <key or sha256:digest>'")
        namespace, secret = parts
        try:
            _check_namespace(namespace)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if secret.startswith(DIGEST_PREFIX):
            digest = secret[len(DIGEST_PREFIX):].lower()
            if not _DIGEST.fullmatch(digest):
                raise ConfigError(f"{where}: a digest is 'sha256:' and 64 hex digits")
        else:
            try:
                digest = key_digest(_checked_key(secret))
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        if digest in keys:
            raise ConfigError(f"{where}: this key is listed twice")
        keys[digest] = namespace
    return keys


def _checked_key(key: str) -> str:
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"an API key must be at least {MIN_KEY_CHARS} characters (placeholders such as 'EMPTY' "
                          "are what clients send when any key will do)")
    return key


def _check_namespace(namespace: str) -> None:
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise ConfigError("a namespace is 1-128 letters, digits and . _ : - (starting with a letter or digit), "
                          f"got {str(namespace)[:40]!r}")
