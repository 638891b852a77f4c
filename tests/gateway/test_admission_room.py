"""Declared bodies waiting for room in their key's budget (gateway/admission.py), on an event loop of their own: in
the key's order, withdrawn when cancelled, given back when room came as they were cancelled, and refused when the
whole gateway's budget has no room once theirs has. The budget is shared with the key's parses and decodings on
intake's pool (gateway/pools.py): each waits while the other fills it."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission import Admission, TooManyRequests
from gateway.config import AdmissionLimits
from gateway.pools import FairPool
from gateway.tenancy import Caller
from tests.gateway.test_pools import GatedJobs
from tests.waiting import until

A, B = Caller("a", "key-a", "scope-a"), Caller("b", "key-b", "scope-b")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_bodies_wait_for_room_in_their_keys_order_and_a_cancelled_one_is_withdrawn() -> None:
    async def main() -> None:
        admission = Admission(AdmissionLimits(max_body_bytes_per_key=100, max_body_bytes=150), max_request_bytes=100)
        first = admission.admit(A)
        await first.hold_declared(70, timeout_s=5)
        tickets = [admission.admit(A) for _ in range(3)]
        waits = [asyncio.ensure_future(ticket.hold_declared(size, timeout_s=5))
                 for ticket, size in zip(tickets, (50, 10, 20), strict=True)]
        await settle()
        # The 10 would fit beside the 70, but waits its turn behind the 50.
        assert [w.done() for w in waits] == [False, False, False]
        assert admission.stats()["waiting_for_room"] == 3
        waits[0].cancel()  # the 50 leaves: the next in line fit, in order
        await settle()
        assert waits[1].done() and waits[2].done() and admission.stats()["body_bytes"] == 100
        tickets[0].release()
        other = admission.admit(B)
        await other.hold_declared(40, timeout_s=5)  # another key is not held back by A's budget
        late = admission.admit(A)
        waiting = asyncio.ensure_future(late.hold_declared(30, timeout_s=5))
        await settle()
        assert not waiting.done()
        first.release()  # room for it
        await settle()
        assert waiting.done() and waiting.exception() is None and admission.stats()["body_bytes"] == 100
        for ticket in (*tickets[1:], other, late):
            ticket.release()
        assert admission.stats() == {"requests": 0, "body_bytes": 0, "keys": 0, "waiting_for_room": 0,
                                     "waited": 4, "refused": {}}

    asyncio.run(main())


def test_a_body_given_room_the_whole_gateway_has_not_is_refused_then() -> None:
    async def main() -> None:
        admission = Admission(AdmissionLimits(max_body_bytes_per_key=100, max_body_bytes=100), max_request_bytes=100)
        held = admission.admit(A)
        await held.hold_declared(50, timeout_s=5)
        waiting = asyncio.ensure_future(admission.admit(A).hold_declared(60, timeout_s=5))
        await settle()
        await admission.admit(B).hold_declared(50, timeout_s=5)  # the gateway's budget is full
        held.release()  # room in A's budget, none in the gateway's: 50 + 60 > 100
        with pytest.raises(TooManyRequests):
            await waiting
        assert admission.stats()["refused"] == {"body_bytes": 1} and admission.stats()["waiting_for_room"] == 0

    asyncio.run(main())


def test_room_that_came_as_the_request_was_cancelled_is_given_back() -> None:
    async def main() -> None:
        admission = Admission(AdmissionLimits(max_body_bytes_per_key=100), max_request_bytes=100)
        held = admission.admit(A)
        await held.hold_declared(90, timeout_s=5)
        waiting = asyncio.ensure_future(admission.admit(A).hold_declared(50, timeout_s=5))
        await settle()
        held.release()  # room is taken for the waiter ...
        waiting.cancel()  # ... as its request is cancelled, before it ran
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert admission.stats()["body_bytes"] == 0

    asyncio.run(main())


def test_no_room_within_the_wait_is_a_429() -> None:
    async def main() -> None:
        admission = Admission(AdmissionLimits(max_body_bytes_per_key=100), max_request_bytes=100)
        await admission.admit(A).hold_declared(90, timeout_s=5)
        with pytest.raises(TooManyRequests, match="waited"):
            await admission.admit(A).hold_declared(50, timeout_s=0.05)
        await admission.admit(B).hold_declared(100, timeout_s=0.05)  # another key is not held back
        assert admission.stats()["refused"] == {"body_bytes_per_key": 1} and admission.stats()["waiting_for_room"] == 0

    asyncio.run(main())


def test_a_keys_body_waits_while_its_parse_or_decoding_fills_the_keys_budget() -> None:
    """What one key holds at once is its bodies and its jobs on the pool together: a 50 MB body as parsed (the body
    and its parse) is not in memory beside the key's next body."""
    async def main() -> None:
        admission = Admission(AdmissionLimits(max_body_bytes_per_key=100), max_request_bytes=100)
        pool = FairPool(2, caller_cost_budget=100)
        admission.share_budget_with(pool)
        jobs = GatedJobs("parse")
        try:
            held = admission.admit(A)
            await held.hold_declared(50, timeout_s=5)
            parse = asyncio.ensure_future(pool.run_costing(A.key_id, 50, jobs.job, "parse"))  # the body's parse
            await until(lambda: jobs.started == ["parse"], jobs.started)  # alone among A's jobs: it starts
            held.release()  # its request has ended (a 400 after the parse, say), the parse is still running
            waiting = asyncio.ensure_future(admission.admit(A).hold_declared(60, timeout_s=5))
            await settle()
            assert not waiting.done() and admission.stats()["waiting_for_room"] == 1  # 50 in the pool + 60 > 100
            await admission.admit(B).hold_declared(60, timeout_s=5)  # another key's budget is its own
            jobs.gates["parse"].set()  # the parse ends: its cost is no longer counted, and A's body is taken
            assert await parse == "parse"
            await asyncio.wait_for(waiting, 5)
            assert admission.held_bytes(A.key_id) == 60 and pool.cost_running(A.key_id) == 0
        finally:
            jobs.open_all()
            await pool.aclose()

    asyncio.run(main())


def test_a_keys_parse_or_decoding_waits_while_its_bodies_and_jobs_fill_the_keys_budget() -> None:
    async def main() -> None:
        admission = Admission(AdmissionLimits(max_body_bytes_per_key=100), max_request_bytes=100)
        pool = FairPool(3, caller_cost_budget=100)
        admission.share_budget_with(pool)
        jobs = GatedJobs("first", "second", "b")
        try:
            bodies = admission.admit(A)
            await bodies.hold_declared(60, timeout_s=5)
            first = asyncio.ensure_future(pool.run_costing(A.key_id, 20, jobs.job, "first"))
            await until(lambda: jobs.started == ["first"], jobs.started)
            # 60 of bodies + 20 running + 30 > 100: waits, while another key's job starts beside
            second = asyncio.ensure_future(pool.run_costing(A.key_id, 30, jobs.job, "second"))
            b = asyncio.ensure_future(pool.run_costing(B.key_id, 90, jobs.job, "b"))
            await until(lambda: jobs.started == ["first", "b"] and pool.queued(A.key_id) == 1, jobs.started)
            bodies.release()  # A's bodies are let go: 20 + 30 fit
            await until(lambda: jobs.started == ["first", "b", "second"], jobs.started)
            jobs.open_all()
            assert await asyncio.gather(first, second, b) == ["first", "second", "b"]
        finally:
            jobs.open_all()
            await pool.aclose()

    asyncio.run(main())
