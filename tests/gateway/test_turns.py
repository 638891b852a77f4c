"""Each key's turns at the workers (gateway/turns.py), on an event loop of their own."""

from __future__ import annotations

import asyncio

import pytest

from gateway import turns as turns_module
from gateway.turns import ACCELERATOR_PER_KEY, CPU_PER_KEY, WorkerTurns


async def started(turns: WorkerTurns, key: str, count: int) -> tuple[list[asyncio.Task], list]:
    """``count`` requests of ``key`` asking for a turn, and the list their give-backs land in as they get one."""
    given: list = []

    async def one(i: int) -> None:
        given.append((i, await turns.take(key)))

    tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
    for _ in range(3):
        await asyncio.sleep(0)
    return tasks, given


async def until(condition, timeout: float = 5.0) -> None:
    """Yield to the loop until ``condition()`` holds (a pace's timer has fired), for ``timeout`` at most."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


async def contended(turns: WorkerTurns):
    """Keys a and b with one request each at the workers (a share of one), and two more of a's waiting."""
    _, a_given = await started(turns, "a", 1)
    _, b_given = await started(turns, "b", 1)
    waiting, waiting_given = await started(turns, "a", 2)
    return a_given, b_given, waiting, waiting_given


def test_one_key_alone_is_not_held_back():
    async def main() -> None:
        turns = WorkerTurns(per_key=2)
        _, given = await started(turns, "a", 10)
        assert len(given) == 10 and turns.stats()["waiting"] == 0

    asyncio.run(main())


def test_a_second_key_goes_at_once_and_the_first_waits_until_it_is_under_its_share():
    async def main() -> None:
        turns = WorkerTurns(per_key=2)
        _, a_given = await started(turns, "a", 5)  # alone: all five go
        _, b_given = await started(turns, "b", 1)
        assert len(b_given) == 1
        more_a, more_given = await started(turns, "a", 2)
        assert more_given == [] and turns.stats()["waiting"] == 2
        for _, give_back in a_given[:3]:  # a is back to 2 at the workers: still at its share
            give_back()
        await asyncio.sleep(0)
        assert more_given == []
        a_given[3][1]()  # now 1: the first of its waiting requests goes, in order
        await asyncio.sleep(0)
        assert [i for i, _ in more_given] == [0]
        b_given[0][1]()  # b leaves: a is alone again and not held back
        await asyncio.sleep(0)
        assert [i for i, _ in more_given] == [0, 1] and turns.stats()["waiting"] == 0
        await asyncio.gather(*more_a)

    asyncio.run(main())


def test_a_cancelled_wait_is_withdrawn_and_a_turn_given_back_twice_counts_once():
    async def main() -> None:
        turns = WorkerTurns(per_key=1)
        a_given, b_given, waiting, waiting_given = await contended(turns)
        waiting[0].cancel()
        await asyncio.sleep(0)
        assert turns.stats()["waiting"] == 1
        a_given[0][1]()
        a_given[0][1]()  # a second call changes nothing
        await asyncio.sleep(0)
        assert [i for i, _ in waiting_given] == [1] and turns.stats()["at_workers"] == 2
        b_given[0][1]()
        waiting_given[0][1]()
        assert turns.stats() == {"per_key": 1, "per_key_by": "setting", "at_workers": 0, "keys": 0, "waiting": 0,
                                 "waited": 2, "paced": False, "paced_out": 0}
        _, again = await started(turns, "b", 3)  # nothing of a's is left counted: b alone is not held back
        assert len(again) == 3

    asyncio.run(main())


def test_a_turn_that_came_as_its_request_was_cancelled_is_handed_on():
    async def main() -> None:
        turns = WorkerTurns(per_key=1)
        a_given, b_given, waiting, waiting_given = await contended(turns)
        a_given[0][1]()  # the first waiter's turn is granted ...
        waiting[0].cancel()  # ... and its request is cancelled before it runs: the turn goes to the next
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [i for i, _ in waiting_given] == [1]
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
        for _, give_back in (*b_given, *waiting_given):  # b and a's last leave: a has nothing left counted
            give_back()
        _, again = await started(turns, "a", 3)
        assert len(again) == 3

    asyncio.run(main())


def test_per_key_must_be_positive():
    with pytest.raises(ValueError):
        WorkerTurns(per_key=0)


