"""What gateways and workers share through Redis or Valkey is authenticated under the deployment secret: whoever can
write to the server, but does not hold the secret, cannot make a replica apply a books event or snapshot, match an
image against features they placed, or report an outcome. Forged records and valid ones copied from another store,
image or request are ignored (and counted); books written before they were authenticated do not stop a replica.
Each test writes straight into a real redis-server with redis-py, as an attacker with access to it would."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from types import SimpleNamespace

import pytest
import redis

from gateway.books import BookLog, SharedBooks, SharedFeatureStore
from gateway.config import PolicySettings
from gateway.routes.admin import books_status
from plan.outcome import FULL_PREFILL, PLANNED, Outcome, OutcomeBox, SharedOutcomeBox, outcome_box
from settings.secret import DataPlaneSecret
from tests.policy.helpers import key

SETTINGS = PolicySettings(dram_capacity_bytes=100, lmdb_capacity_bytes=300)
SECRET = DataPlaneSecret(b"s" * 32)
OTHER_SECRET = DataPlaneSecret(b"o" * 32)


@pytest.fixture
def name() -> str:
    return f"auth-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def server(redis_server: str) -> redis.Redis:
    return redis.Redis.from_url(redis_server)


def replica(url: str, name: str, secret: DataPlaneSecret | None = SECRET) -> SharedBooks:
    books = SharedBooks(SETTINGS, BookLog(url, name=name, secret=secret), tiers=("dram", "lmdb"))
    books.load()
    return books


def insert_event(k: str, size: int = 10) -> dict:
    return {"kind": "insert", "key": k, "size_bytes": size, "family": None}


# ---- books events and snapshots ------------------------------------------------------------


def test_a_forged_event_is_not_applied_and_is_counted(redis_server, server, name):
    a, b = replica(redis_server, name), replica(redis_server, name)
    log_key = f"revisit:{name}:books:log"
    server.xadd(log_key, {"event": json.dumps(insert_event(key(1)))})  # no MAC, as earlier versions wrote
    server.xadd(log_key, {"event": json.dumps(insert_event(key(2))), "mac": "00" * 32})  # a made-up one
    server.xadd(log_key, {"garbage": b"\xff\x00"})  # not even an event
    a.insert(key(3), 10)  # a genuine change after them still gets through, to everyone
    b.catch_up()
    for books in (a, b):
        assert key(1) not in books and key(2) not in books and key(3) in books
        assert books.status()["refused_events"] == 3
    assert a.state() == b.state()
    assert books_status(b)["refused_events"] == 3  # what /admin/stats shows
    assert replica(redis_server, name).state() == a.state()  # one that joins afterwards (from the snapshot)


def test_an_event_copied_from_another_stores_books_is_refused(redis_server, server, name):
    other = replica(redis_server, name + "-other")
    other.insert(key(1), 10)
    ours = replica(redis_server, name)
    ((_, fields),) = server.xrange(f"revisit:{name}-other:books:log")
    server.xadd(f"revisit:{name}:books:log", fields)  # a valid event of the other store's, replayed here
    ours.catch_up()
    assert key(1) in other and key(1) not in ours and ours.status()["refused_events"] == 1


def test_an_event_made_under_another_secret_is_refused(redis_server, name):
    ours, foreign = replica(redis_server, name), SharedBooks(SETTINGS, BookLog(redis_server, name=name,
                                                                               secret=OTHER_SECRET),
                                                             tiers=("dram", "lmdb"))
    foreign.log.append(insert_event(key(1)))
    ours.catch_up()
    assert key(1) not in ours and ours.status()["refused_events"] == 1


def test_a_valid_event_copied_into_the_log_again_is_not_applied_again(redis_server, server, name):
    """Before: a replayed removal removed the image again from every replica's books, as often as it was copied."""
    a, b = replica(redis_server, name), replica(redis_server, name)
    a.insert(key(1), 10)
    a.remove(key(1))
    a.insert(key(1), 10)  # the image is back
    log_key = f"revisit:{name}:books:log"
    removal = next(fields for _, fields in server.xrange(log_key) if json.loads(fields[b"event"])["kind"] == "remove")
    server.xadd(log_key, removal)  # its MAC holds: it is a genuine event of these books, sent again
    b.catch_up()  # b reads the copy (and saves the books' first snapshot, past it)
    a.catch_up()  # a takes that snapshot in
    assert b.status()["replayed_events"] == 1
    assert key(1) in a and key(1) in b and a.state() == b.state()
    a.save_snapshot()  # the writers' last numbers are in the snapshot: a replica that starts from it refuses it too
    server.xadd(log_key, removal)
    late = replica(redis_server, name)
    assert key(1) in late and late.status()["replayed_events"] == 1
    assert books_status(late)["replayed_events"] == 1  # what /admin/stats shows


