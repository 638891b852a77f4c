"""Beyond one host, measured: reads from the mooncake tier next to the local tiers, and the gateway's lookup with
books shared by two replicas next to books of its own.

reads    One entry shaped like Qwen3-VL-8B's image KV (36 layers, 8 KV heads, head dim 128, bf16: 147,456 bytes a
         token, plus its encoder output), stored in each tier: L2 dram (shared memory), L3 lmdb (warm page cache),
         and mooncake (a real cluster started here: a master and one storage node, over TCP on loopback). Full reads
         (what an exact hit reads) and sparse ones (10% of the tokens, layers 3..35: an approximate hit's reuse
         set), each verified and copied once into a preallocated buffer; medians of alternating runs, ratios
         against L2 and L3 printed side by side. Loopback has no network in it: across hosts add the wire.

lookup   What the gateway does per image of an exact hit on the cache thread: the header probe of the stored entry
         (the planner reads its prefix digest) and the hit in the books. Local books in memory next to books shared
         by two replicas through a real Redis server (started here), the second replica committing its own hits at
         the same time; and the other replica's cost of following the log.

    .venv/bin/python bench/scale_out.py [--sections reads lookup] [--tokens 1024] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.store_reads import (  # noqa: E402
    SPARSE_LAYERS,
    SPARSE_SHARE,
    build_entry,
    copy_segments,
    mb,
    side_by_side,
)
from gateway.books import BookLog, SharedBooks  # noqa: E402
from gateway.config import PolicySettings  # noqa: E402
from gateway.policy import CachePolicy  # noqa: E402
from launcher.mooncake import MooncakeCluster, free_port  # noqa: E402
from store import DramTier, KVStore, LmdbTier  # noqa: E402
from store.mooncake_tier import MooncakeTier  # noqa: E402

KEY = "cd" * 32


def row(label: str, a_name: str, a: float, b_name: str, b: float, note: str = "") -> None:
    print(f"  {label:38} {a_name} {a * 1e3:8.2f} ms | {b_name} {b * 1e3:8.2f} ms | ratio {a / b:6.2f}x {note}")


def bench_reads(cluster: MooncakeCluster, tokens: int, repeats: int, shm: Path, disk: Path) -> None:
    entry = build_entry(tokens)
    size = len(entry.data)
    print(f"\n== reads: {tokens} tokens, entry {mb(size)} ({entry.header.token_nbytes:,} B per token)")
    tiers: dict[str, KVStore] = {
        "dram": DramTier(shm / "dram", pin_host_memory=False),
        "lmdb": LmdbTier(disk / "lmdb", map_size=2 * size + (64 << 20), sync=False),
        "mooncake": MooncakeTier(master=cluster.master_address, metadata_server=cluster.metadata_server,
                                 admin_url=cluster.admin_url, store_name=f"bench-{uuid.uuid4().hex[:8]}"),
    }
    started = time.perf_counter()
    for tier in tiers.values():
        tier.put(KEY, entry)
    print(f"  stored in the three tiers in {time.perf_counter() - started:.2f} s")
    out = np.empty(size, np.uint8)
    rng = np.random.default_rng(0)
    chosen = sorted(rng.choice(tokens, round(tokens * SPARSE_SHARE), replace=False).tolist())

    def full(tier: KVStore) -> Callable[[], None]:
        def read() -> None:
            view = tier.get(KEY)
            assert view is not None
            with view:
                out[: view.buffer.nbytes] = np.frombuffer(view.buffer, np.uint8)
        return read

    def sparse(tier: KVStore) -> Callable[[], None]:
        def read() -> None:
            part = tier.get_sparse(KEY, chosen, SPARSE_LAYERS)
            assert part is not None
            with part:
                copy_segments(part, out)
        return read

    def header(tier: KVStore) -> Callable[[], None]:
        def read() -> None:
            part = tier.get_sparse(KEY, [], (0, 1))
            assert part is not None
            part.close()
        return read

    probe = tiers["dram"].get_sparse(KEY, chosen, SPARSE_LAYERS)
    assert probe is not None
    with probe:
        print(f"  sparse: {len(chosen)} tokens x layers {SPARSE_LAYERS[0]}..{SPARSE_LAYERS[1] - 1} = "
              f"{mb(probe.bytes_read)} in {len(probe.segments)} ranges")
    remote = tiers["mooncake"]
    for local in ("dram", "lmdb"):
        for name, make in (("full", full), ("sparse", sparse), ("header probe", header)):
            r, loc = side_by_side(make(remote), make(tiers[local]), repeats)
            note = f"({size / r / 1e9:.2f} vs {size / loc / 1e9:.2f} GB/s)" if name == "full" else ""
            row(f"mooncake vs {local}: {name}", "mooncake", r, local, loc, note)
    s, f = side_by_side(sparse(remote), full(remote), repeats)
    row("mooncake: sparse vs full", "sparse", s, "full", f)
    for tier in tiers.values():
        tier.remove(KEY, force=True)
        tier.close()


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p50, p99 = statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"p50 {p50 * 1e3:7.3f} ms, p99 {p99 * 1e3:7.3f} ms"


def bench_lookup(cluster: MooncakeCluster, redis_url: str, operations: int, shm: Path) -> None:
    print(f"\n== lookup: {operations} exact hits per side, each a header probe and a hit in the books")
    entry = build_entry(64)  # the probe reads the header only: the entry's size hardly matters
    settings = PolicySettings(dram_capacity_bytes=1 << 40, mooncake_capacity_bytes=1 << 40)
    keys = [f"{i:064x}" for i in range(32)]
    local_store = DramTier(shm / "lookup", pin_host_memory=False)
    shared_store = MooncakeTier(master=cluster.master_address, metadata_server=cluster.metadata_server,
                                admin_url=cluster.admin_url, store_name=f"bench-{uuid.uuid4().hex[:8]}")
    for key in keys:
        local_store.put(key, entry)
        shared_store.put(key, entry)
    local = CachePolicy(settings, tiers=("dram",))
    name = f"bench-{uuid.uuid4().hex[:8]}"
    one = SharedBooks(settings, BookLog(redis_url, name=name), tiers=("mooncake",))
    two = SharedBooks(settings, BookLog(redis_url, name=name), tiers=("mooncake",))
    one.load()
    two.load()
    for key in keys:
        local.insert(key, len(entry.data))
        one.insert(key, len(entry.data))

    def lookups(store: KVStore, books: CachePolicy) -> list[float]:
        times = []
        for i in range(operations):
            key = keys[i % len(keys)]
            started = time.perf_counter()
            _probe(store, key)
            books.record_exact_hit(key)
            times.append(time.perf_counter() - started)
        return times

    alone = lookups(local_store, local)
    stop = threading.Event()
    other: list[float] = []

    def second_replica() -> None:  # the other gateway's own hits, and its following of the log
        while not stop.is_set():
            started = time.perf_counter()
            two.record_exact_hit(keys[len(other) % len(keys)])
            other.append(time.perf_counter() - started)

    thread = threading.Thread(target=second_replica)
    thread.start()
    shared = lookups(shared_store, one)
    stop.set()
    thread.join()
    one.catch_up()
    two.catch_up()
    assert one.state() == two.state(), "the replicas' books differ"
    probe_local = _timed(lambda: _probe(local_store, keys[0]), operations)
    probe_shared = _timed(lambda: _probe(shared_store, keys[0]), operations)
    hits_local = _timed(lambda: local.record_exact_hit(keys[0]), operations)
    hits_shared = _timed(lambda: one.record_exact_hit(keys[0]), operations)
    follow = _timed(lambda: two.catch_up(), 50, between=lambda: one.record_exact_hit(keys[1]))
    print(f"  one gateway, dram + local books:        {percentiles(alone)}")
    print(f"  two gateways, mooncake + shared books:  {percentiles(shared)}  "
          f"(ratio {statistics.median(shared) / statistics.median(alone):.1f}x; the other replica committed "
          f"{len(other)} hits meanwhile, {percentiles(other)})")
    print(f"    header probe: dram {percentiles(probe_local)} | mooncake {percentiles(probe_shared)}")
    print(f"    hit in books: local {percentiles(hits_local)} | shared {percentiles(hits_shared)}")
    print(f"    following one event of the other replica: {percentiles(follow)}")
    print(f"  both replicas' books identical after {one.applied} events")
    for key in keys:
        local_store.remove(key)
        shared_store.remove(key, force=True)
    local_store.close()
    shared_store.close()
    one.log.close()
    two.log.close()


def _probe(store: KVStore, key: str) -> None:
    part = store.get_sparse(key, [], (0, 1))
    assert part is not None
    part.close()


def _timed(fn: Callable[[], object], count: int, between: Callable[[], object] | None = None) -> list[float]:
    times = []
    for _ in range(count):
        if between is not None:
            between()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no", "--dir", str(folder), "--logfile", str(folder / "redis.log")])
    time.sleep(0.5)
    return process, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", nargs="+", default=["reads", "lookup"], choices=["reads", "lookup"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--lookups", type=int, default=2000)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; medians of {args.repeats} alternating runs")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="revisit-bench-") as shm, \
            tempfile.TemporaryDirectory(prefix="revisit-bench-") as disk:
        largest = max(len(build_entry(t).data) for t in args.tokens) if "reads" in args.sections else 64 << 20
        with MooncakeCluster.start(Path(disk) / "mooncake", segment_bytes=max(1 << 30, 3 * largest)) as cluster:
            for tokens in args.tokens if "reads" in args.sections else []:
                bench_reads(cluster, tokens, args.repeats, Path(shm), Path(disk))
            if "lookup" in args.sections:
                redis, url = start_redis(Path(disk))
                try:
                    bench_lookup(cluster, url, args.lookups, Path(shm))
                finally:
                    redis.terminate()
                    redis.wait()


if __name__ == "__main__":
    main()
