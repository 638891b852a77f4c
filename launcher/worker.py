"""Run one SGLang worker in the foreground: ``python -m launcher.worker --model PATH|bundled``.

The process replaces itself with SGLang (``exec``), so signals from a terminal or a container
runtime reach SGLang directly and its log goes to this process's stdout/stderr. Arguments after
``--`` are passed to SGLang unchanged, e.g.::

    python -m launcher.worker --model bundled --port 30000 -- --log-requests
    python -m launcher.worker --model /models/Qwen2.5-VL-3B-Instruct --device cuda --host 0.0.0.0
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from bundled import ARCHS, DEFAULT_ARCH, DEFAULT_SIZE, SIZES, build_model
from bundled.errors import BuildError
from launcher import WorkerSpec, build_launch, check_sglang_version
from launcher.errors import LauncherError
from launcher.launch import key_off_the_command_line, shown

BUNDLED = "bundled"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help=f"a checkpoint directory, or {BUNDLED!r}")
    parser.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH, help="with --model bundled")
    parser.add_argument("--size", choices=SIZES, default=DEFAULT_SIZE, help="with --model bundled")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--dtype", default="auto", help="default: the checkpoint's dtype")
    parser.add_argument("--print-command", action="store_true", help="print argv and env, do not start")
    parser.add_argument("extra_args", nargs=argparse.REMAINDER, help="-- then arguments for SGLang")
    return parser


def spec_from_args(args: argparse.Namespace) -> WorkerSpec:
    if args.model == BUNDLED:
        model_path = build_model(args.arch, args.size, on_progress=lambda line: print(line, file=sys.stderr))
    else:
        model_path = Path(args.model)
        if not (model_path / "config.json").is_file():
            raise ValueError(f"{model_path} is not a model directory (no config.json)")
    extra = args.extra_args[1:] if args.extra_args[:1] == ["--"] else args.extra_args
    return WorkerSpec(
        model_path=model_path,
        host=args.host,
        port=args.port,
        device=args.device,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        extra_args=tuple(extra),
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
        argv_, env = build_launch(spec)
        if args.print_command:
            changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
            for key in sorted(changed):
                print(f"{key}={shlex.quote(changed[key])}")
            print(shlex.join(shown(argv_)))
            return 0
        check_sglang_version()
    except (LauncherError, BuildError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The worker's API key goes in a file only this user reads, not on the command line every user of the host
    # sees; the exec'd worker leaves it for the container's life.
    argv_ = key_off_the_command_line(argv_, Path(tempfile.mkdtemp(prefix="revisit-worker-")))
    print(f"starting: {shlex.join(shown(argv_))}", file=sys.stderr, flush=True)
    os.execvpe(argv_[0], argv_, env)


if __name__ == "__main__":
    sys.exit(main())