def test_a_forged_snapshot_is_ignored(redis_server, server, name):
    books = replica(redis_server, name)
    books.insert(key(1), 10)
    books.catch_up()  # the first events: a snapshot of them is saved
    genuine = server.get(f"revisit:{name}:books:snapshot")
    forged_state = replica(redis_server, name + "-scratch")
    forged_state.insert(key(9), 50)
    forged = json.dumps({"cursor": books.cursor, "state": forged_state.state()})
    for placed in (forged, "00" * 32 + "." + forged):
        server.set(f"revisit:{name}:books:snapshot", placed)
        assert books.log.snapshot() is None  # read as none
        late = replica(redis_server, name)  # goes on from the log's trim with no books
        assert key(9) not in late and len(late) == 0 and late.status()["refused_snapshots"] >= 1
    # A valid snapshot of another store's books, copied here, is forged too.
    forged_state.catch_up()
    server.set(f"revisit:{name}:books:snapshot", server.get(f"revisit:{name}-scratch:books:snapshot"))
    assert books.log.snapshot() is None and key(9) not in replica(redis_server, name)
    assert books.log.refused_snapshots == 3
    server.set(f"revisit:{name}:books:snapshot", genuine)
    assert books.log.snapshot() is not None


@pytest.mark.timeout(60)
def test_a_trim_past_a_snapshot_that_is_not_there_does_not_stall_a_replica(redis_server, server, name,
                                                                          monkeypatch):
    from gateway.books import shared as shared_module

    monkeypatch.setattr(shared_module, "SNAPSHOT_EVERY", 5)
    a = replica(redis_server, name)
    for i in range(8):
        a.insert(key(i), 10)
    a.catch_up()  # a snapshot, and the log trimmed to it
    assert a.log.after("0-0").trimmed
    server.set(f"revisit:{name}:books:snapshot", "forged")  # the snapshot replaced
    late = replica(redis_server, name)  # reloads what it can, then goes on from the trim
    a.insert(key(20), 10)
    late.catch_up()
    assert key(20) in late and late.status()["refused_snapshots"] >= 1
    # A forged trim mark far ahead is read as no trim: nothing is skipped.
    server.set(f"revisit:{name}:books:trimmed", "99999999999999-0")
    a.insert(key(21), 10)
    late.catch_up()
    assert key(21) in late


def test_a_replica_starts_against_books_written_before_they_were_authenticated(redis_server, server, name):
    """Earlier versions wrote plain events, snapshot, trim mark and settings: a replica ignores them all, starts,
    and books what comes next."""
    prefix = f"revisit:{name}:books:"
    first = server.xadd(prefix + "log", {"event": json.dumps(insert_event(key(1)))})
    server.xadd(prefix + "log", {"event": json.dumps(insert_event(key(2)))})
    old_state = replica(redis_server, name + "-scratch", secret=None)
    old_state.insert(key(3), 10)
    server.set(prefix + "snapshot", json.dumps({"cursor": first.decode(), "state": old_state.state()}))
    server.set(prefix + "trimmed", first)
    server.set(prefix + "settings", "an old fingerprint")
    books = replica(redis_server, name)
    assert len(books) == 0 and books.status()["refused_events"] == 2
    books.insert(key(4), 10)
    assert key(4) in books and key(1) not in books and key(3) not in books
    assert replica(redis_server, name).state() == books.state()  # the settings were recorded anew


