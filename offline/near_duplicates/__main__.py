"""``python -m offline.near_duplicates --out DIR`` builds the labelled pairs and writes them out to look at."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from offline import near_duplicates
from offline.near_duplicates.build import build_pairs, summary, write


def main(argv: Sequence[str] | None = None) -> int:
    doc = near_duplicates.__doc__  # the package's: its first paragraph says what the command builds
    parser = argparse.ArgumentParser(prog="python -m offline.near_duplicates",
                                     description=doc.split("\n\n")[0] if doc else None)
    parser.add_argument("--out", type=Path, required=True, help="folder to write the pairs into")
    parser.add_argument("--render-dir", type=Path, default=None, help="cache of documentation renders (enables them)")
    parser.add_argument("--large", action="store_true", help="about 4,000 tokens an image")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-family", type=int, default=4, help="pairs per family to write (0: all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    notes: list[str] = []
    started = time.monotonic()
    pairs = build_pairs(seed=args.seed, large=args.large, render_dir=args.render_dir,
                        per_family=args.per_family or None, notes=notes)
    labels = write(pairs, args.out)
    for family, number in summary(pairs).items():
        print(f"{family:>20}: {number}")
    for note in notes:
        print(f"note: {note}")
    print(f"{len(pairs)} pairs in {time.monotonic() - started:.1f} s: {labels}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
