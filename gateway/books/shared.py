"""SharedBooks: the cache books of several gateway replicas, kept the same by one ordered log of events.

The policy (gateway/policy) is deterministic: books that apply the same calls in the same order decide the same
things. So a replica does not change its books directly: each change (an insert, a hit, a removal, a pin, new
priors, and the match index's additions and removals) is appended to the shared log (gateway/books/log.py), and
every replica applies every event of the log, in log order, to its own copy. The replica that made a change
applies the store decisions the event yields (its caller gets them back, as from CachePolicy); the others only
book them. The match index follows the same events: the features of an indexed image live in the shared feature
store (gateway/books/features.py), and an index event tells the other replicas to index or forget it.

Freshness. A change catches its replica up to the change itself before returning, so what it decides is decided
on the books as every replica will see them. Reads (membership, stats, entries) see this replica's books as of its
last catch-up; Services catches every replica up every ``books_follow_interval_s`` (0.1 s by default).

Snapshots and restarts. Every SNAPSHOT_EVERY events a replica saves its books (CachePolicy.state) with the id of
the last event they include, and the log before it is trimmed. A starting replica loads the snapshot, applies the
events after it, and rebuilds its match index from the shared feature store; a replica that fell so far behind
that events it had not applied were trimmed loads the snapshot again. A replica that dies loses nothing: the log,
the snapshot and the features are in the server, and the entries in the shared store.

Authentication. Only events and snapshots that carry a valid MAC under the deployment secret are applied
(gateway/books/log.py): the others are stepped over, and counted in :meth:`SharedBooks.status` (/admin/stats). A
valid event copied into the log again is stepped over too: each event carries its writer and its number among that
writer's events, and the books keep each writer's last number applied (in their state, so in snapshots too): an
event numbered at or below it is a replay (counted as ``replayed_events``). A replica whose snapshot stays behind
the log's trim (removed, forged, or an older one put back) goes on from the trim with the books it has.

Threading: the cache thread's, like the policy it extends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

from gateway.books.errors import BooksError
from gateway.books.log import READ_BATCH, START, BookLog, id_after
from gateway.config import PolicySettings
from gateway.policy import CacheEntry, CachePolicy, Decision, PolicyError, PresetPriors, Tier

log = logging.getLogger(__name__)

SNAPSHOT_EVERY = 5000  # events applied by a replica between two of its snapshots
MAX_RELOADS = 3  # snapshot reloads in one catch-up before going on from the trim without one


def settings_fingerprint(settings: PolicySettings, tiers: tuple[Tier, ...]) -> str:
    """What the books' decisions depend on besides the events: the tiers and every policy setting."""
    return json.dumps({"tiers": [t.value for t in tiers], **dataclasses.asdict(settings)}, sort_keys=True)


