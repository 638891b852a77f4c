"""Private requests: K/V that no full prefill computes are kept out of SGLang's prefix cache (tests/e2e/test_reuse.py
shows it on a real worker: a moved hit's prompt again is executed again, not served its K/V)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from engine_ext.executor import prefix_cache
from engine_ext.executor.prefix_cache import PRIVATE, PrivateRequests


def request(rid: str, held: int = 0) -> SimpleNamespace:
    """A request as SGLang's trees see it: its id, SGLang's flag, and the rows its tree holds for it."""
    return SimpleNamespace(rid=rid, skip_radix_cache_insert=False, kv=SimpleNamespace(cache_protected_len=held))


def test_a_marked_request_inserts_only_its_exact_rows_once_and_is_flagged_as_sglang_flags_it() -> None:
    private = PrivateRequests()
    private.mark("a", exact_until=40)
    private.mark("a", exact_until=60)  # a later image: the first one's row counts
    assert "a" in private and "b" not in private
    other, mine = request("b"), request("a", held=16)
    assert private.insertable(other, 100) == 100 and not other.skip_radix_cache_insert
    assert private.insertable(mine, 100) == 40 and mine.skip_radix_cache_insert  # the text before the image
    assert "a" not in private and private.withheld_count == 1  # forgotten: the flag answers from now on
    assert private.insertable(mine, 120) is None and private.withheld_count == 1
    # Nothing new before the image (the tree holds it already), or an insert asked before it: nothing past it.
    private.mark("c", exact_until=16)
    assert private.insertable(request("c", held=16), 100) is None
    private.mark("d", exact_until=40)
    assert private.insertable(request("d", held=0), 30) == 30
    # A request SGLang does not say the tree's share of: nothing inserted rather than a guess.
    private.mark("e", exact_until=40)
    assert private.insertable(SimpleNamespace(rid="e", skip_radix_cache_insert=False), 100) is None


def test_marks_are_bounded_oldest_first_and_safe_across_threads() -> None:
    private = PrivateRequests(capacity=100)

    def mark(prefix: str) -> None:
        for i in range(500):
            private.mark(f"{prefix}{i}", exact_until=i)

    threads = [threading.Thread(target=mark, args=(p,)) for p in "xyz"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(f"{p}{i}" in private for p in "xyz" for i in range(500)) == 100
    for i in range(150):
        private.mark(f"w{i}", exact_until=i)
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
            calls.append(("inserted", req.rid, up_to))

        def on_release(self, req, *, checkpointed: bool) -> None:
            calls.append(("released", req.rid, checkpointed))

    assert issubclass(LaterTree, BasePrefixCache)
    tree = object.__new__(LaterTree)
    plain, text_first, image_first = request("plain-rid"), request("text-first-rid"), request("image-first-rid", 8)
    PRIVATE.mark("text-first-rid", exact_until=20)
    PRIVATE.mark("image-first-rid", exact_until=8)
    for req in (plain, text_first, image_first):
        tree.checkpoint(req, up_to=64)
        tree.on_release(req, checkpointed=True)  # SGLang decided before asking the tree
    assert calls == [("inserted", "plain-rid", 64), ("released", "plain-rid", True),
                     ("inserted", "text-first-rid", 20), ("released", "text-first-rid", True),
                     ("released", "image-first-rid", False)]
    assert text_first.skip_radix_cache_insert and image_first.skip_radix_cache_insert
    assert not plain.skip_radix_cache_insert
