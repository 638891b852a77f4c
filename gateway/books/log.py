"""BookLog: the ordered log of book events that gateway replicas share, with snapshots, in Redis (or Valkey).

Keys, under ``revisit:<store name>:books:`` so that several stores can share a server:

    log          a stream of events (JSON), in the one order every replica applies them
    snapshot     the books as of one event (JSON: ``{"cursor": <event id>, "state": ...}``); the log before it is
                 trimmed away
    trimmed      the id the log was last trimmed to (every earlier event is gone; the snapshot has them)
    settings     a fingerprint of the settings the books depend on (tiers, capacities, policy knobs): replicas
                 with other settings would decide otherwise from the same events, so they refuse to start
    lock         held (with an expiry) by the replica writing a snapshot

Authenticated (settings/secret.py): every event, the snapshot, the trim mark and the settings carry a MAC under
the deployment secret's "books" key over the store's prefix and their body, so an event or snapshot that someone
with access to the server placed there, or copied from another store's books, is not applied: it is skipped,
counted (``refused_events``, ``refused_snapshots``; /admin/stats shows them) and logged once. A forged snapshot
reads as none, a forged trim mark as no trim, and forged settings as none recorded (they are then recorded anew).
Books written before events were authenticated are skipped the same way. Without a secret the MACs are under a
public key: they catch damage, not forgery. Every event also names its writer (a random id per BookLog, that is per
replica run) and its place in that writer's events (1, 2, 3, ...), under the MAC: a valid event of this log copied
into it again (a replay, which would repeat an eviction or an unpin) comes after the writer's later events, and the
books refuse it (gateway/books/shared.py keeps each writer's last number in the books and their snapshots).

Every call is one or two round trips on a connection of the calling thread's (redis-py's pool); errors from the
server or the network become :class:`BooksUnavailable`.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any, NamedTuple

import redis

from gateway.books.errors import BooksMismatch, BooksUnavailable
from settings.secret import DataPlaneSecret, mac, same_mac

log = logging.getLogger(__name__)

READ_BATCH = 1000  # events per read
LOCK_MS = 30_000
START = "0-0"


class LogRead(NamedTuple):
    trimmed: bool  # events after the cursor were trimmed away
    snapshot: bool  # a snapshot is stored
    events: list[tuple[str, dict[str, Any]]]  # (id, event) after the cursor, in log order, those authenticated
    last: str | None = None  # the id of the last entry read, authenticated or not (None: none read)
    read: int = 0  # entries read, authenticated or not
    trimmed_to: str | None = None  # the id the log was trimmed to, when it was trimmed past the cursor


def id_after(a: str, b: str) -> bool:
    """Whether stream id a comes after stream id b."""
    ams, _, aseq = a.partition("-")
    bms, _, bseq = b.partition("-")
    return (int(ams), int(aseq or 0)) > (int(bms), int(bseq or 0))


class BookLog:
    def __init__(self, url: str, *, name: str, timeout_s: float = 5.0, secret: DataPlaneSecret | None = None) -> None:
        self.url = url
        self.prefix = f"revisit:{name}:books:"
        self._mac_key = (secret if secret is not None else DataPlaneSecret()).key("books")
        self.refused_events = 0  # events not applied: their MAC was missing or wrong
        self.refused_snapshots = 0  # snapshots read as none: their MAC was missing or wrong
        self.writer = secrets.token_hex(8)  # this log's writer id: its events are (writer, 1), (writer, 2), ...
        self._numbers = itertools.count(1)
        self._warned: set[str] = set()
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _key(self, part: str) -> str:
        return self.prefix + part

    # ---- MACs ------------------------------------------------------------------------

    def _mac(self, what: bytes, body: bytes) -> str:
        return mac(self._mac_key, b"revisit-books", what, self.prefix.encode(), body).hex()

    def _sealed(self, what: bytes, body: str) -> str:
        """``body`` with its MAC in front: ``<hex MAC>.<body>``."""
        return self._mac(what, body.encode()) + "." + body

    def _opened(self, what: bytes, value: bytes | str | None) -> str | None:
        """The body of a value made by :meth:`_sealed`; None when there is none or its MAC does not hold."""
        if value is None:
            return None
        data = value if isinstance(value, bytes) else value.encode()
        tag, dot, body = data.partition(b".")
        if not dot or not same_mac(self._mac(what, body).encode(), tag):
            return None
        try:
            return body.decode()
        except UnicodeDecodeError:
            return None

    def _refused(self, what: str, detail: str) -> None:
        """Warn once per kind of record that one was refused (the counters count them all)."""
        if what in self._warned:
            return
        self._warned.add(what)
        log.warning("the shared books at %s hold %s whose MAC does not hold (%s): not used; forged, copied from "
                    "other books, made under another secret, or written by a version that did not authenticate "
                    "them (further ones are counted in the books' status, not logged)", self.prefix, what, detail)

    # ---- the log ---------------------------------------------------------------------

    def append(self, event: dict[str, Any]) -> str:
        """Add an event at the end of the log, marked with this writer and its number; its id."""
        body = json.dumps({**event, "by": self.writer, "n": next(self._numbers)}, separators=(",", ":"))
        tag = self._mac(b"event", body.encode())
        return _text(_answer(lambda: self._redis.xadd(self._key("log"), {"event": body, "mac": tag})))

    def _event(self, event_id: str, fields: dict[bytes, bytes]) -> dict[str, Any] | None:
        """The event of one stream entry, or None (counted) when it is not authenticated."""
        body, tag = fields.get(b"event"), fields.get(b"mac")
        if body is None or tag is None or not same_mac(self._mac(b"event", body).encode(), tag):
            self.refused_events += 1
            self._refused("events", f"first {event_id}")
            return None
        try:
            event = json.loads(body)
        except ValueError:
            event = None
        if not isinstance(event, dict):  # authenticated, so ours; but never a reason to stop the replica
            self.refused_events += 1
            if "unreadable" not in self._warned:
                self._warned.add("unreadable")
                log.warning("the shared books at %s hold an event that is not an object (%s): skipped",
                            self.prefix, event_id)
            return None
        return event

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
        events = []
        for raw_id, fields in found:
            event_id = _text(raw_id)
            event = self._event(event_id, fields)
            if event is not None:
                events.append((event_id, event))
        trimmed_to = self._opened(b"trimmed", trimmed)
        if trimmed is not None and trimmed_to is None:
            self._refused("a trim mark", "read as no trim")
        elif trimmed_to is not None and not _is_id(trimmed_to):
            trimmed_to = None
        cut = trimmed_to is not None and id_after(trimmed_to, cursor)
        return LogRead(trimmed=cut, snapshot=bool(snapshot), events=events,
                       last=_text(found[-1][0]) if found else None, read=len(found),
                       trimmed_to=trimmed_to if cut else None)

    def snapshot(self) -> tuple[str, dict[str, Any]] | None:
        """(cursor, state) of the last snapshot, or None (also for one that is not authenticated: counted)."""
        data = _answer(lambda: self._redis.get(self._key("snapshot")))
        if data is None:
            return None
        body = self._opened(b"snapshot", data)
        try:
            parsed = json.loads(body) if body is not None else None
            if not isinstance(parsed, dict) or not _is_id(parsed["cursor"]) or not isinstance(parsed["state"], dict):
                parsed = None
        except (ValueError, KeyError, TypeError):
            parsed = None
        if parsed is None:
            self.refused_snapshots += 1
            self._refused("a snapshot", "read as none")
            return None
        return parsed["cursor"], parsed["state"]

    def save_snapshot(self, cursor: str, state: dict[str, Any]) -> bool:
        """Store the books as of ``cursor`` and trim the log up to it, unless another replica is doing so or a
        newer snapshot is there already. Whether this one was saved."""
        if not _answer(lambda: self._redis.set(self._key("lock"), "1", nx=True, px=LOCK_MS)):
            return False
        try:
            current = self.snapshot()
            if current is not None and not id_after(cursor, current[0]):
                return False
            body = self._sealed(b"snapshot", json.dumps({"cursor": cursor, "state": state}, separators=(",", ":")))
            _answer(lambda: self._redis.set(self._key("snapshot"), body))
            _answer(lambda: self._redis.set(self._key("trimmed"), self._sealed(b"trimmed", cursor)))
            _answer(lambda: self._redis.xtrim(self._key("log"), minid=cursor, approximate=False))
            return True
        finally:
            _answer(lambda: self._redis.delete(self._key("lock")))

    def check_settings(self, fingerprint: str) -> None:
        """Record the books' settings, or check them against those already recorded. Raises BooksMismatch.
        Settings recorded without a valid MAC (forged, or by a version that did not authenticate them) are
        replaced by this gateway's."""
        sealed = self._sealed(b"settings", fingerprint)
        _answer(lambda: self._redis.set(self._key("settings"), sealed, nx=True))
        recorded = self._opened(b"settings", _answer(lambda: self._redis.get(self._key("settings"))))
        if recorded is None:
            self._refused("settings", "recorded anew")
            _answer(lambda: self._redis.set(self._key("settings"), sealed))
            recorded = self._opened(b"settings", _answer(lambda: self._redis.get(self._key("settings"))))
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


def _is_id(value: object) -> bool:
    """Whether ``value`` is a stream id (``<ms>-<seq>``)."""
    if not isinstance(value, str):
        return False
    ms, dash, seq = value.partition("-")
    return ms.isdigit() and (not dash or seq.isdigit()) and ms.isascii() and seq.isascii()