def test_unset_the_bound_follows_the_workers_devices():
    async def main() -> None:
        turns = WorkerTurns()
        assert turns.per_key == ACCELERATOR_PER_KEY and turns.stats()["per_key_by"] == "devices:unknown"
        _, a_given = await started(turns, "a", CPU_PER_KEY + 1)
        _, b_given = await started(turns, "b", 1)
        more_a, more_given = await started(turns, "a", 1)
        assert len(more_given) == 1  # under the accelerators' bound
        turns.workers_run_on(["cpu", "cpu"])  # every worker is a CPU worker: a is past its share and waits
        assert turns.per_key == CPU_PER_KEY and turns.stats()["per_key_by"] == "devices:cpu"
        waiting, waiting_given = await started(turns, "a", 1)
        assert waiting_given == [] and turns.stats()["waiting"] == 1
        turns.workers_run_on(["cpu", "cuda"])  # a GPU worker joins: the bound rises and a's waiting one goes
        await asyncio.sleep(0)
        assert turns.per_key == ACCELERATOR_PER_KEY and len(waiting_given) == 1
        await asyncio.gather(*more_a, *waiting)

    asyncio.run(main())


def test_a_bound_set_is_kept_whatever_the_devices():
    turns = WorkerTurns(per_key=4)
    turns.workers_run_on(["cpu"])
    assert turns.per_key == 4 and turns.stats()["per_key_by"] == "setting"


def test_on_cpu_workers_a_backlogged_key_sends_at_its_pace(monkeypatch):
    """Paced: key x, past its share while key t (not past it) has a request at the workers, sends no more of its
    waiting requests than its share per PACE_S, not each time one of its own ends; t itself is never paced."""
    monkeypatch.setattr(turns_module, "PACE_S", 0.3)
    monkeypatch.setattr(turns_module, "RECENT_S", 0.2)

    async def main() -> None:
        turns = WorkerTurns(per_key=2)
        turns.workers_run_on(["cpu"])
        assert turns.stats()["paced"]
        _, t_given = await started(turns, "t", 1)
        _, x_given = await started(turns, "x", 2)  # under its share: at once
        waiting, waiting_given = await started(turns, "x", 6)
        assert len(x_given) == 2 and waiting_given == []
        for _, give_back in x_given:  # x's two end: two of its waiting ones go at once
            give_back()
        await asyncio.sleep(0)
        assert len(waiting_given) == 2 and turns.stats()["paced_out"] == 2
        for _, give_back in waiting_given[:2]:  # those end at once too: the next wait for the pace
            give_back()
        await asyncio.sleep(0)
        assert len(waiting_given) == 2
        _, t_more = await started(turns, "t", 1)  # t is not paced
        assert len(t_more) == 1
        await until(lambda: len(waiting_given) > 2)  # the next two go when the pace's window has passed
        assert len(waiting_given) == 4 and turns.stats()["paced_out"] == 4
        for _, give_back in (*t_given, *t_more):  # t leaves: once RECENT_S has passed, x is alone and unpaced
            give_back()
        await until(lambda: len(waiting_given) == 6)
        await asyncio.gather(*waiting)

    asyncio.run(main())


def test_a_key_a_little_past_its_share_is_not_paced(monkeypatch):
    """One request waiting (fewer than its share) is a key with a few clients, not a flood: it goes as its own end."""
    monkeypatch.setattr(turns_module, "PACE_S", 60.0)

    async def main() -> None:
        turns = WorkerTurns(per_key=2)
        turns.workers_run_on(["cpu"])
        _, t_given = await started(turns, "t", 1)
        _, x_given = await started(turns, "x", 2)
        for _ in range(3):  # three times: a third request waits, and goes as soon as one of x's ends
            waiting, waiting_given = await started(turns, "x", 1)
            assert waiting_given == []
            x_given.pop(0)[1]()
            await asyncio.sleep(0)
            assert len(waiting_given) == 1
            x_given.append(waiting_given[0])
            await asyncio.gather(*waiting)

    asyncio.run(main())


def test_off_cpu_workers_nothing_is_paced():
    async def main() -> None:
        turns = WorkerTurns(per_key=2)
        turns.workers_run_on(["cuda"])
        _, t_given = await started(turns, "t", 1)
        _, x_given = await started(turns, "x", 2)
        waiting, waiting_given = await started(turns, "x", 1)
        x_given[0][1]()
        await asyncio.sleep(0)
        assert len(waiting_given) == 1 and not turns.stats()["paced"]
        await asyncio.gather(*waiting)

    asyncio.run(main())
