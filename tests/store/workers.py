"""Child-process bodies for the multi-process tests (module-level so the spawn start method can import them)."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

from store import StoreConfig
from store.entry import seal_entry
from tests.store.conftest import open_kind
from tests.store.entries import expected_sparse, key_for, make_entry

SLOTS = 6
VARIANTS = 3
SHAPE = {"layers": 8, "kv_heads": 2, "tokens": 256, "head_dim": 64}  # ~1 MiB of float16 KV per entry


@dataclass(frozen=True)
class WorkerReport:
    role: str
    operations: int
    verified_reads: int
    absent_reads: int
    mismatches: int
    damaged_reads: int
    slowest_s: float = 0.0  # the longest single operation: what to look at when a run is starved


def slot_key(slot: int) -> str:
    return key_for(f"slot-{slot}")


MIN_WRITES = 30


def writer(kind: str, config: StoreConfig, seed: int, barrier, duration_s: float, results, writers_left) -> None:
    """Writes for duration_s and at least MIN_WRITES operations (however slowly a busy machine schedules it), then
    counts itself out of ``writers_left``: the readers read until it reaches 0, so every write overlaps reads."""
    rng = random.Random(seed)
    store = open_kind(kind, config)
    entries = {s * 100 + v: make_entry(s * 100 + v, **SHAPE)[0] for s in range(SLOTS) for v in range(VARIANTS)}
    barrier.wait(timeout=300)  # every process started (test_processes.PROCESS_TIMEOUT_S)
    deadline, ops, slowest = time.monotonic() + duration_s, 0, 0.0
    while time.monotonic() < deadline or ops < MIN_WRITES:
        started = time.monotonic()
        slot = rng.randrange(SLOTS)
        action = rng.random()
        if action < 0.1:
            store.remove(slot_key(slot), force=True)
        elif kind == "tiered" and action < 0.25:
            src, dst = rng.sample(["dram", "lmdb"], 2)
            store.move(slot_key(slot), src=src, dst=dst)
        else:
            tier = rng.choice(["dram", "lmdb"]) if kind == "tiered" else None
            entry = entries[slot * 100 + rng.randrange(VARIANTS)]
            store.put(slot_key(slot), entry, **({"tier": tier} if tier else {}))
        ops += 1
        slowest = max(slowest, time.monotonic() - started)
    with writers_left.get_lock():
        writers_left.value -= 1
    results.put(WorkerReport("writer", ops, 0, 0, 0, store.stats().damaged_reads, slowest))
    store.close()


def reader(kind: str, config: StoreConfig, seed: int, barrier, duration_s: float, results, writers_left) -> None:
    """Reads whole and sparse, for duration_s and until every writer is done; regenerates the arrays named by the
    header's model_id and compares every byte."""
    rng = random.Random(seed)
    store = open_kind(kind, config)
    originals = {}

    def original(model_id: str):
        entry_seed = int(model_id.removeprefix("seed-"))
        if entry_seed not in originals:
            originals[entry_seed] = make_entry(entry_seed, **SHAPE)
        return originals[entry_seed]

    barrier.wait(timeout=300)  # every process started (test_processes.PROCESS_TIMEOUT_S)
    deadline, give_up = time.monotonic() + duration_s, time.monotonic() + 45  # give_up: a writer that died
    ops = verified = absent = mismatches = 0
    slowest = 0.0
    while time.monotonic() < deadline or (writers_left.value > 0 and time.monotonic() < give_up):
        started = time.monotonic()
        key = slot_key(rng.randrange(SLOTS))
        ops += 1
        if rng.random() < 0.5:
            view = store.get(key)
            if view is None:
                absent += 1
                continue
            with view:
                entry = original(view.header.model_id)[0]
                seal_entry(entry.data, key, store.seal)  # as the writer's put sealed it for this key
                mismatches += bytes(view.buffer) != entry.data
        else:
            tokens = sorted(rng.sample(range(SHAPE["tokens"]), 16))
            start = rng.randrange(SHAPE["layers"])
            read = store.get_sparse(key, tokens, (start, SHAPE["layers"]))
            if read is None:
                absent += 1
                continue
            with read:
                _, k, v, _ = original(read.header.model_id)
                mismatches += read.gather() != expected_sparse(k, v, tokens, start, SHAPE["layers"])
        verified += 1
        slowest = max(slowest, time.monotonic() - started)
    results.put(WorkerReport("reader", ops, verified, absent, mismatches, store.stats().damaged_reads, slowest))
    store.close()


def slow_dram_writer(config: StoreConfig) -> None:
    """Puts ~29 MiB entries under fresh keys until killed."""
    store = open_kind("dram", config)
    entry = make_entry(1, layers=28, kv_heads=4, tokens=512, head_dim=128)[0]  # ~29 MiB
    for i in range(10_000):
        store.put(key_for(f"big-{os.getpid()}-{i}"), entry)


def lmdb_writer_until_killed(config: StoreConfig, in_put, completed) -> None:
    """Puts large entries under fresh keys until killed, flagging when it is inside put()."""
    store = open_kind("lmdb", config)
    entry = make_entry(1, layers=28, kv_heads=4, tokens=128, head_dim=128)[0]  # ~14 MiB
    for i in range(10_000):
        in_put.value = 1
        store.put(key_for(f"big-{i}"), entry)
        in_put.value = 0
        completed.value = i + 1


def lmdb_filler(config: StoreConfig, count: int) -> None:
    store = open_kind("lmdb", config)
    for i in range(count):
        store.put(key_for(f"fill-{i}"), make_entry(i)[0])
    store.close()
