"""What workers report they ran (plan.outcome): the box both sides share, the worker's merge over chunks, and the
header the gateway builds from it."""

from __future__ import annotations

import os
import time

import pytest

from engine_ext.executor.events import ExecutionEvents, OutcomeLog
from gateway.planner import Planned
from plan import PUBLIC_PLAN_KEY, RequestPlan
from plan.outcome import EVERY_IMAGE, FULL_PREFILL, PLANNED, UNPLANNED, Outcome, OutcomeBox


def test_an_outcome_is_taken_once_and_what_nobody_took_is_swept(tmp_path) -> None:
    box = OutcomeBox(tmp_path / "outcomes")
    assert box.take("r1") is None  # nothing written
    box.put("r1", {1: Outcome(FULL_PREFILL, "entry_damaged"), 0: Outcome(PLANNED)})
    box.put("r1", {0: Outcome(PLANNED), 1: Outcome(PLANNED, "kv_read_failed")})  # a later chunk replaces it
    assert box.take("r1") == {0: Outcome(PLANNED), 1: Outcome(PLANNED, "kv_read_failed")}
    assert box.take("r1") is None
    box.put("old", {0: Outcome(PLANNED)})
    box.put("new", {0: Outcome(PLANNED)})
    past = time.time() - 3600
    os.utime(box.path / "old", (past, past))
    assert box.sweep(older_than_s=600) == 1 and box.take("new") is not None
    (box.path / "junk").write_text("{not json")
    assert box.take("junk") is None  # unreadable reads as unreported
    with pytest.raises(ValueError):
        box.put("../escape", {0: Outcome(PLANNED)})
    with pytest.raises(ValueError):
        Outcome("ran_somehow")
    with pytest.raises(ValueError):
        Outcome(FULL_PREFILL, "bad luck")


def test_the_worst_outcome_of_a_request_wins_over_its_chunks(tmp_path) -> None:
    box = OutcomeBox(tmp_path)
    log = OutcomeLog(lambda: box, ExecutionEvents())
    plan_rid = RequestPlan().to_rid("abc", key=PUBLIC_PLAN_KEY)
    assert RequestPlan.request_id(plan_rid) == "abc" and RequestPlan.request_id("chatcmpl-1") is None
    log.record(plan_rid, 0, Outcome(PLANNED))
    log.record(plan_rid, 0, Outcome(FULL_PREFILL, "kv_read_failed"))
    log.record(plan_rid, 0, Outcome(PLANNED, "vision_partial_failed"))  # a better one later does not hide it
    log.record(plan_rid, 1, Outcome(PLANNED))
    log.record(plan_rid, 1, Outcome(PLANNED, "kv_read_failed"))
    log.flush()
    assert box.take("abc") == {0: Outcome(FULL_PREFILL, "kv_read_failed"), 1: Outcome(PLANNED, "kv_read_failed")}
    log.flush()
    assert box.take("abc") is None  # only requests a forward touched are written


def test_the_reuse_header_says_what_ran() -> None:
    planned = Planned(plan=RequestPlan(), prefer=None, kinds=("exact_same_prefix", "approximate", "exact_moved"),
                      similarities=(None, 0.9731, None))
    assert planned.reuse_header() == "exact_same_prefix,approximate;similarity=0.9731,exact_moved"
    ran = {0: Outcome(FULL_PREFILL, "entry_damaged"), 1: Outcome(PLANNED, "vision_partial_failed"),
           2: Outcome(PLANNED)}
    assert planned.reuse_header(ran) == ("miss;planned=exact_same_prefix;fallback=entry_damaged,"
                                         "approximate;similarity=0.9731;degraded=vision_partial_failed,exact_moved")
    assert planned.fallbacks(ran) == [("exact_same_prefix", ran[0]), ("approximate", ran[1])]
    refused = {EVERY_IMAGE: Outcome(UNPLANNED, "plan_refused")}
    assert planned.reuse_header(refused).count("fallback=plan_refused") == 3


def test_a_video_patchs_fallback_is_reported_after_the_images() -> None:
    planned = Planned(plan=RequestPlan(), prefer=None, kinds=("exact_moved",), patch_kinds=(("exact", "miss"),
                                                                                          ("approximate",)))
    ran = {0: Outcome(PLANNED), 1: Outcome(FULL_PREFILL, "entry_missing"), 2: Outcome(PLANNED),
           3: Outcome(FULL_PREFILL, "entry_damaged")}
    assert planned.fallbacks(ran) == [("patch_exact", ran[1]), ("patch_approximate", ran[3])]
    assert planned.reuse_header(ran) == "exact_moved"  # the header names the images only


def test_across_hosts_outcomes_go_through_the_books_server_and_expire(redis_server, tmp_path) -> None:
    import redis

    from plan.outcome import SharedOutcomeBox, outcome_box

    box = outcome_box(tmp_path / "unused", redis_server, name="outcomes-test")
    assert isinstance(box, SharedOutcomeBox) and isinstance(outcome_box(tmp_path / "o"), OutcomeBox)
    other_host = SharedOutcomeBox(redis_server, name="outcomes-test", expire_s=1)  # a worker elsewhere
    other_host.put("r1", {0: Outcome(PLANNED), 1: Outcome(FULL_PREFILL, "entry_missing")})
    assert box.take("r1") == {0: Outcome(PLANNED), 1: Outcome(FULL_PREFILL, "entry_missing")}
    assert box.take("r1") is None  # taken once
    other_host.put("r2", {0: Outcome(PLANNED)})
    assert 0 < redis.Redis.from_url(redis_server).ttl(box.prefix + "r2") <= 1  # what nobody takes expires
    with pytest.raises(ValueError):
        box.put("../escape", {0: Outcome(PLANNED)})
    unreachable = SharedOutcomeBox("redis://127.0.0.1:1/0", name="x", timeout_s=0.2)
    assert unreachable.take("r1") is None  # unreported, not an error for the request
    with pytest.raises(OSError):
        unreachable.put("r1", {0: Outcome(PLANNED)})
