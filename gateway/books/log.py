"""BookLog: the ordered log of book events that gateway replicas share, with snapshots, in Redis (or Valkey).

Keys, under ``revisit:<store name>:books:`` so that several stores can share a server:

    log          a stream of events (JSON), in the one order every replica applies them
    snapshot     the books as of one event (JSON: ``{"cursor": <event id>, "state": ...}``); the log before it is
                 trimmed away
    trimmed      the id the log was last trimmed to (every earlier event is gone; the snapshot has them)
    settings     a fingerprint of the settings the books depend on (tiers, capacities, policy knobs): replicas
                 with other settings would decide otherwise from the same events, so they refuse to start
    lock         held (with an expiry) by the replica writing a snapshot

Every call is one or two round trips on a connection of the calling thread's (redis-py's pool); errors from the
server or the network become :class:`BooksUnavailable`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

import redis

from gateway.books.errors import BooksMismatch, BooksUnavailable

READ_BATCH = 1000  # events per read
LOCK_MS = 30_000
START = "0-0"


class LogRead(NamedTuple):
    trimmed: bool  # events after the cursor were trimmed away
    snapshot: bool  # a snapshot is stored
    events: list[tuple[str, dict[str, Any]]]  # (id, event) after the cursor, in log order


def id_after(a: str, b: str) -> bool:
    """Whether stream id a comes after stream id b."""
    ams, _, aseq = a.partition("-")
    bms, _, bseq = b.partition("-")
    return (int(ams), int(aseq or 0)) > (int(bms), int(bseq or 0))


class BookLog:
    def __init__(self, url: str, *, name: str, timeout_s: float = 5.0) -> None:
        self.url = url
        self.prefix = f"revisit:{name}:books:"
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _key(self, part: str) -> str:
        return self.prefix + part

    def append(self, event: dict[str, Any]) -> str:
        """Add an event at the end of the log; its id."""
        body = json.dumps(event, separators=(",", ":"))
        return _text(_answer(lambda: self._redis.xadd(self._key("log"), {"event": body})))

    def after(self, cursor: str, count: int = READ_BATCH) -> LogRead:
        """Up to ``count`` events after ``cursor`` in log order, whether events after it were trimmed away (a
        replica that far behind must load the snapshot and read on from its cursor) and whether a snapshot is
        there, in one round trip."""
        def read() -> list[Any]:
            with self._redis.pipeline(transaction=False) as all_three:
                all_three.get(self._key("trimmed"))
                all_three.exists(self._key("snapshot"))
                all_three.xrange(self._key("log"), min=f"({cursor}", max="+", count=count)
                return list(all_three.execute())

        trimmed, snapshot, found = _answer(read)
        events = [(_text(event_id), json.loads(fields[b"event"])) for event_id, fields in found]
        return LogRead(trimmed=trimmed is not None and id_after(_text(trimmed), cursor), snapshot=bool(snapshot),
                       events=events)

    def snapshot(self) -> tuple[str, dict[str, Any]] | None:
        """(cursor, state) of the last snapshot, or None."""
        data = _answer(lambda: self._redis.get(self._key("snapshot")))
        if data is None:
            return None
        body = json.loads(data)
        return body["cursor"], body["state"]

    def save_snapshot(self, cursor: str, state: dict[str, Any]) -> bool:
        """Store the books as of ``cursor`` and trim the log up to it, unless another replica is doing so or a
        newer snapshot is there already. Whether this one was saved."""
        if not _answer(lambda: self._redis.set(self._key("lock"), "1", nx=True, px=LOCK_MS)):
            return False
        try:
            current = self.snapshot()
            if current is not None and not id_after(cursor, current[0]):
                return False
            body = json.dumps({"cursor": cursor, "state": state}, separators=(",", ":"))
            _answer(lambda: self._redis.set(self._key("snapshot"), body))
            _answer(lambda: self._redis.set(self._key("trimmed"), cursor))
            _answer(lambda: self._redis.xtrim(self._key("log"), minid=cursor, approximate=False))
            return True
        finally:
            _answer(lambda: self._redis.delete(self._key("lock")))

    def check_settings(self, fingerprint: str) -> None:
        """Record the books' settings, or check them against those already recorded. Raises BooksMismatch."""
        _answer(lambda: self._redis.set(self._key("settings"), fingerprint, nx=True))
        recorded = _text(_answer(lambda: self._redis.get(self._key("settings"))) or b"")
        if recorded != fingerprint:
            raise BooksMismatch(f"the shared books at {self.url} ({self.prefix}) were made with other settings: "
                                f"{recorded} here, {fingerprint} in this gateway; use the same tiers and policy "
                                "settings on every replica, or another store name")

    def length(self) -> int:
        return int(_answer(lambda: self._redis.xlen(self._key("log"))))

    def close(self) -> None:
        self._redis.close()


def _answer(call: Callable[[], Any]) -> Any:
    """The server's answer to ``call``; its errors and the network's as BooksUnavailable."""
    try:
        return call()
    except redis.RedisError as exc:
        raise BooksUnavailable(f"the shared books' server did not answer: {exc}") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
