"""The oracle (the deeper reader) served by a real SGLang worker behind the gateway, asked with the real openai
client: every kind of question, two images in one request, and exact reuse keeping its answers."""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bundled import ORACLE, QWEN2_5_VL, build_model
from bundled.reader.questions import FIELD, QUESTION_KINDS
from gateway.config import GatewayConfig, ProcessorSettings, ReuseSettings, TenantSettings
from offline.reader_eval import (
    CHANGED,
    UNCHANGED,
    evaluate_gateway,
    fresh_questions,
    gateway_accuracy,
    make_pairs,
)
from store import StoreConfig
from tests.conftest import WORKER_READY_TIMEOUT_S, free_port, remove_store_memory, run_gateway, worker_events

pytestmark = pytest.mark.sglang

ORACLE_ID = "revisit-oracle"


@contextmanager
def served_reader(size: str, model_id: str, tmp_path_factory) -> Iterator:
    """One reader worker and a gateway over a store of their own (LMDB opens once per process: not the session's),
    with the gateway's default reuse settings."""
    from launcher import WorkerSpec, start_worker

    path = build_model(QWEN2_5_VL, size)
    dram = Path(tempfile.mkdtemp(prefix="revisit-reader-store-", dir="/dev/shm"))
    env = {"REVISIT_STORE_DRAM_DIR": str(dram), "REVISIT_STORE_LMDB_DIR": str(tmp_path_factory.mktemp("reader-lmdb"))}
    logs = tmp_path_factory.mktemp("reader-worker")
    worker = start_worker(WorkerSpec(model_path=path, port=free_port(), served_model_name=model_id,
                                     log_file=logs / "worker.log", env=env))
    server = None
    try:
        worker.wait_ready(WORKER_READY_TIMEOUT_S)
        config = GatewayConfig(model=model_id, workers=(worker.url,), processor=ProcessorSettings.from_model_dir(path),
                               reuse=ReuseSettings.for_model(path, store=StoreConfig.from_env(env)),
                               health_interval_s=0.5, tenants=TenantSettings.open())
        server = run_gateway(config)
        yield server
    finally:
        if server is not None:
            server.stop()
        worker.stop()
        remove_store_memory(StoreConfig(dram_dir=dram))


def stored_every_miss(workers, before: Counter):
    """An awaitable maker: until the worker has stored the entry of every miss and approximate hit it ran since
    ``before`` (bounded)."""
    async def settle() -> None:
        for _ in range(300):
            events = await asyncio.to_thread(worker_events, workers) - before
            if events["miss"] <= events["stored"] and \
                    events["approximate_executed"] <= events["derived_stored"] + events["derive_skipped"]:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("the worker did not store its misses' and approximate hits' entries")

    return settle


@pytest.fixture(scope="module")
def reader_gateway(tmp_path_factory):
    with served_reader(ORACLE, ORACLE_ID, tmp_path_factory) as server:
        yield server


def test_the_served_oracle_reads_and_reuse_keeps_its_answers(reader_gateway) -> None:
    import openai

    async def run():
        client = openai.AsyncOpenAI(base_url=reader_gateway.url + "/v1", api_key="sk-reader", max_retries=0,
                                    timeout=300)
        accuracy = await gateway_accuracy(client, ORACLE_ID, fresh_questions(60, seed=21))
        before = worker_events(workers)
        settle = stored_every_miss(workers, before)
        report = await evaluate_gateway(client, ORACLE_ID, make_pairs(12, seed=21), settle=settle)
        await settle()
        return accuracy, report, worker_events(workers) - before

    workers = reader_gateway.config.workers
    accuracy, report, events = asyncio.run(run())
    assert accuracy[FIELD] >= 0.9
    tallies = report.tallies
    # What the worker executed is what the gateway reported: every miss ran the vision tower and the full prefill
    # and was stored, every approximate plan was executed as one and left a derived entry, every exact plan (B's
    # second and third questions: on that derived entry) reused stored KV (or found all its rows in SGLang's radix
    # cache already).
    reported = Counter()
    for name, kinds in tallies.items():
        reported[name.split(": ")[1]] += sum(tally.asked for tally in kinds.values())
    assert events["miss"] == reported["miss"] == 12 and events["stored"] == 12
    assert events["approximate_executed"] == reported["approximate"] == 12 and events["approximate_fallback"] == 0
    assert events["derived_stored"] == 12 and reported["exact_same_prefix"] == 24
    assert events["exact_fallback"] == 0 and events["plan_refused"] == 0 and events["plan_mismatch"] == 0
    # B is A with one field changed: a near-duplicate, planned as approximate with A as its alias; asked about the
    # changed field it reads its own pixels (the changed tokens are always recomputed), not A's stale value ...
    assert tallies["A: miss"][CHANGED].asked == 12 and tallies["A: miss"][CHANGED].right >= 10
    changed = tallies["B: approximate"][CHANGED]
    assert changed.asked == 6 and changed.right >= 5 and changed.stale <= 1
    # ... and about an unchanged field, read from the alias' K/V or recomputed (the default selector drops nothing)
    unchanged = tallies["B: approximate"][UNCHANGED]
    assert unchanged.asked == 6 and unchanged.right >= 5
    # Its next sights, exact hits on the derived entry, answer as well: the same question again never worse.
    again = tallies["B: exact_same_prefix"]
    assert again[CHANGED].asked == again[UNCHANGED].asked == 6 and again[CHANGED].right + again[UNCHANGED].right >= 10
    assert report.repeat_summary()["asked"] == 12 and report.repeat_summary()["repeat_worse"] == 0


def test_the_served_oracle_answers_every_kind_of_question(reader_gateway) -> None:
    """"K?", "K=L?" and, with two images in one request, "K1?" / "K2?": answered as the reference answers them."""
    import openai

    async def run():
        client = openai.AsyncOpenAI(base_url=reader_gateway.url + "/v1", api_key="sk-reader", max_retries=0,
                                    timeout=300)
        return await gateway_accuracy(client, ORACLE_ID, fresh_questions(25, seed=23, kinds=QUESTION_KINDS))

    rates = asyncio.run(run())
    assert set(rates) == set(QUESTION_KINDS)
    assert all(rate >= 0.9 for rate in rates.values()), rates
