"""The index and the matcher: namespaces apart, coarse and sketch candidates, the HNSW graph past the scan limit,
features persisted beside the store and the index rebuilt from them."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from gateway.config import MatchSettings
from gateway.matching.index import SKETCH, CoarseTable, IndexRecord, MatchIndex, OutdatedRecord, SketchTable
from gateway.matching.matcher import Matcher
from store import FeatureStore
from tests.gateway.matching.pairs import CELL, aligned, edited, features, jpeg

NAMES = ("astronaut.png", "coffee.png", "chelsea.png", "page.png", "text.png", "camera.png", "rocket.jpg")


def key(label: object) -> str:
    return hashlib.sha256(str(label).encode()).hexdigest()


@pytest.fixture
def feature_store(tmp_path):
    with FeatureStore(tmp_path / "features") as store:
        yield store


def matcher(feature_store, **settings) -> Matcher:
    return Matcher(MatchSettings(**settings), scope="test-scope", features=feature_store)


def test_a_near_duplicate_is_found_in_its_namespace_only(feature_store) -> None:
    m = matcher(feature_store)
    for name in NAMES:
        m.add(key(name), "tenant-a", features(aligned(name, 10, 12)))
    query = features(jpeg(aligned("chelsea.png", 10, 12)))
    found = m.lookup("tenant-a", key("query"), query)
    assert [match.alias for match in found.matches] == [key("chelsea.png")]
    assert found.matches[0].alignment.similarity > 0.98
    other = m.lookup("tenant-b", key("query"), query)
    assert other.matches == () and other.candidates == 0 and not other.near_miss


def test_an_image_looked_up_then_added_is_indexed_under_the_lookups_record(feature_store) -> None:
    """The planner adds a missed image with the record its lookup made (the regional descriptor is computed once);
    a record of another key or namespace is not taken for it."""
    m = matcher(feature_store)
    m.add(key("astronaut.png"), "ns", features(aligned("astronaut.png", 8, 8)))
    query = features(aligned("camera.png", 8, 8))
    found = m.lookup("ns", key("camera.png"), query)
    assert found.query.key == key("camera.png") and found.query.namespace == "ns"
    m.add(key("camera.png"), "ns", query, found.query)
    assert m.index.get(key("camera.png")).added_at == found.query.added_at
    assert [match.alias for match in m.lookup("ns", key("again"), query).matches] == [key("camera.png")]
    m.add(key("other"), "ns", query, found.query)  # not its record: made afresh
    assert m.index.get(key("other")) is not None and m.index.get(key("other")).added_at >= found.query.added_at


def test_an_unrelated_image_is_a_miss_and_a_close_call_a_near_miss(feature_store) -> None:
    m = matcher(feature_store, coarse_threshold=0.0)  # let every same-grid entry reach the fine stage
    for name in NAMES[:3]:
        m.add(key(name), "ns", features(aligned(name, 8, 8)))
    found = m.lookup("ns", key("q"), features(aligned("camera.png", 8, 8)))
    assert found.matches == () and found.near_miss and found.best_similarity is not None
    assert found.best_similarity < 0.5


def test_sketch_candidates_cross_grids(feature_store) -> None:
    m = matcher(feature_store)
    big = aligned("coffee.png", 12, 16)
    m.add(key("big"), "ns", features(big))
    crop = big.crop((3 * CELL, 2 * CELL, 13 * CELL, 10 * CELL))  # a (8, 10) grid
    found = m.lookup("ns", key("crop"), features(crop))
    assert [match.alias for match in found.matches] == [key("big")]
    assert found.matches[0].alignment.shift == (-2, -3)


def test_removed_entries_are_not_found_and_their_records_are_gone(feature_store) -> None:
    m = matcher(feature_store)
    page = aligned("page.png", 8, 12)
    m.add(key("page"), "ns", features(page))
    m.remove(key("page"))
    assert m.lookup("ns", key("q"), features(edited(page, (30, 30, 80, 50)))).matches == ()
    assert len(feature_store) == 0 and feature_store.tokens(key("page")) is None


def test_the_index_is_rebuilt_from_the_feature_store(tmp_path) -> None:
    path = tmp_path / "features"
    page = aligned("page.png", 8, 12)
    with FeatureStore(path) as store:
        first = matcher(store)
        first.add(key("kept"), "ns", features(page))
        first.add(key("lost"), "ns", features(aligned("camera.png", 8, 12)))
        store.put(key("damaged"), b"not a record", b"")
        store.put(key("other-model"), IndexRecord.of(key("other-model"), "ns", "another-scope",
                                                     features(page), blank_entropy=0.5).to_bytes(), b"")
    with FeatureStore(path) as store:
        restarted = matcher(store, pending_grace_s=0)  # nothing is still on its way into the store
        indexed = restarted.rebuild(stored=lambda k: k == key("kept"))
        assert indexed == 1 and restarted.damaged_records == 1
        found = restarted.lookup("ns", key("q"), features(edited(page, (30, 30, 80, 50))))
        assert [match.alias for match in found.matches] == [key("kept")]
        # the orphan's and the damaged records are dropped; another scope's is not ours to drop
        assert store.index_record(key("lost")) is None and store.index_record(key("damaged")) is None
        assert store.index_record(key("other-model")) is not None


def test_an_index_record_of_version_1_is_made_again_from_the_token_features(tmp_path) -> None:
    """Records written before the regional descriptors were of the token layouts: the image stays an alias after
    the upgrade, indexed again from its token features and persisted so (another scope's is left as it is)."""
    path = tmp_path / "features"
    page = aligned("page.png", 8, 12)
    with FeatureStore(path) as store:
        for name, scope in (("old", "test-scope"), ("other", "another-scope")):
            record = IndexRecord.of(key(name), "ns", scope, features(page), blank_entropy=0.5)
            old = bytearray(record.to_bytes())
            old[0] = 1  # the version byte
            store.put(key(name), bytes(old), features(page).to_bytes())
        with pytest.raises(OutdatedRecord):
            IndexRecord.from_bytes(key("old"), store.index_record(key("old")))  # type: ignore[arg-type]
    with FeatureStore(path) as store:
        restarted = matcher(store)
        assert restarted.rebuild(stored=lambda k: True) == 1 and restarted.damaged_records == 0
        found = restarted.lookup("ns", key("q"), features(edited(page, (30, 30, 80, 50))))
        assert [match.alias for match in found.matches] == [key("old")]
        again = IndexRecord.from_bytes(key("old"), store.index_record(key("old")))  # type: ignore[arg-type]
        assert np.allclose(again.regional, features(page).regional())
        assert store.index_record(key("other"))[0] == 1  # type: ignore[index]


def test_a_damaged_token_record_is_dropped_not_matched(feature_store) -> None:
    m = matcher(feature_store, feature_cache_bytes=0)  # every lookup reads the store
    page = aligned("page.png", 8, 12)
    m.add(key("page"), "ns", features(page))
    record = feature_store.index_record(key("page"))
    assert record is not None
    feature_store.put(key("page"), record, b"garbage")
    found = m.lookup("ns", key("q"), features(edited(page, (30, 30, 80, 50))))
    assert found.matches == () and m.damaged_records == 1 and key("page") not in m.index


def test_the_hnsw_graph_finds_what_the_scan_finds() -> None:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3000, 4, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=2, keepdims=True)
    scan, graph = CoarseTable(16, scan_limit=10_000), CoarseTable(16, scan_limit=100)
    for i, regional in enumerate(vectors):
        scan.add(key(i), regional)
        graph.add(key(i), regional)
    assert graph.uses_graph and not scan.uses_graph and len(graph) == len(scan) == 3000
    agree = 0
    for i in range(0, 3000, 60):
        query = vectors[i] + 0.05 * rng.standard_normal((4, 16)).astype(np.float32)
        query /= np.linalg.norm(query, axis=1, keepdims=True)
        expected = scan.search(query, threshold=0.5, count=5)
        got = graph.search(query, threshold=0.5, count=5)
        assert expected and expected[0][0] == key(i)
        agree += bool(got) and got[0][0] == expected[0][0]
    assert agree >= 48  # of 50: an approximate graph may miss a rare one
    assert graph.remove(key(0)) and not graph.remove(key(0)) and len(graph) == 2999
    assert all(k != key(0) for k, _ in graph.search(vectors[0], threshold=0.0, count=5))


