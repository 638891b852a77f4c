"""Books shared by gateway replicas through a real Redis server: every replica ends with the books one policy would
have after the same calls in log order; errors are everyone's; snapshots, trimming, late joiners, the index."""

from __future__ import annotations

import random
import uuid

import pytest

from gateway.books import BookLog, BooksMismatch, BooksUnavailable, SharedBooks, SharedFeatureStore
from gateway.books import shared as shared_module
from gateway.config import PolicySettings
from gateway.policy import CachePolicy, EntryPinned, PresetPriors, Tier, UnknownEntry
from tests.conftest import free_port
from tests.policy.helpers import key
from tests.waiting import wait_until

SETTINGS = PolicySettings(dram_capacity_bytes=100, lmdb_capacity_bytes=300, preset_fraction=0.2,
                          preset_min_score=0.5, preset_reuse_weight=0.5)


@pytest.fixture
def name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def replica(url: str, name: str, settings: PolicySettings = SETTINGS) -> SharedBooks:
    books = SharedBooks(settings, BookLog(url, name=name), tiers=("dram", "lmdb"))
    books.load()
    return books


def random_calls(books: list[SharedBooks], rng: random.Random, count: int) -> None:
    for _ in range(count):
        books_ = rng.choice(books)
        k = key(rng.randrange(40))
        call = rng.random()
        try:
            if call < 0.4:
                books_.insert(k, rng.choice((10, 20, 30)), family=rng.choice((None, "docs")))
            elif call < 0.7:
                books_.record_exact_hit(k)
            elif call < 0.8:
                books_.record_approximate_hit(k)
            elif call < 0.85:
                books_.pin(k)
            elif call < 0.9:
                books_.unpin(k)
            elif call < 0.97:
                books_.remove(k)
            else:
                books_.restore(k, 10, Tier.LMDB)
        except (UnknownEntry, EntryPinned):
            pass


def test_replicas_end_with_the_books_of_one_policy_replaying_the_log(redis_server, name):
    a, b = replica(redis_server, name), replica(redis_server, name)
    random_calls([a, b], random.Random(7), 400)
    a.set_priors(PresetPriors(families={"docs": 2.0}))
    # One plain policy fed the same calls in log order decides exactly the same (read before a catch-up snapshots
    # the books and trims the log).
    reference = CachePolicy(SETTINGS, tiers=("dram", "lmdb"))
    for _, event in BookLog(redis_server, name=name).after("0-0", count=10_000).events:
        try:
            SharedBooks._apply(reference, event)  # type: ignore[arg-type]
        except (UnknownEntry, EntryPinned):
            pass
    a.catch_up()
    b.catch_up()
    assert a.state() == b.state()
    assert reference.state()["entries"] == a.state()["entries"]
    stats = a.stats()
    assert stats.tiers["dram"].bytes <= 100 and stats.tiers["lmdb"].bytes <= 300
    assert stats == b.stats()


def test_a_change_returns_the_decisions_it_yields_and_errors_are_everyones(redis_server, name):
    a, b = replica(redis_server, name), replica(redis_server, name)
    decisions = a.insert(key(1), 10)
    assert [d.kind for d in decisions] == ["admit"]
    assert b.catch_up() == 1 and key(1) in b
    with pytest.raises(UnknownEntry):
        b.record_exact_hit(key(2))
    a.pin(key(1))
    with pytest.raises(EntryPinned):
        b.remove(key(1))
    a.catch_up()
    assert a.state() == b.state() and a.get(key(1)).pinned


def test_a_late_replica_joins_from_the_snapshot_and_the_events_after_it(redis_server, name, monkeypatch):
    monkeypatch.setattr(shared_module, "SNAPSHOT_EVERY", 50)
    a = replica(redis_server, name)
    random_calls([a], random.Random(3), 120)
    a.catch_up()  # past 50 events since its last snapshot: it saves one and trims the log
    assert a.log.snapshot() is not None and a.log.length() < a.applied
    random_calls([a], random.Random(4), 30)
    late = replica(redis_server, name)
    assert late.state() == a.state()


def test_a_replica_left_behind_by_a_trim_reloads_the_snapshot(redis_server, name, monkeypatch):
    monkeypatch.setattr(shared_module, "SNAPSHOT_EVERY", 20)
    a, behind = replica(redis_server, name), replica(redis_server, name)
    random_calls([a], random.Random(5), 80)
    a.catch_up()
    assert a.log.after(behind.cursor).trimmed  # events it has not applied were trimmed away
    behind.catch_up()
    assert behind.state() == a.state() and behind.status()["snapshot_reloads"] == 2


