"""SharedFeatureStore: the match index's per-image features, shared by gateway replicas, in the books' server.

The same interface as store.FeatureStore (the LMDB one beside a single gateway's store), over Redis keys under
``revisit:<store name>:features:``:

    index          a hash: image key -> the small record the index holds in memory (read in full at start)
    tokens:<key>   the image's per-token features, read for the few candidates a lookup compares in full

Errors from the server become store.StoreError, as the LMDB store's do, so the matcher treats both alike (a
feature write that fails leaves the image out of the other replicas' index, nothing more).

Each record is stored behind a MAC (keyed BLAKE3 under the deployment secret's "features" key, settings/secret.py)
over the prefix, the image key, the kind of record and its bytes. A record whose MAC does not hold (placed by
someone with access to the server, copied from another image or store, or written before records were
authenticated) reads as absent, and is counted (``refused``): no lookup matches an image whose features nobody
holding the secret wrote.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import redis

from settings.secret import DataPlaneSecret, mac, same_mac
from store import StoreError, validate_key

log = logging.getLogger(__name__)

SCAN_BATCH = 1000
MAC_BYTES = 32
INDEX, TOKENS = b"index", b"tokens"  # the kinds of record, under the MAC


class SharedFeatureStore:
    def __init__(self, url: str, *, name: str, timeout_s: float = 5.0, secret: DataPlaneSecret | None = None) -> None:
        self.prefix = f"revisit:{name}:features:"
        self._mac_key = (secret if secret is not None else DataPlaneSecret()).key("features")
        self.refused = 0  # records read as absent: their MAC was missing or wrong
        self._warned = False
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _mac(self, key: str, kind: bytes, record: bytes | memoryview) -> bytes:
        return mac(self._mac_key, b"revisit-features", self.prefix.encode(), key.encode(), kind, record)

    def _sealed(self, key: str, kind: bytes, record: bytes) -> bytes:
        return self._mac(key, kind, record) + record

    def _opened(self, key: str, kind: bytes, value: bytes | None) -> bytes | None:
        """The record in a value made by :meth:`_sealed`; None when there is none or its MAC does not hold."""
        if value is None:
            return None
        view = memoryview(value)
        if len(view) >= MAC_BYTES and same_mac(self._mac(key, kind, view[MAC_BYTES:]), bytes(view[:MAC_BYTES])):
            return bytes(view[MAC_BYTES:])
        self.refused += 1
        if not self._warned:
            self._warned = True
            log.warning("the shared feature store %s holds records whose MAC does not hold (first: the %s record of "
                        "%s): read as absent; forged, copied from another image or store, made under another "
                        "secret, or written by a version that did not authenticate them", self.prefix,
                        kind.decode(), key[:16])
        return None

    def put(self, key: str, index_record: bytes, tokens: bytes) -> None:
        """Both records of key, replacing any earlier ones, in one transaction."""
        validate_key(key)
        try:
            with self._redis.pipeline(transaction=True) as both:
                both.set(self.prefix + "tokens:" + key, self._sealed(key, TOKENS, tokens))
                both.hset(self.prefix + "index", key, self._sealed(key, INDEX, index_record))
                both.execute()
        except redis.RedisError as exc:
            raise StoreError(f"could not store the features of {key[:16]}: {exc}") from exc

    def tokens(self, key: str) -> bytes | None:
        validate_key(key)
        try:
            value = self._redis.get(self.prefix + "tokens:" + key)
        except redis.RedisError as exc:
            raise StoreError(f"could not read the features of {key[:16]}: {exc}") from exc
        return self._opened(key, TOKENS, None if value is None else bytes(value))  # type: ignore[arg-type]

    def index_record(self, key: str) -> bytes | None:
        validate_key(key)
        try:
            value = self._redis.hget(self.prefix + "index", key)
        except redis.RedisError as exc:
            raise StoreError(f"could not read the index record of {key[:16]}: {exc}") from exc
        return self._opened(key, INDEX, None if value is None else bytes(value))  # type: ignore[arg-type]

    def remove(self, key: str) -> bool:
        validate_key(key)
        try:
            with self._redis.pipeline(transaction=True) as both:
                both.delete(self.prefix + "tokens:" + key)
                both.hdel(self.prefix + "index", key)
                tokens, index = both.execute()
        except redis.RedisError as exc:
            raise StoreError(f"could not drop the features of {key[:16]}: {exc}") from exc
        return bool(tokens or index)

    def index_records(self) -> Iterator[tuple[str, bytes]]:
        """Every authenticated index record (the others are left out, counted)."""
        try:
            found = [(bytes(k), bytes(v))
                     for k, v in self._redis.hscan_iter(self.prefix + "index", count=SCAN_BATCH)]
        except redis.RedisError as exc:
            raise StoreError(f"could not list the index records: {exc}") from exc
        opened = []
        for raw_key, value in found:
            key = raw_key.decode(errors="replace")  # a key that is not text has no valid MAC either
            record = self._opened(key, INDEX, value)
            if record is not None:
                opened.append((key, record))
        return iter(opened)

    def __len__(self) -> int:
        try:
            return int(self._redis.hlen(self.prefix + "index"))
        except redis.RedisError as exc:
            raise StoreError(f"could not count the index records: {exc}") from exc

    def close(self) -> None:
        self._redis.close()