def test_index_records_round_trip() -> None:
    f = features(aligned("rocket.jpg", 6, 8))
    record = IndexRecord.of(key("r"), "ns", "scope", f, blank_entropy=0.5)
    back = IndexRecord.from_bytes(key("r"), record.to_bytes())
    assert (back.namespace, back.scope, back.grid, back.sketch) == ("ns", "scope", (6, 8), record.sketch)
    assert np.allclose(back.regional, record.regional) and 0 < len(record.sketch) <= SKETCH
    with pytest.raises(ValueError):
        IndexRecord.from_bytes(key("r"), record.to_bytes()[:20])
    index = MatchIndex(coarse_threshold=0.8, candidates=5, scan_limit=10)
    index.add(record)
    assert key("r") in index and index.remove(key("r")) and len(index) == 0 and not index.remove(key("r"))


def test_the_sketch_table_counts_shared_digests_of_live_entries_only() -> None:
    table = SketchTable()
    rng = np.random.default_rng(1)
    sketches = [tuple(int(d) for d in rng.integers(1, 2**63, 32)) for _ in range(600)]  # past one merge
    ids = [table.add(key(i), sketch) for i, sketch in enumerate(sketches)]
    query = sketches[7][:10] + sketches[500][:3]
    votes = table.votes(query)
    assert votes[key(7)] == 10 and votes[key(500)] == 3 and len(votes) == 2
    for ident in ids[:400]:  # more removed than live: a compaction runs
        table.remove(ident)
    assert len(table) == 200 and table.votes(query) == {key(500): 3}
    table.add(key("late"), sketches[7])
    assert table.votes(query) == {key(500): 3, key("late"): 10}