class SharedBooks(CachePolicy):
    """CachePolicy whose changes go through the shared log. Index events go to ``learn`` and ``forget`` (a
    Matcher's), when set."""

    def __init__(self, settings: PolicySettings, log: BookLog, *, tiers: tuple[Tier, ...] | tuple[str, ...]) -> None:
        super().__init__(settings, tiers=tiers)
        self.log = log
        self.cursor = START
        self.applied = 0  # events applied by this replica
        self._since_snapshot = 0
        self.learn: Callable[[str], None] | None = None  # index an image another replica indexed
        self.forget: Callable[[str], None] | None = None  # forget an image another replica's index dropped
        self._reloads = 0
        self._snapshot_seen = False  # whether the last read of the log found a snapshot stored
        self._writers: dict[str, int] = {}  # writer id -> the number of its last event applied (part of the books)
        self.replayed_events = 0  # authenticated events stepped over: numbered at or below their writer's last

    # ---- the books' state: the policy's, and each writer's last event ---------------------------------

    def state(self) -> dict:
        return {**super().state(), "writers": dict(self._writers)}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        writers = state.get("writers", {})
        self._writers = {str(w): int(n) for w, n in writers.items()} if isinstance(writers, dict) else {}

    # ---- start ------------------------------------------------------------------------

    def load(self) -> None:
        """Join the shared books: check the settings, load the snapshot, apply what came after it."""
        self.log.check_settings(settings_fingerprint(self.settings, self.tiers))
        self._load_snapshot()
        self.catch_up()

    def _load_snapshot(self) -> None:
        snapshot = self.log.snapshot()
        if snapshot is None:
            self.load_state(CachePolicy(self.settings, tiers=self.tiers).state())
            self.cursor = START
        else:
            self.cursor, state = snapshot
            self.load_state(state)
        self._reloads += 1

    # ---- changes: the CachePolicy mutators, through the log ---------------------------------

    def insert(self, key: str, size_bytes: int, *, family: str | None = None) -> list[Decision]:
        return self._commit({"kind": "insert", "key": key, "size_bytes": size_bytes, "family": family})

    def restore(self, key: str, size_bytes: int, tier: Tier, *, pinned: bool = False) -> list[Decision]:
        return self._commit({"kind": "restore", "key": key, "size_bytes": size_bytes, "tier": Tier(tier).value,
                             "pinned": pinned})

    def record_exact_hit(self, key: str) -> list[Decision]:
        return self._commit({"kind": "record_exact_hit", "key": key})

    def record_approximate_hit(self, key: str) -> None:
        self._commit({"kind": "record_approximate_hit", "key": key})

    def pin(self, key: str) -> CacheEntry:
        return self._commit({"kind": "pin", "key": key})

    def unpin(self, key: str) -> CacheEntry:
        return self._commit({"kind": "unpin", "key": key})

    def remove(self, key: str, *, force: bool = False) -> list[Decision]:
        return self._commit({"kind": "remove", "key": key, "force": force})

    def flush(self, *, force: bool = False) -> list[Decision]:
        return self._commit({"kind": "flush", "force": force})

    def set_priors(self, priors: PresetPriors) -> None:
        self._commit({"kind": "set_priors", "priors": priors.as_dict()})

    def announce_indexed(self, key: str) -> None:
        """This replica indexed an image (its features are in the shared feature store)."""
        self.log.append({"kind": "index_add", "key": key})

    def announce_forgotten(self, key: str) -> None:
        self.log.append({"kind": "index_remove", "key": key})

    # ---- following the log ------------------------------------------------------------

    def _commit(self, event: dict[str, Any]) -> Any:
        """Append the event, apply the log up to it, and return what it yielded here (or raise its error)."""
        event_id = self.log.append(event)
        outcome = self._follow(until=event_id)
        if outcome is None:
            if id_after(event_id, self.cursor):
                raise BooksError(f"event {event_id} was not found in the shared log")
            # Another replica's snapshot took the event in before this one read it back (this replica had fallen
            # behind a trim): the books have it, its store decisions are lost here, and the periodic reconciliation
            # (Services._keep_books) settles what they would have moved.
            log.warning("event %s reached this replica through a snapshot; its store decisions were not applied",
                        event_id)
            return self.get(event["key"]) if event["kind"] in ("pin", "unpin") else []
        result, error = outcome
        if error is not None:
            raise error
        return result

    def catch_up(self) -> int:
        """Apply every event not applied yet; how many. Snapshots now and then."""
        before = self.applied
        self._follow(until=None)
        if self._since_snapshot >= SNAPSHOT_EVERY:
            self.save_snapshot()
        elif self.cursor != START and not self._snapshot_seen:
            # Books under way and no snapshot: the first events, or a server that lost its data (restarted without
            # its append-only file). Either way this replica's books are the best there are: a snapshot of them
            # lets replicas that join later start where the others are. (Events after a lost log have later ids
            # than this cursor, so they still follow it.)
            self.log.check_settings(settings_fingerprint(self.settings, self.tiers))
            self._snapshot_seen = self.save_snapshot()
        return self.applied - before

    def save_snapshot(self) -> bool:
        saved = self.log.save_snapshot(self.cursor, self.state())
        self._since_snapshot = 0
        return saved

    def _follow(self, until: str | None) -> tuple[Any, PolicyError | None] | None:
        found, reloads = None, 0
        while True:
            read = self.log.after(self.cursor)
            self._snapshot_seen = read.snapshot
            if read.trimmed and read.trimmed_to is not None:
                if reloads < MAX_RELOADS:
                    log.warning("the shared books' log was trimmed past this replica's place (%s): reloading the "
                                "snapshot", self.cursor)
                    self._load_snapshot()
                    reloads += 1
                    continue
                # The snapshot stays behind the trim (it was removed, replaced by an older one, or is not
                # authenticated): go on from the trim with the books as they are; the periodic reconciliation
                # with the store (Services._keep_books) takes in what they miss.
                log.warning("the shared books' snapshot does not reach the trim of their log (%s): going on from "
                            "the trim", read.trimmed_to)
                self.cursor = read.trimmed_to
                continue
            for event_id, event in read.events:
                outcome = self._apply(event) if self._first_sight(event_id, event) else (None, None)
                self.cursor = event_id
                self.applied += 1
                self._since_snapshot += 1
                if event_id == until:
                    found = outcome
            if read.last is not None and id_after(read.last, self.cursor):
                self.cursor = read.last  # past the entries that were not authenticated (the log counted them)
            if read.read < READ_BATCH or until is not None and found is not None:
                return found  # caught up, or up to the caller's own event (the rest can wait for the next call)

    def _first_sight(self, event_id: str, event: dict[str, Any]) -> bool:
        """Whether the event comes after its writer's last one applied (and records it); a replay, or an event with
        no writer's number (as versions before them wrote), is counted and not applied."""
        writer, number = event.get("by"), event.get("n")
        if not isinstance(writer, str) or type(number) is not int or number <= self._writers.get(writer, 0):
            self.replayed_events += 1
            if self.replayed_events == 1:
                log.warning("the shared books' log holds an event (%s) whose writer's number is not past that "
                            "writer's last one applied: a copy of an earlier event, not applied (further ones are "
                            "counted in the books' status)", event_id)
            return False
        self._writers[writer] = number
        return True

    def _apply(self, event: dict[str, Any]) -> tuple[Any, PolicyError | None]:
        """One event on this replica's books: (result, None), or (None, the error it raised here and everywhere)."""
        kind, key = event["kind"], str(event.get("key", ""))
        base = CachePolicy
        try:
            match kind:
                case "insert":
                    return base.insert(self, key, event["size_bytes"], family=event["family"]), None
                case "restore":
                    return base.restore(self, key, event["size_bytes"], Tier(event["tier"]),
                                        pinned=event["pinned"]), None
                case "record_exact_hit":
                    return base.record_exact_hit(self, key), None
                case "record_approximate_hit":
                    base.record_approximate_hit(self, key)
                    return None, None
                case "pin":
                    return base.pin(self, key), None
                case "unpin":
                    return base.unpin(self, key), None
                case "remove":
                    return base.remove(self, key, force=event["force"]), None
                case "flush":
                    return base.flush(self, force=event["force"]), None
                case "set_priors":
                    base.set_priors(self, PresetPriors(**event["priors"]))
                    return None, None
                case "index_add":
                    if self.learn is not None:
                        self.learn(key)
                    return None, None
                case "index_remove":
                    if self.forget is not None:
                        self.forget(key)
                    return None, None
        except PolicyError as exc:  # raised on every replica alike: the books stay the same
            return None, exc
        log.warning("skipped an event of an unknown kind in the shared books: %s", kind)
        return None, None

    def status(self) -> dict[str, Any]:
        return {"shared": True, "cursor": self.cursor, "applied": self.applied, "snapshot_reloads": self._reloads,
                "log": self.log.prefix, "refused_events": self.log.refused_events,
                "replayed_events": self.replayed_events, "refused_snapshots": self.log.refused_snapshots}

