"""The feature store: records beside the KV entries, kept across reopening, growing its map as it fills."""

from __future__ import annotations

import pytest

from store import FeatureStore, StoreClosedError
from tests.store.entries import key_for


def test_records_round_trip_and_survive_reopening(tmp_path) -> None:
    path = tmp_path / "features"
    with FeatureStore(path) as store:
        store.put(key_for(1), b"index-1", b"tokens-1")
        store.put(key_for(2), b"index-2", b"tokens-2")
        store.put(key_for(1), b"index-1b", b"tokens-1b")  # replaced
        assert store.tokens(key_for(1)) == b"tokens-1b" and store.index_record(key_for(2)) == b"index-2"
        assert store.remove(key_for(2)) and not store.remove(key_for(2)) and store.tokens(key_for(2)) is None
    with FeatureStore(path) as store:
        assert dict(store.index_records()) == {key_for(1): b"index-1b"} and len(store) == 1
    with pytest.raises(StoreClosedError):
        store.tokens(key_for(1))


def test_the_map_grows_when_full(tmp_path) -> None:
    with FeatureStore(tmp_path / "features", map_size=64 << 10) as store:
        for i in range(40):
            store.put(key_for(i), b"i", bytes([i]) * (16 << 10))  # 640 KiB into a 64 KiB map
        assert len(store) == 40 and store.tokens(key_for(39)) == bytes([39]) * (16 << 10)
