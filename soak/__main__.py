"""``python -m soak``: run the soak and fault suite, print the report, write it as JSON and Markdown."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from soak.faults import FAULTS
from soak.run import SoakPlan, run_soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (default 30)")
    parser.add_argument("--short", action="store_true", help="each fault once under load, then stop (CI)")
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=3, help="concurrent clients (default 3)")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--gap", type=float, default=None, help="seconds of load between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("soak-report"), help="where the report goes")
    args = parser.parse_args(argv)
    faults = tuple(name for name in args.faults.split(",") if name)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    if args.short:
        plan = SoakPlan(minutes=min(args.minutes, 15.0), max_requests=args.max_requests, clients=args.clients,
                        faults=faults, once=True, warmup_s=20.0, gap_s=args.gap if args.gap is not None else 5.0,
                        seed=args.seed)
    else:
        plan = SoakPlan(minutes=args.minutes, max_requests=args.max_requests, clients=args.clients, faults=faults,
                        gap_s=args.gap if args.gap is not None else 30.0, seed=args.seed)
    started = time.monotonic()

    def say(line: str) -> None:
        print(f"[soak {time.monotonic() - started:6.0f} s] {line}", flush=True)

    report = run_soak(plan, say=say, logs=args.out / "logs")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report.as_dict(), indent=2, default=str))
    (args.out / "soak.md").write_text(report.markdown())
    print(report.markdown())
    print(f"report written to {args.out}/soak.json and soak.md, logs to {args.out}/logs")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
