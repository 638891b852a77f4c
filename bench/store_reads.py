"""Store reads at real size: sparse vs full, L2 vs memcpy, L3 vs a plain file (warm and cold page cache).

Entries are shaped like Qwen3-VL-8B's image KV: 36 layers, 8 KV heads, head dim 128, bf16 (147,456 bytes per
token) plus a (tokens, 4096) bf16 encoder output. Each comparison runs its two sides alternately in one run
(A, B, B, A, ...), so drift in machine load hits both alike, and prints medians and the ratio.

Every timed store read is the real read path: checksums verified, then the bytes copied once into a
preallocated buffer (what an engine does before a host-to-device copy), so both sides of a ratio produce the
same thing in process memory.

    .venv/bin/python bench/store_reads.py [--tokens 1024 4096] [--repeats 7]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from store import DramTier, Entry, LmdbTier, SparseRead  # noqa: E402
from store.seal import PUBLIC, EntrySeal  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 36, 8, 128, 4096
SPARSE_SHARE, SPARSE_LAYERS = 0.10, (3, 36)
KEY = "ab" * 32

_libc = ctypes.CDLL(None, use_errno=True)


def build_entry(tokens: int, seal: EntrySeal = PUBLIC) -> Entry:
    """Random bf16 bits (their values do not matter to the store) with M-RoPE (t, h, w) positions, checksummed under
    ``seal`` (the store's)."""
    rng = np.random.default_rng(tokens)
    k = rng.integers(0, 1 << 16, (LAYERS, KV_HEADS, tokens, HEAD_DIM), dtype=np.uint16)
    v = rng.integers(0, 1 << 16, (LAYERS, KV_HEADS, tokens, HEAD_DIM), dtype=np.uint16)
    encoder = rng.integers(0, 1 << 16, (tokens, HIDDEN), dtype=np.uint16)
    width = 32
    grid = (tokens // width, width)
    positions = np.stack([np.zeros(tokens, np.int64), np.arange(tokens) // width, np.arange(tokens) % width], 1) + 7
    return Entry.from_arrays(model_id="qwen3-vl-8b-shaped", grid=grid, positions=positions, encoder_output=encoder,
                             k=k, v=v, kv_dtype="bfloat16", encoder_dtype="bfloat16", seal=seal)


def copy_segments(part: SparseRead, out: np.ndarray) -> None:
    """A sparse read's segments, one after another, into ``out`` (what an engine does before a device copy)."""
    at = 0
    for segment in part.segments:
        n = segment.data.nbytes
        out[at : at + n] = np.frombuffer(segment.data, np.uint8)
        at += n


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def side_by_side(a: Callable[[], object], b: Callable[[], object], repeats: int,
                 before: Callable[[], None] | None = None) -> tuple[float, float]:
    """Median seconds of a and b, run alternately (ABBA...); before() runs untimed ahead of every call."""
    times: dict[str, list[float]] = {"a": [], "b": []}
    for i in range(repeats):
        order = [("a", a), ("b", b)] if i % 2 == 0 else [("b", b), ("a", a)]
        for name, fn in order:
            if before is not None:
                before()
            times[name].append(timed(fn))
    return statistics.median(times["a"]), statistics.median(times["b"])


def drop_from_page_cache(path: Path) -> None:
    """Write back and evict a file's clean pages (no root needed); mapped pages stay, so close mappings first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_share(path: Path) -> float:
    """Share of the file's pages in the page cache (mincore over a private mapping, which faults nothing in)."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(mapping)  # exports the mapping; dropped before it closes
        status = _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        del anchor
        return float("nan") if status != 0 else sum(b & 1 for b in vec) / pages


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def row(label: str, a_name: str, a: float, b_name: str, b: float, note: str = "") -> None:
    print(f"  {label:34} {a_name} {a * 1e3:8.2f} ms | {b_name} {b * 1e3:8.2f} ms | ratio {a / b:6.3f}x {note}")


def bench_tokens(tokens: int, repeats: int, shm_root: Path, disk_root: Path) -> None:
    entry = build_entry(tokens)
    size = len(entry.data)
    header = entry.header
    kv = header.kv_range
    print(f"\n== {tokens} tokens: entry {mb(size)} (KV {mb(kv.nbytes)}, {header.token_nbytes:,} B per token)")

    dram = DramTier(shm_root / f"dram-{tokens}")
    lmdb_dir = disk_root / f"lmdb-{tokens}"
    lmdb_tier = LmdbTier(lmdb_dir, map_size=2 * size + (64 << 20))
    dram.put(KEY, entry)
    lmdb_tier.put(KEY, entry)
    plain = disk_root / f"plain-{tokens}.bin"
    plain.write_bytes(entry.data)
    out = np.empty(size, np.uint8)  # one preallocated destination for every copy

    rng = np.random.default_rng(0)
    chosen = sorted(rng.choice(tokens, round(tokens * SPARSE_SHARE), replace=False).tolist())

    def full_read(tier) -> Callable[[], None]:
        def read() -> None:
            with tier.get(KEY) as view:
                out[: view.buffer.nbytes] = np.frombuffer(view.buffer, np.uint8)
        return read

    def sparse_read(tier) -> Callable[[], None]:
        def read() -> None:
            with tier.get_sparse(KEY, chosen, SPARSE_LAYERS) as part:
                copy_segments(part, out)
        return read

    sparse = dram.get_sparse(KEY, chosen, SPARSE_LAYERS)
    assert sparse is not None
    with sparse as part:
        sparse_bytes, segments = part.bytes_read, len(part.segments)
    print(f"  sparse read: {len(chosen)} tokens (10%, random) x layers {SPARSE_LAYERS[0]}..{SPARSE_LAYERS[1] - 1}: "
          f"{mb(sparse_bytes)} in {segments} coalesced ranges = {sparse_bytes / kv.nbytes:.3f} of the KV bytes")

    for name, tier in (("L2 dram", dram), ("L3 lmdb", lmdb_tier)):
        s, f = side_by_side(sparse_read(tier), full_read(tier), repeats)
        row(f"{name} sparse vs full (warm)", "sparse", s, "full", f)

    source = np.frombuffer(bytes(entry.data), np.uint8)  # the same bytes in ordinary process memory

    def memcpy() -> None:
        out[:] = source

    def dram_get_only() -> None:
        view = dram.get(KEY)  # verified on open; nothing copied
        assert view is not None
        view.close()

    g, m = side_by_side(full_read(dram), memcpy, repeats)
    row("L2 get+copy vs memcpy", "get+copy", g, "memcpy", m, f"({size / g / 1e9:.1f} vs {size / m / 1e9:.1f} GB/s)")
    g, m = side_by_side(dram_get_only, memcpy, repeats)
    row("L2 get (verify only) vs memcpy", "get", g, "memcpy", m)

    def plain_read() -> None:
        with open(plain, "rb", buffering=0) as f:
            view = memoryview(out.data)[:size]
            while view.nbytes:
                n = f.readinto(view)
                view = view[n:]

    l3, p = side_by_side(full_read(lmdb_tier), plain_read, repeats)
    row("L3 get+copy vs plain file (warm)", "lmdb", l3, "file", p,
        f"({size / l3 / 1e9:.2f} vs {size / p / 1e9:.2f} GB/s)")

    # Cold: the LMDB environment is closed (its map would pin pages), both files evicted, the tier reopened.
    data_file = lmdb_dir / "data.mdb"
    state: dict[str, LmdbTier] = {"tier": lmdb_tier}

    def make_cold() -> None:
        state["tier"].close()
        drop_from_page_cache(data_file)
        drop_from_page_cache(plain)
        state["tier"] = LmdbTier(lmdb_dir, map_size=2 * size + (64 << 20))

    make_cold()
    residency = (resident_share(data_file), resident_share(plain))

    def cold_lmdb() -> None:
        full_read(state["tier"])()

    l3c, pc = side_by_side(cold_lmdb, plain_read, max(3, repeats // 2), before=make_cold)
    row("L3 get+copy vs plain file (cold)", "lmdb", l3c, "file", pc,
        f"({size / l3c / 1e9:.2f} vs {size / pc / 1e9:.2f} GB/s; resident before: "
        f"{residency[0]:.0%} / {residency[1]:.0%})")
    sc, fc = side_by_side(lambda: sparse_read(state["tier"])(), cold_lmdb, max(3, repeats // 2), before=make_cold)
    row("L3 sparse vs full (cold)", "sparse", sc, "full", fc)

    state["tier"].close()
    dram.remove(KEY)
    dram.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"layout: {LAYERS} layers x {KV_HEADS} KV heads x head dim {HEAD_DIM}, bf16; medians of "
          f"{args.repeats} alternating runs; {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="revisit-bench-") as shm, \
            tempfile.TemporaryDirectory(prefix="revisit-bench-") as disk:
        for tokens in args.tokens:
            bench_tokens(tokens, args.repeats, Path(shm), Path(disk))


if __name__ == "__main__":
    main()
