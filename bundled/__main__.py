"""``python -m bundled build --arch qwen2_5_vl --size tiny`` prints the model's path."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bundled.build import build_model, model_dir
from bundled.recipes import ARCHS, DEFAULT_ARCH, DEFAULT_SIZE, SIZES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bundled", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("build", "build the model if needed and print its directory"),
        ("path", "print the model's directory without building it"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH)
        command.add_argument("--size", choices=SIZES, default=DEFAULT_SIZE)
        command.add_argument("--cache-dir", type=Path, default=None, help="default: REVISIT_CACHE_DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "path":
        print(model_dir(args.arch, args.size, args.cache_dir))
        return 0
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    print(build_model(args.arch, args.size, args.cache_dir, on_progress=progress))
    return 0


if __name__ == "__main__":
    sys.exit(main())
