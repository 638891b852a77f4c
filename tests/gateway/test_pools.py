"""The bounded, fair thread pool that image and video decoding run on (gateway/pools.py): each caller's jobs wait
their own turn, not behind another caller's queue; costly jobs start only within the pool's budget and their
caller's; an idle thread holds nothing of its last job."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gateway.pools import FairPool, PoolClosed
from tests.waiting import until


async def test_one_callers_single_job_waits_for_about_one_job_per_thread_not_for_another_callers_queue() -> None:
    pool = FairPool(2)
    done: list[str] = []

    async def job(caller: str) -> float:
        await pool.run(caller, time.sleep, 0.2)
        done.append(caller)
        return time.perf_counter()

    try:
        a_jobs = [asyncio.ensure_future(job("A")) for _ in range(20)]
        await asyncio.sleep(0)  # A's 20 are queued (two of them running) before B's one
        submitted = time.perf_counter()
        b_done = await job("B")
        waited = b_done - submitted
        a_before_b = done.index("B")
        await asyncio.gather(*a_jobs)
    finally:
        await pool.aclose()
    assert waited < 0.5, f"B's job took {waited:.2f} s behind A's 20 (2 threads x 0.2 s)"
    assert a_before_b <= 4
    assert time.perf_counter() - submitted > 1.9  # A's 20 took their 2 s: only the order was fair


async def test_results_and_exceptions_reach_the_awaiting_coroutine() -> None:
    pool = FairPool(2)

    def fail() -> None:
        raise ValueError("broken image")

    try:
        assert await pool.run("A", lambda x, *, y: x + y, 2, y=3) == 5
        assert await pool.run("A", threading.current_thread) is not threading.current_thread()
        with pytest.raises(ValueError, match="broken image"):
            await pool.run("B", fail)
        with pytest.raises(RuntimeError, match="StopIteration"):
            await pool.run("B", next, iter(()))
    finally:
        await pool.aclose()
    with pytest.raises(PoolClosed):
        await pool.run("A", int)


async def test_a_cancelled_coroutines_job_that_has_not_started_leaves_the_queue_and_never_runs() -> None:
    pool = FairPool(1)
    release, ran = threading.Event(), threading.Event()
    try:
        blocker = asyncio.ensure_future(pool.run("A", release.wait, 5))
        waiting = asyncio.ensure_future(pool.run("B", ran.set))
        await until(lambda: pool.queued("B") == 1, pool.stats())
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pool.queued() == 0
        release.set()
        assert await blocker is True
        assert await pool.run("C", lambda: "after") == "after"
        assert not ran.is_set()
    finally:
        release.set()
        await pool.aclose()


async def test_jobs_not_started_fail_when_the_pool_closes() -> None:
    pool = FairPool(1)
    release = threading.Event()
    started = asyncio.ensure_future(pool.run("A", release.wait, 5))
    queued = asyncio.ensure_future(pool.run("A", int))
    await until(lambda: pool.queued("A") == 1, pool.stats())
    closing = asyncio.ensure_future(pool.aclose())
    with pytest.raises(PoolClosed):
        await queued
    release.set()
    await closing
    assert await started is True


async def test_idle_threads_leave_and_come_back_when_jobs_do() -> None:
    pool = FairPool(2, idle_s=0.05)
    try:
        assert await asyncio.gather(*(pool.run("A", time.sleep, 0.05) for _ in range(4))) == [None] * 4
        assert pool.stats()["threads"] == 2
        await until(lambda: pool.stats()["threads"] == 0, pool.stats())
        assert await pool.run("A", lambda: 7) == 7
    finally:
        await pool.aclose()


async def test_an_idle_thread_holds_neither_its_last_jobs_arguments_nor_its_result() -> None:
    """A job's arguments and result can be a request's whole body and its parse: an idle thread kept both alive
    until its next job (measured: ~95 MB after one 50 MB body, for as long as the gateway was quiet)."""
    import gc
    import weakref

    class Big:
        pass

    pool = FairPool(1)
    try:
        argument, made = Big(), []

        def parse(body: Big) -> Big:
            made.append(weakref.ref(result := Big()))
            return result

        answer = weakref.ref(await pool.run("A", parse, argument))
        sent = weakref.ref(argument)
        del argument
        # The thread is idle, waiting for a job: it lets go of both.
        await until(lambda: gc.collect() is not None and sent() is None and answer() is None and made[0]() is None,
                    "the idle thread still holds its last job's argument or result")
        assert pool.stats()["threads"] == 1
    finally:
        await pool.aclose()


class GatedJobs:
    """Jobs by name that record their start, then wait for their gate (5 s at most) and return their name."""

    def __init__(self, *names: str) -> None:
        self.gates = {name: threading.Event() for name in names}
        self.started: list[str] = []

    def job(self, name: str) -> str:
        self.started.append(name)
        self.gates[name].wait(5)
        return name

    def open_all(self) -> None:
        for gate in self.gates.values():
            gate.set()


async def test_costly_jobs_start_only_within_the_pools_budget_and_one_past_it_runs_alone() -> None:
    """What decoding holds in memory is bounded by the pixels being decoded at once, not by the thread count."""
    pool = FairPool(4, cost_budget=100)
    jobs = GatedJobs("a", "b", "c", "huge")
    gates, started, job = jobs.gates, jobs.started, jobs.job
    try:
        a = asyncio.ensure_future(pool.run_costing("A", 60, job, "a"))
        await until(lambda: started == ["a"], started)
        b = asyncio.ensure_future(pool.run_costing("B", 60, job, "b"))  # 120 > 100: waits for a
        c = asyncio.ensure_future(pool.run_costing("C", 30, job, "c"))  # 90: fits beside a, goes first
        await until(lambda: started == ["a", "c"], started)
        assert pool.stats()["cost_running"] == 90 and pool.queued() == 1
        gates["a"].set()
        await until(lambda: started == ["a", "c", "b"], started)
        huge = asyncio.ensure_future(pool.run_costing("A", 150, job, "huge"))  # past the budget: alone
        await asyncio.sleep(0.1)
        assert started == ["a", "c", "b"]
        gates["b"].set()
        gates["c"].set()
        await until(lambda: started[-1] == "huge", started)
        assert pool.stats()["cost_running"] == 150
        assert await pool.run("B", lambda: "free") == "free"  # a job of no cost is not held back
        gates["huge"].set()
        assert await asyncio.gather(a, b, c, huge) == ["a", "b", "c", "huge"]
        assert pool.stats()["cost_running"] == 0
    finally:
        jobs.open_all()
        await pool.aclose()


async def test_one_callers_costly_jobs_start_only_within_its_own_budget_and_one_past_it_runs_alone_among_them(
) -> None:
    """What one caller holds at once (its bodies' parses, its images' decoding) is bounded by its own budget, while
    another caller's jobs fit beside."""
    pool = FairPool(4, cost_budget=1000, caller_cost_budget=100)
    jobs = GatedJobs("a1", "a2", "a3", "b", "a_huge")
    gates, started, job = jobs.gates, jobs.started, jobs.job
    try:
        a1 = asyncio.ensure_future(pool.run_costing("A", 60, job, "a1"))
        await until(lambda: started == ["a1"], started)
        a2 = asyncio.ensure_future(pool.run_costing("A", 60, job, "a2"))  # A's 120 > 100: waits for a1
        b = asyncio.ensure_future(pool.run_costing("B", 60, job, "b"))  # B's own 60: beside a1
        await until(lambda: started == ["a1", "b"] and pool.queued("A") == 1, started)
        assert pool.stats()["cost_running"] == 120  # a2 is held by A's budget, not by the pool's (1000)
        gates["a1"].set()
        await until(lambda: started == ["a1", "b", "a2"], started)
        a_huge = asyncio.ensure_future(pool.run_costing("A", 150, job, "a_huge"))  # past A's budget: alone in A's
        a3 = asyncio.ensure_future(pool.run_costing("A", 10, job, "a3"))  # behind it, in A's order
        await until(lambda: pool.queued("A") == 2, pool.stats())
        assert started == ["a1", "b", "a2"]
        gates["a2"].set()
        await until(lambda: started[-1] == "a_huge" and pool.stats()["running"] == 2, started)
        # a3 (10) waits: nothing of A's starts beside a job past A's budget
        assert started[-1] == "a_huge" and pool.queued("A") == 1
        assert pool.stats()["cost_running"] == 60 + 150  # B's job runs on beside it
        gates["a_huge"].set()
        await until(lambda: started[-1] == "a3", started)
        gates["a3"].set()
        gates["b"].set()
        assert await asyncio.gather(a1, a2, b, a_huge, a3) == ["a1", "a2", "b", "a_huge", "a3"]
        assert pool.stats()["cost_running"] == 0
    finally:
        jobs.open_all()
        await pool.aclose()


async def test_a_nice_pools_threads_run_below_the_event_loops_priority() -> None:
    import os

    pool, plain = FairPool(workers=1, nice=5), FairPool(workers=1)
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)  # (Linux: this thread's niceness)
        assert await pool.run("a", os.getpriority, os.PRIO_PROCESS, 0) == min(19, base + 5)
        assert await plain.run("a", os.getpriority, os.PRIO_PROCESS, 0) == base
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the loop's thread keeps its own
    finally:
        await pool.aclose()
        await plain.aclose()