# ---- the match index's features -------------------------------------------------------------


def test_a_forged_feature_record_reads_as_absent(redis_server, server, name):
    features = SharedFeatureStore(redis_server, name=name, secret=SECRET)
    prefix = f"revisit:{name}:features:"
    server.hset(prefix + "index", key(1), b"index-of-a-forged-image")
    server.set(prefix + "tokens:" + key(1), b"tokens-of-a-forged-image")
    assert features.index_record(key(1)) is None and features.tokens(key(1)) is None
    assert list(features.index_records()) == []  # the index rebuilt at start leaves it out
    assert features.refused == 3


def test_a_valid_feature_record_copied_to_another_image_or_store_reads_as_absent(redis_server, server, name):
    features = SharedFeatureStore(redis_server, name=name, secret=SECRET)
    features.put(key(1), b"index-1", b"tokens-1")
    prefix = f"revisit:{name}:features:"
    # The victim's near-duplicate key(2) pointed at key(1)'s features (and its entry).
    server.hset(prefix + "index", key(2), server.hget(prefix + "index", key(1)))
    server.set(prefix + "tokens:" + key(2), server.get(prefix + "tokens:" + key(1)))
    assert features.index_record(key(2)) is None and features.tokens(key(2)) is None
    assert list(features.index_records()) == [(key(1), b"index-1")]
    # The index and token records are not interchangeable either.
    server.hset(prefix + "index", key(1), server.get(prefix + "tokens:" + key(1)))
    assert features.index_record(key(1)) is None
    # Nor are another store's.
    other = SharedFeatureStore(redis_server, name=name + "-other", secret=SECRET)
    other.put(key(3), b"index-3", b"tokens-3")
    server.hset(prefix + "index", key(3), server.hget(f"revisit:{name}-other:features:index", key(3)))
    assert features.index_record(key(3)) is None
    # Nor those made under another secret.
    SharedFeatureStore(redis_server, name=name, secret=OTHER_SECRET).put(key(4), b"index-4", b"tokens-4")
    assert features.index_record(key(4)) is None and features.tokens(key(4)) is None


# ---- outcomes -------------------------------------------------------------------------------


def test_a_forged_outcome_is_ignored(redis_server, server, name):
    box = SharedOutcomeBox(redis_server, name=name, secret=SECRET)
    worker = SharedOutcomeBox(redis_server, name=name, secret=SECRET)
    server.set(box.prefix + "r1", json.dumps({"0": [PLANNED, None]}))  # what earlier versions wrote
    assert box.take("r1") is None
    server.set(box.prefix + "r2", b"\x00" * 32 + json.dumps({"0": [PLANNED, None]}).encode())
    assert box.take("r2") is None
    worker.put("r3", {0: Outcome(FULL_PREFILL, "entry_missing")})
    server.set(box.prefix + "r4", server.get(box.prefix + "r3"))  # another request's, copied
    assert box.take("r4") is None
    SharedOutcomeBox(redis_server, name=name + "-other", secret=SECRET).put("r5", {0: Outcome(PLANNED)})
    server.set(box.prefix + "r5", server.get(f"revisit:{name}-other:outcome:r5"))  # another store's
    assert box.take("r5") is None
    SharedOutcomeBox(redis_server, name=name, secret=OTHER_SECRET).put("r6", {0: Outcome(PLANNED)})
    assert box.take("r6") is None
    assert box.refused == 5
    assert box.take("r3") == {0: Outcome(FULL_PREFILL, "entry_missing")}  # the genuine one