def test_replicas_with_other_settings_refuse_to_join(redis_server, name):
    replica(redis_server, name)
    with pytest.raises(BooksMismatch, match="other settings"):
        replica(redis_server, name, PolicySettings(dram_capacity_bytes=999))


def test_index_events_reach_the_other_replicas(redis_server, name):
    a, b = replica(redis_server, name), replica(redis_server, name)
    learned, forgotten = [], []
    b.learn, b.forget = learned.append, forgotten.append
    a.announce_indexed(key(5))
    a.announce_forgotten(key(5))
    b.catch_up()
    assert (learned, forgotten) == ([key(5)], [key(5)])


def test_the_shared_feature_store_round_trips(redis_server, name):
    features = SharedFeatureStore(redis_server, name=name)
    features.put(key(1), b"index-1", b"tokens-1")
    features.put(key(2), b"index-2", b"tokens-2")
    assert features.tokens(key(1)) == b"tokens-1" and features.index_record(key(2)) == b"index-2"
    assert sorted(features.index_records()) == [(key(1), b"index-1"), (key(2), b"index-2")] and len(features) == 2
    assert features.remove(key(1)) and not features.remove(key(1))
    assert features.tokens(key(1)) is None and len(features) == 1
    features.close()


def test_an_unreachable_server_is_books_unavailable(name):
    books = SharedBooks(SETTINGS, BookLog(f"redis://127.0.0.1:{free_port()}/0", name=name, timeout_s=0.5),
                        tiers=("dram", "lmdb"))
    with pytest.raises(BooksUnavailable):
        books.load()
    with pytest.raises(BooksUnavailable):
        books.insert(key(1), 10)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the start that must fail
def test_a_gateway_joins_the_books_at_start_and_answers_503_when_their_server_goes(tmp_path, model_path, name):
    """A real gateway app over a DRAM store with shared books: a second replica sees the first one's entry; with
    the server gone, an admin change is a 503 and the gateway stays up; a gateway cannot start without it."""
    import httpx

    from gateway.config import GatewayConfig
    from store import StoreConfig
    from tests.conftest import gateway_config, run_gateway, start_redis, terminate

    redis_process, url = start_redis(tmp_path)
    store = StoreConfig(name=name, tiers=("dram",), dram_dir=tmp_path / "dram", pin_host_memory=False)

    def replica(books_url: str) -> GatewayConfig:
        return gateway_config(model_path, ["http://127.0.0.1:9"], store=store, admin_token="admin-token-books",
                              books_url=books_url, books_follow_interval_s=0.05)

    auth = {"Authorization": "Bearer admin-token-books"}
    one, two = run_gateway(replica(url)), run_gateway(replica(url))
    try:
        cache = one.app.state.services.cache  # an entry taken in as the planner does: on one replica's cache thread
        cache._thread.submit(cache.policy.insert, key(1), 100).result()
        wait_until(lambda: httpx.get(two.url + "/admin/entries", headers=auth).json()["data"],
                   "the second replica to see the entry", timeout=10)
        stats = httpx.get(two.url + "/admin/stats", headers=auth).json()
        assert stats["books"]["shared"] is True and stats["tiers"]["dram"]["entries"] == 1
        terminate(redis_process)
        gone = httpx.delete(two.url + f"/admin/entries/{key(1)}", headers=auth)
        assert gone.status_code == 503 and gone.json()["error"]["code"] == "store_unavailable"
        assert httpx.get(two.url + "/admin/stats", headers=auth).status_code == 200  # reads its own books
    finally:
        one.stop()
        two.stop()
        if redis_process.poll() is None:
            terminate(redis_process)
    with pytest.raises(RuntimeError, match="did not start"):
        run_gateway(replica(url))


def test_books_outlive_a_server_that_lost_its_data(redis_server, name):
    """The server restarted without its append-only file: the replicas' books are kept, a snapshot of them is saved
    at the next catch-up, and a replica that joins afterwards starts where the others are."""
    import redis

    a, b = replica(redis_server, name), replica(redis_server, name)
    random_calls([a, b], random.Random(9), 60)
    a.catch_up()
    b.catch_up()
    server = redis.Redis.from_url(redis_server)
    for found in server.scan_iter(match=f"revisit:{name}:*"):
        server.delete(found)  # what a restart without persistence leaves
    a.catch_up()
    assert a.log.snapshot() is not None
    b.insert(key(99), 10)
    a.catch_up()
    late = replica(redis_server, name)
    assert late.state() == a.state() == b.state() and key(99) in late
