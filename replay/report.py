"""A replay's report: what was served and how fast, as JSON and Markdown, with plots (PNG, matplotlib).

Figures per run (one per reuse mode with ``--compare``):

- images by what ran (miss, exact_same_prefix, exact_moved, approximate, or plain SGLang where nothing was
  planned) and by what was planned, and the hit
  rates: exact, approximate, either; per workload family too;
- time to first token and latency, p50 / p95 / mean, per request kind (the kind its images got, "mixed" when they
  differ, "none" without images or with reuse off), and time to first token per prompt size (``SIZE_BUCKETS``, by
  the prompt tokens the worker counted: a request's images are most of them), side by side across runs;
- the gateway's own counts over the same run (``/admin/stats`` sampled before, during and after): its plans, which
  must equal what the headers said when nothing else used the gateway meanwhile, and the tier traffic: hits per
  tier, promotions, demotions, admissions and evictions;
- with several runs, each request's TTFT against its own TTFT in the baseline run (mode ``off`` where it was run,
  else the last): the median and geometric mean of those ratios, over every request, per prompt size and per kind
  (``paired``). Percentiles of two runs compare two crowds; the paired ratios compare each request with itself.

Plots: hit rate by kind over the run (``hit_rate.png``), TTFT CDF per kind (``ttft_cdf.png``, one panel per run),
tier traffic over time (``tier_traffic.png``: L2 and L3 hits, promotions, demotions, admissions and evictions, and
L1, the prompt tokens SGLang's own prefix cache served), store bytes the workers read per hit
(``bytes_per_hit.png``, from their ``/metrics`` where the replay can reach them).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replay.runner import PLAIN, Run

KINDS = ("miss", "exact_same_prefix", "exact_moved", "approximate", PLAIN)
EXACT = ("exact_same_prefix", "exact_moved")
WINDOW = 50  # images per point of the hit-rate plot
# Prompt sizes in tokens: (label, at least, under).
SIZE_BUCKETS = (("< 128", 0, 128), ("128-511", 128, 512), ("512-1023", 512, 1024), ("1024-2047", 1024, 2048),
                (">= 2048", 2048, 1 << 62))


def size_bucket(prompt_tokens: int | None) -> str | None:
    """The label of the SIZE_BUCKETS a prompt of that many tokens falls in; None when the count is unknown."""
    if prompt_tokens is None:
        return None
    return next(label for label, low, high in SIZE_BUCKETS if low <= prompt_tokens < high)


def request_kind(reuse: Sequence[str]) -> str:
    kinds = set(reuse)
    return "none" if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"


def _rates(kinds: Counter[str]) -> dict[str, float]:
    images = sum(kinds.values())
    exact = sum(kinds[k] for k in EXACT)
    return {"exact": exact / images if images else 0.0, "approximate": kinds["approximate"] / images if images else 0.0,
            "any": (exact + kinds["approximate"]) / images if images else 0.0}


def _spread(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p95": None, "mean": None}
    ordered = sorted(values)
    return {"n": len(ordered), "p50": _quantile(ordered, 0.5), "p95": _quantile(ordered, 0.95),
            "mean": statistics.fmean(ordered)}


def _quantile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _delta(first: Any, last: Any) -> Any:
    """last - first, field by field, for nested dicts of counts."""
    if isinstance(last, dict):
        return {k: _delta(first.get(k, 0) if isinstance(first, dict) else 0, v) for k, v in last.items()}
    if isinstance(last, (int, float)) and not isinstance(last, bool):
        return last - (first if isinstance(first, (int, float)) else 0)
    return last


def summarize(run: Run) -> dict[str, Any]:
    results = run.results
    ok = [r for r in results if r.ok]
    ran = Counter(kind for r in ok for kind in r.reuse)
    planned = Counter(kind for r in ok for kind in r.planned)
    families: dict[str, Counter[str]] = {}
    for r in ok:
        families.setdefault(r.family or "-", Counter()).update(r.reuse)
    by_kind: dict[str, list[Any]] = {}
    for r in ok:
        by_kind.setdefault(request_kind(r.reuse), []).append(r)
    statuses = Counter(str(r.status) if not r.error or r.status != 200 else "stream error" for r in results
                       if not r.ok)
    summary: dict[str, Any] = {
        "url": run.settings.url, "mode": run.settings.mode, "paced": run.settings.paced,
        "speed": run.settings.speed, "concurrency": run.settings.concurrency,
        "requests": len(results), "ok": len(ok), "failed": dict(statuses), "wall_s": run.wall_s,
        "images": {"ran": {k: ran[k] for k in KINDS}, "planned": {k: planned[k] for k in KINDS},
                   "derived": sum(r.derived for r in ok),
                   "prefix_cached": sum(r.prefix_cached for r in ok),
                   "total": sum(ran.values())},
        "hit_rate": _rates(ran),
        "hit_rate_by_family": {family: _rates(kinds) for family, kinds in sorted(families.items())},
        "ttft_s": {kind: _spread([r.ttft_s for r in rs if r.ttft_s is not None]) for kind, rs in by_kind.items()},
        "latency_s": {kind: _spread([r.latency_s for r in rs if r.latency_s is not None])
                      for kind, rs in by_kind.items()},
        "ttft_all_s": _spread([r.ttft_s for r in ok if r.ttft_s is not None]),
        "ttft_by_size_s": {label: _spread([r.ttft_s for r in ok if r.ttft_s is not None
                                           and size_bucket(r.prompt_tokens) == label])
                           for label, _, _ in SIZE_BUCKETS},
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "store_tokens": sum(r.store_tokens for r in ok),
    }
    if len(run.samples) >= 2:
        first, last = run.samples[0].stats, run.samples[-1].stats
        admin_plans = _delta(first.get("plans", {}), last.get("plans", {}))
        summary["gateway"] = {
            "plans": {k: admin_plans.get(k, 0) for k in KINDS if k != PLAIN},
            "plans_match_headers": all(admin_plans.get(k, 0) == planned[k] for k in KINDS if k != PLAIN),
            "hits": _delta(first.get("hits", {}), last.get("hits", {})),
            "decisions": _delta(first.get("decisions", {}), last.get("decisions", {})),
            "evictions": _delta(first.get("evictions", {}), last.get("evictions", {})),
            "entries_at_end": {tier: usage.get("entries") for tier, usage in last.get("tiers", {}).items()},
            # images planned as misses though something stored was near them, by why (planner.REFUSALS)
            "refused": {k: v for k, v in _delta(first.get("refused", {}), last.get("refused", {})).items() if v},
            # The gateway's predictions of its requests' TTFT against what they took, by what they ran as, over
            # its last requests served alone (every run against that gateway so far, this one's last).
            "predicted": (last.get("worker_costs") or {}).get("predicted") or {},
        }
        hits = sum(ran[k] for k in (*EXACT, "approximate"))
        if run.samples[0].bytes_read is not None and run.samples[-1].bytes_read is not None:
            read = run.samples[-1].bytes_read - run.samples[0].bytes_read
            summary["gateway"]["store_bytes_read"] = read
            summary["gateway"]["bytes_per_hit"] = read / hits if hits else None
    return summary


def paired(runs: Sequence[Run]) -> dict[str, Any] | None:
    """Each run's TTFT per request over the same request's in the baseline run (``off`` if run, else the last):
    median and geometric mean of the ratios, over all requests both served, per prompt size and per request kind
    (the kind in the run, not the baseline). None with fewer than two runs."""
    if len(runs) < 2:
        return None
    base = next((r for r in runs if r.settings.mode == "off"), runs[-1])
    base_ttft = {r.index: r.ttft_s for r in base.results if r.ok and r.ttft_s}
    out: dict[str, Any] = {"baseline": base.settings.mode, "runs": {}}
    for run in runs:
        if run is base:
            continue
        groups: dict[str, dict[str, list[float]]] = {"all": {"all": []}, "size": {}, "kind": {}}
        for r in run.results:
            if not (r.ok and r.ttft_s and r.index in base_ttft):
                continue
            ratio = r.ttft_s / base_ttft[r.index]
            groups["all"]["all"].append(ratio)
            if (size := size_bucket(r.prompt_tokens)) is not None:
                groups["size"].setdefault(size, []).append(ratio)
            groups["kind"].setdefault(request_kind(r.reuse), []).append(ratio)
        groups["size"] = {label: groups["size"][label] for label, _, _ in SIZE_BUCKETS if label in groups["size"]}
        out["runs"][run.settings.mode] = {
            group: {label: _ratios(values) for label, values in by.items()} for group, by in groups.items()}
    return out


def _ratios(values: list[float]) -> dict[str, float | int]:
    return {"n": len(values), "median": statistics.median(values),
            "geomean": statistics.geometric_mean(values)}


def write_report(runs: Sequence[Run], out_dir: Path, *, trace_name: str = "",
                 interleaved: bool = False) -> dict[str, Any]:
    """report.json, report.md and the plots in out_dir; returns the report. ``interleaved``: the runs were replayed
    together, request by request (replay.runner.replay_interleaved)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"trace": trace_name, "interleaved": interleaved, "runs": [summarize(run) for run in runs],
              "paired": paired(runs)}
    plots = plot(runs, out_dir)
    report["plots"] = [p.name for p in plots]
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    (out_dir / "report.md").write_text(markdown(report))
    return report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def markdown(report: dict[str, Any]) -> str:
    runs = report["runs"]
    lines = [f"# Replay of {report['trace'] or 'a trace'}", ""]
    lines += ["| | " + " | ".join(f"mode {r['mode']}" for r in runs) + " |",
              "|---|" + "---|" * len(runs)]

    def row(name: str, cells: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    row("requests (ok)", [f"{r['requests']} ({r['ok']})" for r in runs])
    row("wall time", [f"{r['wall_s']:.0f} s" for r in runs])
    row("images", [str(r["images"]["total"]) for r in runs])
    for kind in KINDS:
        row(f"images: {kind}", [str(r["images"]["ran"][kind]) for r in runs])
    row("images: exact on a derived entry", [str(r["images"].get("derived", 0)) for r in runs])
    row("images: planned, held by SGLang's prefix cache", [str(r["images"].get("prefix_cached", 0)) for r in runs])
    for rate in ("exact", "approximate", "any"):
        row(f"hit rate: {rate}", [f"{r['hit_rate'][rate]:.1%}" for r in runs])
    row("TTFT p50 / p95 (ms)", [f"{_ms(r['ttft_all_s']['p50'])} / {_ms(r['ttft_all_s']['p95'])}" for r in runs])
    row("prompt tokens cached by SGLang", [f"{r['cached_tokens']} of {r['prompt_tokens']}" for r in runs])
    row("prompt tokens read from the store", [f"{r.get('store_tokens', 0)} of {r['prompt_tokens']}" for r in runs])
    row("prompt tokens reused (both)", [f"{r['cached_tokens'] + r.get('store_tokens', 0)} of {r['prompt_tokens']}"
                                        for r in runs])
    for label, _, _ in SIZE_BUCKETS:
        spreads = [r.get("ttft_by_size_s", {}).get(label, {}) for r in runs]
        if any(spread.get("n") for spread in spreads):
            row(f"TTFT p50 / p95 (ms), prompts of {label} tokens",
                [f"{_ms(s_.get('p50'))} / {_ms(s_.get('p95'))} (n {s_.get('n', 0)})" for s_ in spreads])
    if report.get("paired"):
        lines += _paired_lines(report["paired"], interleaved=bool(report.get("interleaved")))
    for r in runs:
        lines += ["", f"## Mode {r['mode']}", "", "| request kind | n | TTFT p50 ms | TTFT p95 ms | latency p50 ms |",
                  "|---|---|---|---|---|"]
        for kind, spread in sorted(r["ttft_s"].items()):
            latency = r["latency_s"].get(kind, {})
            lines.append(f"| {kind} | {spread['n']} | {_ms(spread['p50'])} | {_ms(spread['p95'])} | "
                         f"{_ms(latency.get('p50'))} |")
        lines += ["", "| family | exact | approximate | any |", "|---|---|---|---|"]
        for family, rates in r["hit_rate_by_family"].items():
            lines.append(f"| {family} | {rates['exact']:.1%} | {rates['approximate']:.1%} | {rates['any']:.1%} |")
        if "gateway" in r:
            g = r["gateway"]
            lines += ["", "The gateway's own counts over the run (/admin/stats): plans "
                      + ", ".join(f"{k} {v}" for k, v in g["plans"].items())
                      + (" (equal to the headers')" if g["plans_match_headers"] else " (NOT equal to the headers': "
                         "did other traffic use the gateway?)"),
                      "", "Tier traffic: exact hits " + _by_tier(g["hits"].get("exact", {}))
                      + "; approximate hits " + _by_tier(g["hits"].get("approximate", {}))
                      + "; decisions " + (", ".join(f"{k} {v}" for k, v in g["decisions"].items() if v) or "none")
                      + "; evictions " + ", ".join(f"{t} {sum(v.values())}" for t, v in g["evictions"].items())]
            if g.get("refused"):
                lines += ["", "Images planned as misses though something stored was near them, by why: "
                          + ", ".join(f"{k} {v}" for k, v in g["refused"].items())
                          + " (cost: predicted not to beat plain SGLang)"]
            if g.get("predicted"):
                lines += ["", "The gateway's predicted TTFT against the measured, by what ran (its last requests "
                          "served alone; the median of each):", "",
                          "| ran as | requests | predicted / measured | relative error |", "|---|---|---|---|"]
                for kind, row_ in g["predicted"].items():
                    lines.append(f"| {kind} | {row_['requests']} | {row_['predicted_over_measured']:.2f} | "
                                 f"{row_['relative_error']:.1%} |")
            if g.get("bytes_per_hit") is not None:
                lines += ["", f"Store bytes the workers read: {g['store_bytes_read'] / 1048576:.1f} MiB, "
                          f"{g['bytes_per_hit'] / 1024:.1f} KiB per hit"]
        if r["failed"]:
            lines += ["", "Failed: " + ", ".join(f"{k}: {v}" for k, v in r["failed"].items())]
    lines += ["", "Plots: " + ", ".join(f"![{p}]({p})" for p in report.get("plots", []))]
    return "\n".join(lines) + "\n"


def _paired_lines(pairs: dict[str, Any], *, interleaved: bool) -> list[str]:
    how = ("replayed together, request by request" if interleaved else
           "replayed one after the other: on a shared machine the run that goes first is often a few percent slower, "
           "so compare with --interleave")
    lines = ["", f"## Each request against itself in mode {pairs['baseline']}", "",
             f"TTFT of the same request over its TTFT in mode {pairs['baseline']} (runs {how}):", "",
             "| mode | requests | n | median | geometric mean |", "|---|---|---|---|---|"]
    for mode, groups in pairs["runs"].items():
        for group in ("all", "size", "kind"):
            for label, ratio in groups[group].items():
                name = "all" if group == "all" else f"prompts of {label} tokens" if group == "size" else label
                lines.append(f"| {mode} | {name} | {ratio['n']} | {ratio['median']:.3f} | {ratio['geomean']:.3f} |")
    return lines


def _by_tier(hits: dict[str, int]) -> str:
    return ", ".join(f"{tier} {count}" for tier, count in hits.items()) or "none"


def plot(runs: Sequence[Run], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    colours = {PLAIN: "#ff8a65", "miss": "#9e9e9e", "exact_same_prefix": "#1b5e20", "exact_moved": "#66bb6a",
               "approximate": "#1e88e5", "mixed": "#8e24aa", "none": "#ef6c00"}

    figure, axes = plt.subplots(len(runs), 1, figsize=(9, 3.2 * len(runs)), squeeze=False)
    for axis, run in zip(axes[:, 0], runs, strict=True):
        images = [kind for r in run.results if r.ok for kind in r.reuse]
        for kind in KINDS:
            points = [(i + WINDOW, sum(k == kind for k in images[i:i + WINDOW]) / WINDOW)
                      for i in range(0, max(0, len(images) - WINDOW + 1), max(1, WINDOW // 5))]
            if points:
                axis.plot(*zip(*points, strict=True), label=kind, color=colours[kind])
        if not images[WINDOW - 1:]:
            axis.text(0.5, 0.5, f"fewer than {WINDOW} images served", ha="center", transform=axis.transAxes)
        axis.set_ylim(0, 1)
        axis.set_xlabel("images served")
        axis.set_ylabel(f"share of the last {WINDOW}")
        axis.set_title(f"What the images got over the run (mode {run.settings.mode})")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    paths.append(_save(figure, out_dir / "hit_rate.png"))

    figure, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False, sharey=True)
    for axis, run in zip(axes[0], runs, strict=True):
        by_kind: dict[str, list[float]] = {}
        for r in run.results:
            if r.ok and r.ttft_s is not None:
                by_kind.setdefault(request_kind(r.reuse), []).append(r.ttft_s * 1000)
        for kind, values in sorted(by_kind.items()):
            values.sort()
            axis.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                      label=f"{kind} ({len(values)})", color=colours.get(kind))
        axis.set_xscale("log")
        axis.set_xlabel("time to first token (ms)")
        axis.set_title(f"TTFT by what the request got (mode {run.settings.mode})")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    axes[0][0].set_ylabel("share of requests")
    figure.tight_layout()
    paths.append(_save(figure, out_dir / "ttft_cdf.png"))

    figure, axes = plt.subplots(len(runs), 1, figsize=(9, 3.2 * len(runs)), squeeze=False)
    for axis, run in zip(axes[:, 0], runs, strict=True):
        if len(run.samples) < 2:
            axis.text(0.5, 0.5, "no /admin/stats samples (run with the admin token)", ha="center",
                      transform=axis.transAxes)
        else:
            first = run.samples[0].stats
            times = [s.at_s for s in run.samples]
            series = {
                "exact hits, DRAM (L2)": lambda s: s["hits"]["exact"].get("dram", 0),
                "exact hits, LMDB (L3)": lambda s: s["hits"]["exact"].get("lmdb", 0),
                "approximate hits, DRAM (L2)": lambda s: s["hits"]["approximate"].get("dram", 0),
                "approximate hits, LMDB (L3)": lambda s: s["hits"]["approximate"].get("lmdb", 0),
                "promotions": lambda s: s["decisions"].get("promote", 0),
                "demotions": lambda s: s["decisions"].get("demote", 0),
                "admissions": lambda s: s["decisions"].get("admit", 0),
                "evictions": lambda s: sum(sum(v.values()) for v in s["evictions"].values()),
            }
            for name, read in series.items():
                base = read(first)
                axis.plot(times, [read(s.stats) - base for s in run.samples], label=name)
            # L1: what SGLang's own prefix cache served, in prompt tokens, as the requests ended.
            ended = sorted((r.sent_s + (r.latency_s or 0.0), r.cached_tokens or 0) for r in run.results if r.ok)
            if ended:
                tokens = axis.twinx()
                total = 0
                cumulative = []
                for _, cached in ended:
                    total += cached
                    cumulative.append(total)
                tokens.plot([t for t, _ in ended], cumulative, color="#444", linestyle="--",
                            label="L1: prompt tokens from SGLang's prefix cache (right axis)")
                tokens.set_ylabel("prompt tokens")
                tokens.legend(fontsize=7, loc="lower right")
        axis.set_xlabel("seconds into the run")
        axis.set_ylabel("count since the start")
        axis.set_title(f"Tier traffic (mode {run.settings.mode})")
        axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    paths.append(_save(figure, out_dir / "tier_traffic.png"))

    figure, axis = plt.subplots(figsize=(9, 3.5))
    drawn = False
    for run in runs:
        per_hit: list[tuple[float, float]] = []
        for before, after in zip(run.samples, run.samples[1:], strict=False):
            if before.bytes_read is None or after.bytes_read is None:
                continue
            hits = sum(sum(after.stats["hits"][t].values()) - sum(before.stats["hits"][t].values())
                       for t in ("exact", "approximate"))
            if hits > 0:
                per_hit.append((after.at_s, (after.bytes_read - before.bytes_read) / hits / 1024))
        if per_hit:
            axis.plot(*zip(*per_hit, strict=True), marker=".", label=f"mode {run.settings.mode}")
            drawn = True
    if drawn:
        axis.legend(fontsize=8)
    else:
        axis.text(0.5, 0.5, "no hits, or the workers' /metrics were out of reach", ha="center",
                  transform=axis.transAxes)
    axis.set_xlabel("seconds into the run")
    axis.set_ylabel("KiB read per hit")
    axis.set_title("Store bytes the workers read per hit (per sampling interval)")
    figure.tight_layout()
    paths.append(_save(figure, out_dir / "bytes_per_hit.png"))
    return paths


def _save(figure: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