@pytest.mark.parametrize("blocking", [True, False])
def test_the_gateway_takes_an_outcome_off_the_event_loop_only_where_it_blocks(blocking):
    """A round trip to the books' server (a blocking box) is made on a thread; a file in shared memory (the local
    box) is read on the loop, where a hand-off to a thread would cost more than the read."""
    from gateway.routes.openai_api import _what_ran

    seen = {}

    def take(request_id):
        seen["thread"] = threading.current_thread()
        return {0: Outcome(PLANNED)}

    services = SimpleNamespace(outcomes=SimpleNamespace(take=take, blocking=blocking), requests=None)
    planned = SimpleNamespace(plan=SimpleNamespace(reported=True), fallbacks=lambda ran: [],
                              reuse_header=lambda ran=None: "hit" if ran else "planned")

    async def answer():
        return await _what_ran(services, planned, "r1"), threading.current_thread()  # type: ignore[arg-type]

    (header, ran), loop_thread = asyncio.run(answer())
    assert header == "hit" and ran == {0: Outcome(PLANNED)}
    assert (seen["thread"] is not loop_thread) == blocking
    assert SharedOutcomeBox.blocking and not OutcomeBox.blocking


# ---- with the right secret everything works ---------------------------------------------------


def test_under_one_secret_books_features_and_outcomes_go_through(redis_server, name, tmp_path):
    a, b = replica(redis_server, name), replica(redis_server, name)
    a.insert(key(1), 10)
    b.pin(key(1))
    a.catch_up()
    assert a.state() == b.state() and a.get(key(1)).pinned
    assert a.status()["refused_events"] == b.status()["refused_events"] == 0
    a.save_snapshot()
    late = replica(redis_server, name)
    assert late.state() == a.state() and late.status()["refused_snapshots"] == 0
    features = SharedFeatureStore(redis_server, name=name, secret=SECRET)
    features.put(key(1), b"index-1", b"tokens-1")
    reader = SharedFeatureStore(redis_server, name=name, secret=SECRET)
    assert reader.index_record(key(1)) == b"index-1" and reader.tokens(key(1)) == b"tokens-1"
    assert list(reader.index_records()) == [(key(1), b"index-1")] and reader.refused == 0
    worker = outcome_box(tmp_path / "unused", redis_server, name=name, secret=SECRET)
    gateway = outcome_box(tmp_path / "unused", redis_server, name=name, secret=SECRET)
    worker.put("r1", {0: Outcome(PLANNED)})
    assert gateway.take("r1") == {0: Outcome(PLANNED)}


async def test_a_gateway_authenticates_what_it_shares_under_its_secret(redis_server, model_path, name, tmp_path):
    """The gateway's books, features and outcomes are all keyed by the deployment secret it is given."""
    from gateway.services import Services
    from store import StoreConfig
    from tests.conftest import gateway_config

    store = StoreConfig(name=name, tiers=("dram",), dram_dir=tmp_path / "dram", pin_host_memory=False,
                        outcomes_url=redis_server)
    services = Services.build(gateway_config(model_path, ["http://127.0.0.1:9"], store=store, books_url=redis_server,
                                             secret=SECRET))
    try:
        books, features, outcomes = services.policy, services.planner.matcher.features, services.outcomes
        assert isinstance(books, SharedBooks) and isinstance(features, SharedFeatureStore)
        assert isinstance(outcomes, SharedOutcomeBox)
        BookLog(redis_server, name=name, secret=SECRET).append(insert_event(key(1)))
        BookLog(redis_server, name=name).append(insert_event(key(2)))  # under the public key
        books.load()
        assert key(1) in books and key(2) not in books and books.status()["refused_events"] == 1
        SharedFeatureStore(redis_server, name=name, secret=SECRET).put(key(1), b"index-1", b"tokens-1")
        SharedFeatureStore(redis_server, name=name).put(key(2), b"index-2", b"tokens-2")
        assert features.index_record(key(1)) == b"index-1" and features.index_record(key(2)) is None
        SharedOutcomeBox(redis_server, name=name, secret=SECRET).put("r1", {0: Outcome(PLANNED)})
        SharedOutcomeBox(redis_server, name=name).put("r2", {0: Outcome(PLANNED)})
        assert outcomes.take("r1") == {0: Outcome(PLANNED)} and outcomes.take("r2") is None
    finally:
        await services.aclose()
