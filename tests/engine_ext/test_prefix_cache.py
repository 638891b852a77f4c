"""Private requests: K/V that no full prefill computes are kept out of SGLang's prefix cache (tests/e2e/test_reuse.py
shows it on a real worker: a moved hit's prompt again is executed again, not served its K/V)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from engine_ext.executor import prefix_cache
from engine_ext.executor.prefix_cache import PRIVATE, PrivateRequests


def request(rid: str) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, skip_radix_cache_insert=False)


def test_a_marked_request_is_withheld_once_and_flagged_as_sglang_flags_it() -> None:
    private = PrivateRequests()
    private.mark("a")
    assert "a" in private and "b" not in private
    other, mine = request("b"), request("a")
    assert not private.withheld(other) and not other.skip_radix_cache_insert
    assert private.withheld(mine) and mine.skip_radix_cache_insert
    assert "a" not in private and private.withheld_count == 1  # forgotten: the flag answers from now on
    assert private.withheld(mine) and private.withheld_count == 1


def test_marks_are_bounded_oldest_first_and_safe_across_threads() -> None:
    private = PrivateRequests(capacity=100)

    def mark(prefix: str) -> None:
        for i in range(500):
            private.mark(f"{prefix}{i}")

    threads = [threading.Thread(target=mark, args=(p,)) for p in "xyz"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(f"{p}{i}" in private for p in "xyz" for i in range(500)) == 100
    for i in range(150):
        private.mark(f"w{i}")
    assert [f"w{i}" in private for i in (0, 49, 50, 149)] == [False, False, True, True]


def test_sglangs_trees_are_wrapped_once_and_later_ones_too() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    prefix_cache.install()
    assert prefix_cache.install() == 0  # nothing left to wrap
    for tree in (RadixCache, UnifiedRadixCache):
        assert getattr(tree.checkpoint, "__revisit_private__", False)
        assert getattr(tree.on_release, "__revisit_private__", False)

    calls: list[tuple[str, object]] = []

    class LaterTree(RadixCache):  # a tree SGLang defines after the executor is made (a storage backend's)
        def checkpoint(self, req, *, up_to: int) -> None:
            calls.append(("inserted", req.rid))

        def on_release(self, req, *, checkpointed: bool) -> None:
            calls.append(("released", checkpointed))

    assert issubclass(LaterTree, BasePrefixCache)
    tree = object.__new__(LaterTree)
    plain, planned = request("plain-rid"), request("private-rid")
    PRIVATE.mark("private-rid")
    for req in (plain, planned):
        tree.checkpoint(req, up_to=8)
        tree.on_release(req, checkpointed=True)  # SGLang decided before asking the tree
    assert calls == [("inserted", "plain-rid"), ("released", True), ("released", False)]
    assert planned.skip_radix_cache_insert and not plain.skip_radix_cache_insert
