"""Declared bodies waiting for room in their key's budget (gateway/admission.py), on an event loop of their own: in
the key's order, withdrawn when cancelled, given back when room came as they were cancelled, and refused when the
whole gateway's budget has no room once theirs has."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission import Admission, TooManyRequests
from gateway.config import AdmissionLimits
from gateway.tenancy import Caller

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
