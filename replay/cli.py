"""``revisit replay`` and ``revisit trace``: the command lines of this package (wired into gateway/cli.py).

    revisit trace make OUT [--requests 500] [--tenants 3] [--rate 2] [--tokens 6x9[,ROWSxCOLS...]] [--seed 0]
    revisit trace import CSV OUT                a trace of per-request image hashes and arrival times
    revisit replay TRACE --url URL [--out DIR] [--fast | --speed X] [--concurrency 4] [--mode all|exact|off]
                   [--compare [MODES] [--interleave]] [--admin-token T]

A replay writes ``results-<mode>.jsonl`` (one line per request as it ends: stop it and run the same command to
go on), ``report.json``, ``report.md`` and the plots into ``--out``. ``--compare`` replays the trace once per mode
(default ``all,off``: reuse on, then plain SGLang), each under API keys of its own so that neither run is served
the other's images, and puts them side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from replay.runner import MODES, ReplaySettings, Run, read_results, replay_interleaved
from replay.trace import TraceError, read_trace


def add_commands(commands: Any) -> None:
    """Add ``replay`` and ``trace`` to an argparse subparsers object."""
    run = commands.add_parser("replay", help="replay a trace against a running gateway; report and plots")
    run.add_argument("trace", type=Path, help="a trace file (JSON Lines, see replay/trace.py)")
    run.add_argument("--url", required=True, help="the gateway's base URL, e.g. http://127.0.0.1:8000")
    run.add_argument("--out", type=Path, default=None, help="where results, report and plots go "
                     "(default: replay-<trace name> beside the trace)")
    pace = run.add_mutually_exclusive_group()
    pace.add_argument("--fast", action="store_true", help="send as fast as --concurrency allows, not at the "
                      "trace's times")
    pace.add_argument("--speed", type=float, default=1.0, help="play the trace's times this many times faster")
    run.add_argument("--concurrency", type=int, default=4, help="requests in flight at most (default 4)")
    run.add_argument("--mode", choices=MODES, default="all", help="what the gateway may reuse (default all)")
    run.add_argument("--compare", nargs="?", const="all,off", default=None, metavar="MODES",
                     help="replay once per mode, side by side (default all,off)")
    run.add_argument("--interleave", action="store_true", help="with --compare: replay the modes at the same time, "
                     "each request under every mode back to back (the order turning), so that the machine's slow "
                     "stretches fall on every mode alike")
    run.add_argument("--admin-token", default=os.environ.get("REVISIT_ADMIN_TOKEN"),
                     help="the gateway's admin token, for its counts and tier traffic (default: "
                          "$REVISIT_ADMIN_TOKEN)")
    run.add_argument("--model", default=None, help="the model id to send (default: the gateway's first)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")

    trace = commands.add_parser("trace", help="make or import a trace")
    kinds = trace.add_subparsers(dest="trace_command", required=True)
    make = kinds.add_parser("make", help="a trace made from real images on this machine (replay/maker.py)")
    make.add_argument("out", type=Path, help="folder for trace.jsonl and images/")
    make.add_argument("--requests", type=int, default=500)
    make.add_argument("--tenants", type=int, default=3)
    make.add_argument("--rate", type=float, default=2.0, help="requests a second (default 2)")
    make.add_argument("--tokens", default="6x9", help="image token grid, ROWSxCOLS, or several separated by commas "
                      "(8x8,16x16,32x32,48x48: each session takes one at random) (default 6x9)")
    make.add_argument("--max-tokens", type=int, default=4, help="max_tokens of each request (default 4)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--render-dir", type=Path, default=None, help="where rendered documentation pages are cached "
                      "(default ~/.cache/revisit/renders)")
    make.add_argument("--no-docs", action="store_true", help="documents from scanned pages only, no rendered "
                      "documentation (which needs Chromium and python3.11-doc or sqlite3-doc)")
    imported = kinds.add_parser("import", help="a trace of per-request image hashes and arrival times "
                                "(replay/importer.py)")
    imported.add_argument("csv", type=Path)
    imported.add_argument("out", type=Path)
    imported.add_argument("--tokens", default="6x9")
    imported.add_argument("--seed", type=int, default=0)


def run_command(args: argparse.Namespace) -> int:
    try:
        if args.command == "trace":
            return _trace(args)
        return _replay(args)
    except (TraceError, ValueError) as exc:
        print(f"revisit {args.command}: {exc}", file=sys.stderr)
        return 2


def _grids(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(_grid(part.strip()) for part in text.split(","))


def _grid(text: str) -> tuple[int, int]:
    rows, sep, cols = text.lower().partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
        raise ValueError(f"--tokens must be ROWSxCOLS, like 6x9, not {text!r}")
    return int(rows), int(cols)


def _trace(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.trace_command == "make":
        from replay.maker import TraceShape, make_trace

        shape = TraceShape(requests=args.requests, tenants=args.tenants, rate=args.rate, grids=_grids(args.tokens),
                           max_tokens=args.max_tokens, seed=args.seed, docs=not args.no_docs,
                           **({"render_dir": args.render_dir} if args.render_dir else {}))
        with tqdm(total=shape.requests, unit="req", desc="making the trace") as bar:
            path = make_trace(args.out, shape, progress=lambda done, total: bar.update(done - bar.n))
    else:
        from replay.importer import import_hashes

        path = import_hashes(args.csv, args.out, tokens=_grid(args.tokens), seed=args.seed)
    trace = read_trace(path)
    print(f"wrote {path}: {len(trace.requests)} requests over {trace.duration_s:.0f} s, "
          f"{len(trace.tenants)} tenants")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from replay.report import write_report

    trace = read_trace(args.trace)
    out = args.out or args.trace.parent / f"replay-{args.trace.stem}"
    out.mkdir(parents=True, exist_ok=True)
    modes = [m.strip() for m in args.compare.split(",")] if args.compare else [args.mode]
    if bad := [m for m in modes if m not in MODES]:
        raise ValueError(f"unknown mode {bad[0]!r}; use {', '.join(MODES)}")
    if args.interleave and len(set(modes)) < 2:
        raise ValueError("--interleave needs --compare with two modes or more")
    if len(set(modes)) != len(modes):
        raise ValueError("each mode may be compared once")
    run_id = _run_id(out)
    lanes = [(ReplaySettings(url=args.url.rstrip("/"), model=args.model, concurrency=args.concurrency,
                             paced=not args.fast, speed=args.speed, mode=mode, admin_token=args.admin_token,
                             key_prefix=f"sk-replay-{run_id}-{mode}-"), out / f"results-{mode}.jsonl")
             for mode in modes]
    runs: list[Run] = []
    for group in [lanes] if args.interleave else [[lane] for lane in lanes]:
        already = sum(len(read_results(path)) for _, path in group)
        with tqdm(total=len(trace.requests) * len(group), initial=already, unit="req",
                  desc=f"replaying (mode {', '.join(s.mode for s, _ in group)})", disable=args.no_progress) as bar:
            runs += asyncio.run(replay_interleaved(trace, group, progress=lambda done, total: bar.update(done - bar.n)))
    report = write_report(runs, out, trace_name=str(trace.header.get("name") or args.trace.name),
                          interleaved=args.interleave)
    for summary in report["runs"]:
        print(f"mode {summary['mode']}: {summary['ok']}/{summary['requests']} ok; hit rate exact "
              f"{summary['hit_rate']['exact']:.1%}, approximate {summary['hit_rate']['approximate']:.1%}; "
              f"TTFT p50 {_ms(summary['ttft_all_s']['p50'])} ms")
    print(f"report: {out / 'report.md'}")
    return 0 if all(s["ok"] == s["requests"] for s in report["runs"]) else 1


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _run_id(out: Path) -> str:
    """The run's id, kept in out/run.json so that a resumed run uses the same keys (the same namespaces)."""
    path = out / "run.json"
    if path.exists():
        try:
            return str(json.loads(path.read_text())["id"])
        except (ValueError, KeyError):
            pass
    run_id = uuid.uuid4().hex[:8]
    path.write_text(json.dumps({"id": run_id}))
    return run_id
