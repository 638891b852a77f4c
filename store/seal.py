"""Entries that cannot be forged or moved: checksums under a secret seed, and a MAC over the header and the key.

An entry carries, in its prefix, a MAC (keyed BLAKE3, under a key derived from the deployment secret,
settings/secret.py) over the store key it was written under and its whole header area: the metadata, the original
positions and every checksum (the encoder output's, the KV region's and each (token, layer) block's). Those
checksums are XXH3-64 seeded by a second secret-derived value, so whoever does not hold the secret can neither
compute the checksum of bytes they would place nor predict how a change moves it; and the MAC stops them from
rewriting the checksums instead. Every read checks the MAC first (the header area only: about 0.3 ms for a
4K-token entry) and then the checksums of exactly what it reads, as before: a forged entry, or one copied under
another key, reads as damaged, which means a full prefill, never a wrong answer.

The key an entry is written under names its namespace (the gateway's exact key hashes it), and a worker writes an
entry only under a key that a plan authenticated by the gateway named (plan/request.py): the MAC over the key binds
the entry to the namespace too.
"""

from __future__ import annotations

import struct
from pathlib import Path

import xxhash

from settings.secret import DataPlaneSecret, SecretError, mac, same_mac
from store.errors import ConfigError

MAC_BYTES = 32
_ENTRY_PURPOSE = "store-entry-mac"
_SEED_PURPOSE = "store-checksum-seed"


class EntrySeal:
    """The checksum and MAC of entries under one deployment secret (or none: public keys, integrity only)."""

    def __init__(self, secret: DataPlaneSecret | None = None) -> None:
        secret = secret if secret is not None else DataPlaneSecret()
        self.authenticated = secret.configured
        self._mac_key = secret.key(_ENTRY_PURPOSE)
        self.seed: int = struct.unpack("<Q", secret.key(_SEED_PURPOSE)[:8])[0]

    @classmethod
    def from_file(cls, path: Path | None) -> EntrySeal:
        """The seal under the secret in ``path`` (None: public keys). Raises ConfigError for a bad file."""
        try:
            return cls(DataPlaneSecret.read(path))
        except SecretError as exc:
            raise ConfigError(str(exc)) from None

    def checksum(self, data: memoryview | bytes) -> int:
        """XXH3-64 of ``data`` under the secret seed."""
        return xxhash.xxh3_64_intdigest(data, seed=self.seed)

    def mac(self, key: str, signed: list[memoryview]) -> bytes:
        """The MAC of an entry stored under ``key`` whose header area, less the MAC field, is ``signed``."""
        return mac(self._mac_key, b"revisit-entry", key.encode(), *signed)

    def matches(self, key: str, signed: list[memoryview], given: bytes) -> bool:
        return same_mac(self.mac(key, signed), given)

    def __eq__(self, other: object) -> bool:  # seals under the same secret are the same seal
        return isinstance(other, EntrySeal) and same_mac(self._mac_key, other._mac_key)

    def __hash__(self) -> int:
        return self.seed

    def __repr__(self) -> str:
        return f"EntrySeal(authenticated={self.authenticated})"


PUBLIC = EntrySeal()  # no secret: the same checks under public keys
