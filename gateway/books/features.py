"""SharedFeatureStore: the match index's per-image features, shared by gateway replicas, in the books' server.

The same interface as store.FeatureStore (the LMDB one beside a single gateway's store), over Redis keys under
``revisit:<store name>:features:``:

    index          a hash: image key -> the small record the index holds in memory (read in full at start)
    tokens:<key>   the image's per-token features, read for the few candidates a lookup compares in full

Errors from the server become store.StoreError, as the LMDB store's do, so the matcher treats both alike (a
feature write that fails leaves the image out of the other replicas' index, nothing more).
"""

from __future__ import annotations

from collections.abc import Iterator

import redis

from store import StoreError, validate_key

SCAN_BATCH = 1000


class SharedFeatureStore:
    def __init__(self, url: str, *, name: str, timeout_s: float = 5.0) -> None:
        self.prefix = f"revisit:{name}:features:"
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def put(self, key: str, index_record: bytes, tokens: bytes) -> None:
        """Both records of key, replacing any earlier ones, in one transaction."""
        validate_key(key)
        try:
            with self._redis.pipeline(transaction=True) as both:
                both.set(self.prefix + "tokens:" + key, tokens)
                both.hset(self.prefix + "index", key, index_record)
                both.execute()
        except redis.RedisError as exc:
            raise StoreError(f"could not store the features of {key[:16]}: {exc}") from exc

    def tokens(self, key: str) -> bytes | None:
        validate_key(key)
        try:
            value = self._redis.get(self.prefix + "tokens:" + key)
        except redis.RedisError as exc:
            raise StoreError(f"could not read the features of {key[:16]}: {exc}") from exc
        return None if value is None else bytes(value)  # type: ignore[arg-type]

    def index_record(self, key: str) -> bytes | None:
        validate_key(key)
        try:
            value = self._redis.hget(self.prefix + "index", key)
        except redis.RedisError as exc:
            raise StoreError(f"could not read the index record of {key[:16]}: {exc}") from exc
        return None if value is None else bytes(value)  # type: ignore[arg-type]

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
        try:
            found = [(k.decode(), bytes(v))
                     for k, v in self._redis.hscan_iter(self.prefix + "index", count=SCAN_BATCH)]
        except redis.RedisError as exc:
            raise StoreError(f"could not list the index records: {exc}") from exc
        return iter(found)

    def __len__(self) -> int:
        try:
            return int(self._redis.hlen(self.prefix + "index"))
        except redis.RedisError as exc:
            raise StoreError(f"could not count the index records: {exc}") from exc

    def close(self) -> None:
        self._redis.close()
