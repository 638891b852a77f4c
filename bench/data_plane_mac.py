"""What sealing entries costs a read: the MAC check against the whole verified read and a sparse one.

A Qwen3-VL-8B-shaped entry (bench/store_reads.py) is sealed under a deployment secret and put into a DRAM tier;
then, alternately (A, B, B, A, ...) so that drift in machine load hits both alike:
- the header parsed with the seal checked for the key (what every read does first) vs parsed without it: their
  difference is the MAC's cost (keyed BLAKE3 over the header area: metadata, positions, every checksum);
- a whole verified read (header, seal, checksums, one copy into a preallocated buffer), and a sparse one (10% of
  the tokens, layers 3..35), each as the store serves them.
The seeded checksums cost what unseeded ones did (XXH3 with a seed runs the same code), so the MAC is the seal's
whole cost.

    .venv/bin/python bench/data_plane_mac.py [--tokens 1024 4096] [--repeats 15]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.store_reads import (  # noqa: E402
    KEY,
    SPARSE_LAYERS,
    SPARSE_SHARE,
    build_entry,
    copy_segments,
    side_by_side,
    timed,
)
from settings.secret import DataPlaneSecret  # noqa: E402
from store import DramTier  # noqa: E402
from store.entry import parse_header  # noqa: E402
from store.seal import EntrySeal  # noqa: E402


def measure(tokens: int, repeats: int) -> dict[str, float]:
    seal = EntrySeal(DataPlaneSecret(bytes(range(32))))
    folder = Path(tempfile.mkdtemp(prefix="revisit-bench-mac-", dir="/dev/shm"))
    try:
        tier = DramTier(folder / "dram", pin_host_memory=False, seal=seal)
        entry = build_entry(tokens, seal=seal)
        tier.put(KEY, entry)
        view = memoryview(entry.data)
        with_mac, without = side_by_side(lambda: parse_header(view, key=KEY, seal=seal),
                                         lambda: parse_header(view, seal=seal), repeats)
        out = np.empty(entry.header.total_nbytes, np.uint8)

        def whole() -> None:
            found = tier.get(KEY)
            assert found is not None, "the entry just put is missing"
            with found as read:
                out[:] = np.frombuffer(read.buffer, np.uint8)

        rows = np.random.default_rng(0).choice(tokens, int(tokens * SPARSE_SHARE), replace=False)
        picked = sorted(int(r) for r in rows)

        def sparse() -> None:
            found = tier.get_sparse(KEY, picked, SPARSE_LAYERS)
            assert found is not None, "the entry just put is missing"
            with found as read:
                copy_segments(read, out)

        whole()  # map once: later reads reuse the mapping, as a worker's do
        whole_s = statistics.median(timed(whole) for _ in range(repeats))
        sparse_s = statistics.median(timed(sparse) for _ in range(repeats))
        return {"mac_ms": (with_mac - without) * 1e3, "header_ms": without * 1e3, "whole_ms": whole_s * 1e3,
                "sparse_ms": sparse_s * 1e3, "mb": entry.header.total_nbytes / 1e6}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print("| tokens | entry | MAC check | whole read | MAC / whole | sparse read (10%) | MAC / sparse |")
    print("|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        m = measure(tokens, args.repeats)
        print(f"| {tokens} | {m['mb']:.0f} MB | {m['mac_ms']:.2f} ms | {m['whole_ms']:.1f} ms | "
              f"{m['mac_ms'] / m['whole_ms']:.1%} | {m['sparse_ms']:.1f} ms | {m['mac_ms'] / m['sparse_ms']:.1%} |",
              flush=True)


if __name__ == "__main__":
    main()
