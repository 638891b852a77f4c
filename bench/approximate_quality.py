"""Answer quality of approximate hits, per selector and over the plan's knobs, on the reading model that depends on
late-layer image KV (the oracle), through the reference (offline.reference.approximate: the same selection rule
the workers run, tests/engine_ext/test_reuse_worker.py checks that they agree).

    .venv/bin/python bench/approximate_quality.py [--pairs 40] [--sweep] [--vision full partial] [--chunked]
        [--tight] [--json FILE]

Pairs (A cached, B = A with one field given another value) come from offline.reader_eval. For each pair the
gateway's own matching (default pixel features, settings) plans B against A exactly as the planner would, with
the selector and knobs of each configuration; the reference executes the plan on B's prompt with A's entry as a
full prefill of A leaves it, and the reader's answer is tallied:

    changed    asked about the changed field: right = B's value, stale = A's value (the alias read as is)
    unchanged  asked about a field A and B share

``full`` is B from scratch (a miss): the accuracy every selector is held to. With ``--sweep`` the entropy-aware
plan runs over rho x beta x W (every combination) and each baseline over rho. ``--vision partial`` also runs each
configuration with B's encoder output from the partial vision pass (the alias' encoder output where nothing
changed, the vision tower over the tokens whose pixels differ and their margin only). ``--chunked`` also runs the
selectors that rank by the question's attention (entropy-aware, attention-only) ranking without it ("no-question"),
as every worker extend of an image does under chunked prefill when the image and its question are not in one
extend (engine_ext.selection).

``--tight``: quality where the recompute budget cannot hold every changed token, which is where plans chosen by
time put it. Panels of 10 to 20 fields with 10%, 30% and 50% of them changed; each selector at rho 0.05, 0.1, 0.2
and 0.3 left as it is (not widened to the changed share: engine_ext.selection's tight budgets), tallied only
where ceil(rho * n) is below the changed tokens. Prints right answers per selector, fields changed and rho.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bundled import ORACLE, QWEN2_5_VL, build_model  # noqa: E402
from bundled.reader.panels import CELL, random_panel  # noqa: E402
from bundled.reader.panels import changed as revalue  # noqa: E402
from bundled.reader.questions import FIELD, RELATIONAL_KINDS  # noqa: E402
from bundled.recipes import DEEP_READER  # noqa: E402
from gateway.config import MatchSettings  # noqa: E402
from gateway.matching.features import TokenFeatures  # noqa: E402
from gateway.matching.pixel import PixelExtractor  # noqa: E402
from gateway.matching.plans import plan_against  # noqa: E402
from offline.reader_eval import (  # noqa: E402
    CHANGED,
    UNCHANGED,
    Pair,
    Tally,
    answer_ids,
    cached_entry,
    make_pairs,
    pair_kinds,
)
from offline.reference import EncoderOutput, Fresh, ImageKV, Prompt, ReferenceModel, Reuse, capture, prefill  # noqa: E402
from offline.reference.approximate import execute, partial_encoder  # noqa: E402
from plan import ATTENTION_ONLY, CACHEBLEND, DOWNSTREAM, ENTROPY_AWARE, FULL_REUSE, SELECTORS, VLCACHE  # noqa: E402

RHOS, BETAS, WARMUPS = (0.1, 0.2, 0.3, 0.5), (0.0, 0.1, 0.2, 0.3), (1, 2, 3)
ALIAS = "0" * 64


@dataclasses.dataclass(frozen=True)
class Config:
    selector: str
    settings: MatchSettings
    vision: str = "full"
    question: bool = True  # False: ranked without the question, as a worker does under chunked prefill

    @property
    def name(self) -> str:
        s = self.settings
        knobs = {ENTROPY_AWARE: f"rho={s.recompute_share} beta={s.reuse_share} W={s.warmup_layers}",
                 ATTENTION_ONLY: f"rho={s.recompute_share} W={s.warmup_layers}",
                 DOWNSTREAM: f"rho={s.recompute_share} W={s.warmup_layers}",
                 CACHEBLEND: f"rho={s.recompute_share} W=1", VLCACHE: f"rho={s.recompute_share} W={s.warmup_layers}",
                 FULL_REUSE: "W=0"}[self.selector]
        return f"{self.selector} {knobs} vision={self.vision}{'' if self.question else ' no-question'}"


def configs(sweep: bool, visions: list[str], chunked: bool = False) -> list[Config]:
    base = MatchSettings()
    out = [Config(selector, base) for selector in SELECTORS]
    if sweep:
        for rho, beta, warmup in itertools.product(RHOS, BETAS, WARMUPS):
            settings = dataclasses.replace(base, recompute_share=rho, reuse_share=beta, warmup_layers=warmup)
            if settings != base:
                out.append(Config(ENTROPY_AWARE, settings))
        for selector in (ATTENTION_ONLY, CACHEBLEND, VLCACHE):
            out += [Config(selector, dataclasses.replace(base, recompute_share=rho)) for rho in RHOS
                    if rho != base.recompute_share]
    if chunked:  # the question-ranked selectors as they rank when the image and its question are not in one extend
        out += [dataclasses.replace(c, question=False) for c in out if c.selector in (ENTROPY_AWARE, ATTENTION_ONLY)]
    return [dataclasses.replace(c, vision=v) for v in visions for c in out]


@dataclasses.dataclass(frozen=True)
class Asked:
    """One question asked of a pair's B: its prompt, B's and A's pixel features, B's encoder output, A's entry."""

    kind: str  # CHANGED or UNCHANGED
    text: str  # the question
    prompt: Prompt
    new: TokenFeatures
    old: TokenFeatures
    encoder: EncoderOutput
    entry: ImageKV
    right: str  # B's value
    stale: str | None  # A's value, for a changed field


def asked_of(model, pair: Pair, extractor: PixelExtractor):
    """B's two questions (offline.reader_eval.Pair.questions), each with what planning and executing it needs."""
    entry = cached_entry(model, pair)
    a_image, b_image = pair.cached.render(), pair.asked.render()
    for kind, question, stale in pair.questions():
        prompt = model.prompt([b_image, question.text])
        _, h, w = prompt.images[0].grid
        yield Asked(kind=kind, text=question.text, prompt=prompt, new=extractor.extract(b_image, (h, w), CELL),
                    old=extractor.extract(a_image, (h, w), CELL), encoder=model.encode(prompt)[0], entry=entry,
                    right=question.answer, stale=stale)


def tally(tallies: dict, name, model, names: dict, asked: Asked, images: list):
    """Prefill the question's prompt with ``images``, tally the reader's answer under ``name``; returns the answer
    and the prefill's result."""
    result = prefill(model, asked.prompt, images)
    answer = names.get(int(result.logits.argmax()), "?")
    tallies[name][asked.kind].add(answer, asked.right, asked.stale)
    return answer, result


def evaluate(model, pairs, chosen: list[Config], progress: bool = True) -> dict:
    names = answer_ids(model.processor.tokenizer)
    extractor = PixelExtractor()
    tallies: dict[str, dict[str, Tally]] = defaultdict(lambda: defaultdict(Tally))
    shares: dict[str, list[float]] = defaultdict(list)
    guard: dict[str, int] = defaultdict(int)
    started = time.perf_counter()
    for done, pair in enumerate(pairs, 1):
        for asked in asked_of(model, pair, extractor):
            prompt, new, old, encoder, entry = asked.prompt, asked.new, asked.old, asked.encoder, asked.entry
            tally(tallies, "full (miss)", model, names, asked, [Fresh(encoder)])
            for config in chosen:
                plan = plan_against(new, old, alias=ALIAS, key="1" * 64, settings=config.settings,
                                    selector=config.selector, layers=model.num_layers)
                if plan is None:
                    guard[config.name] += 1
                    continue
                image_encoder = encoder
                if config.vision == "partial":
                    image_encoder, encoded = partial_encoder(model, prompt, plan, entry)
                    shares[config.name].append(encoded / plan.tokens)
                approximate, _ = execute(model, prompt, plan, image_encoder, entry, question=config.question)
                tally(tallies, config.name, model, names, asked, [approximate])
        if progress and (done % max(1, len(pairs) // 10) == 0 or done == len(pairs)):
            print(f"  {done}/{len(pairs)} pairs, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return {"tallies": tallies, "guard": guard, "encoded_share": shares, "seconds": time.perf_counter() - started}


# --- the reuse table: every reuse path, per kind of pair (--table) ---

TABLE_WARMUPS = (1, 2, 3, 4, 5, 6)
TABLE_TIGHT_RHO = 0.1  # a budget that leaves ~10% of the tokens beyond the changed ones for the selector to rank
MOVED_RATIOS = (0.0, 0.05, 0.1, 0.2)  # exact moved: uniform r (the gateway's default without a profile is 0.1)
MOVED_PREAMBLES = ("Look:", "Here is a panel for you. Read it:")  # the text before the image: stored, then asked


def table_configs(warmups: tuple[int, ...] = TABLE_WARMUPS) -> list[Config]:
    """The question-ranked and the notes selectors at every W (the default budget), each selector at W 3 with a tight
    one, the change-blind baselines at their own W."""
    base = MatchSettings()
    out = []
    for selector in (ATTENTION_ONLY, DOWNSTREAM):
        out += [Config(selector, dataclasses.replace(base, warmup_layers=w)) for w in warmups]
    out.append(Config(ENTROPY_AWARE, base))
    out += [Config(selector, base) for selector in (CACHEBLEND, VLCACHE, FULL_REUSE)]
    tight = dataclasses.replace(base, recompute_share=TABLE_TIGHT_RHO)
    out += [Config(selector, tight) for selector in (ATTENTION_ONLY, DOWNSTREAM, ENTROPY_AWARE, CACHEBLEND, VLCACHE)]
    # the gateway's plans as its defaults send them (the partial vision pass), before and after notes were judged
    out += [Config(selector, base, vision=base.vision_pass) for selector in (ATTENTION_ONLY, DOWNSTREAM)]
    return out


def evaluate_table(model, pairs: dict[str, list[Pair]], chosen: list[Config], ratios: dict[str, tuple[float, ...]],
                   progress: bool = True) -> dict:
    """Per kind of pair: B's two questions under a full prefill, the exact hits (same prefix; moved, per ratios) and
    each approximate configuration; tallies[kind][path][CHANGED or UNCHANGED]."""
    names = answer_ids(model.processor.tokenizer)
    extractor = PixelExtractor()
    tallies: dict[str, dict[str, dict[str, Tally]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(Tally)))
    guard: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    started = time.perf_counter()
    layers = model.num_layers
    for kind, chosen_pairs in pairs.items():
        for done, pair in enumerate(chosen_pairs, 1):
            for asked in asked_of(model, pair, extractor):
                into = tallies[kind]
                full, result = tally(into, "full (miss)", model, names, asked, [Fresh(asked.encoder)])
                # exact, same prefix: B's own entry as that full prefill leaves it
                own = capture(result.state, asked.prompt.images[0], asked.encoder)
                tally(into, "exact same-prefix", model, names, asked, [Reuse(own, ())])
                # exact, moved: stored after one text, asked after another
                image = pair.asked.render()
                first = model.prompt([MOVED_PREAMBLES[0], image, asked.text])
                stored = capture(prefill(model, first, [Fresh(asked.encoder)]).state, first.images[0], asked.encoder)
                moved = dataclasses.replace(asked, prompt=model.prompt([MOVED_PREAMBLES[1], image, asked.text]))
                tally(into, "full, moved prompt", model, names, moved, [Fresh(asked.encoder)])
                for label, per_layer in ratios.items():
                    tally(into, f"exact moved {label}", model, names, moved, [Reuse(stored, per_layer)])
                for config in chosen:
                    plan = plan_against(asked.new, asked.old, alias=ALIAS, key="1" * 64, settings=config.settings,
                                        selector=config.selector, layers=layers)
                    if plan is None:
                        guard[kind][config.name] += 1
                        continue
                    encoder = asked.encoder
                    if config.vision == "partial":
                        encoder, _ = partial_encoder(model, asked.prompt, plan, asked.entry)
                    approximate, _ = execute(model, asked.prompt, plan, encoder, asked.entry)
                    tally(into, config.name, model, names, asked, [approximate])
                    # the full prefill on the same questions: the bar for a configuration its guard thins out
                    into[FULL_ON + config.name][asked.kind].add(full, asked.right, asked.stale)
            if progress and (done % max(1, len(chosen_pairs) // 10) == 0 or done == len(chosen_pairs)):
                print(f"  {kind}: {done}/{len(chosen_pairs)} pairs, {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)
    return {"tallies": tallies, "guard": guard, "seconds": time.perf_counter() - started}


FULL_ON = "full on the same: "


def reuse_table(result: dict) -> str:
    """Rows: paths and configurations; per kind of pair: the changed field right / stale, an unchanged one right;
    where a configuration's guard refused some, the full prefill's right answers on the questions it planned, in
    brackets."""
    kinds = list(result["tallies"])
    paths = [path for path in dict.fromkeys(path for kind in kinds for path in result["tallies"][kind])
             if not path.startswith(FULL_ON)]
    head = f"{'path':52} " + " ".join(f"{kind + ': changed right/stale, unchanged right':>72}" for kind in kinds)
    lines = [head]
    for path in paths:
        cells = []
        for kind in kinds:
            tallies = result["tallies"][kind].get(path, {})
            c, u = tallies.get(CHANGED, Tally()), tallies.get(UNCHANGED, Tally())
            cell = (f"{_pct(c.right, c.asked)} / {_pct(c.stale, c.asked)}, {_pct(u.right, u.asked)} ({c.asked})"
                    if c.asked else "-")
            if result["guard"].get(kind, {}).get(path):
                same = result["tallies"][kind].get(FULL_ON + path, {})
                fc, fu = same.get(CHANGED, Tally()), same.get(UNCHANGED, Tally())
                cell += (f" [full {_pct(fc.right, fc.asked)}, {_pct(fu.right, fu.asked)}] "
                         f"guard {result['guard'][kind][path]}")
            cells.append(f"{cell:>72}")
        lines.append(f"{path:52} " + " ".join(cells))
    return "\n".join(lines)


def _pct(n: int, of: int) -> str:
    return f"{100 * n / of:.1f}%" if of else "-"


TIGHT_SHARES, TIGHT_RHOS = (0.1, 0.3, 0.5), (0.05, 0.1, 0.2, 0.3)


def tight_pairs(count: int, seed: int, share: float) -> list[Pair]:
    """Pairs whose B has ``share`` of A's 10 to 20 fields given other values."""
    rng = random.Random(f"tight:{seed}:{share}")
    pairs: list[Pair] = []
    while len(pairs) < count:
        a = random_panel(rng, min_fields=10, max_fields=20)
        b, keys = revalue(a, rng, max(1, round(share * len(a.fields))))
        unchanged = rng.choice([key for key in a.keys if key not in keys])
        pairs.append(Pair(cached=a, asked=b, changed=tuple(keys), unchanged=unchanged))
    return pairs


def evaluate_tight(model, count: int, seed: int, progress: bool = True) -> dict:
    """Per selector, share of fields changed and rho: B's answers under budgets below its changed tokens."""
    names = answer_ids(model.processor.tokenizer)
    extractor = PixelExtractor()
    settings = MatchSettings(max_changed_share=1.0)  # no guard: every pair is planned
    tallies: dict[tuple[str, float, float], dict[str, Tally]] = defaultdict(lambda: defaultdict(Tally))
    changed_shares: dict[float, list[float]] = defaultdict(list)
    started = time.perf_counter()
    for share in TIGHT_SHARES:
        for pair in tight_pairs(count, seed, share):
            for asked in asked_of(model, pair, extractor):
                tally(tallies, ("full (miss)", share, 0.0), model, names, asked, [Fresh(asked.encoder)])
                for selector, rho in itertools.product(SELECTORS, TIGHT_RHOS):
                    plan = plan_against(asked.new, asked.old, alias=ALIAS, key="1" * 64, settings=settings,
                                        selector=selector, layers=model.num_layers)
                    assert plan is not None
                    plan = dataclasses.replace(plan, recompute_share=rho if selector != FULL_REUSE else 0.0)
                    changed_tokens = plan.change_map.count("x")
                    if asked.kind == CHANGED and selector == ATTENTION_ONLY and rho == TIGHT_RHOS[0]:
                        changed_shares[share].append(changed_tokens / plan.tokens)
                    if math.ceil(rho * plan.tokens - 1e-6) >= changed_tokens:
                        continue  # room for every changed token: not a tight budget
                    approximate, _ = execute(model, asked.prompt, plan, asked.encoder, asked.entry)
                    tally(tallies, (selector, share, rho), model, names, asked, [approximate])
        if progress:
            print(f"  tight: {share:.0%} of fields changed done, {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
    return {"tallies": tallies, "changed_share": {s: sum(v) / len(v) for s, v in changed_shares.items() if v},
            "seconds": time.perf_counter() - started}


def tight_table(result: dict) -> str:
    """Right answers (changed field / unchanged field) per selector, rows by fields changed and rho."""
    tallies = result["tallies"]
    lines = [f"{'fields changed (tokens)':>24} {'rho':>5} " + " ".join(f"{s:>17}" for s in ("full (miss)", *SELECTORS))]
    for share in TIGHT_SHARES:
        full = tallies.get(("full (miss)", share, 0.0), {})
        for rho in TIGHT_RHOS:
            cells = [_cell(full)] + [_cell(tallies.get((s, share, rho), {})) for s in SELECTORS]
            label = f"{share:.0%} ({100 * result['changed_share'].get(share, 0):.0f}%)"
            lines.append(f"{label:>24} {rho:>5} " + " ".join(f"{c:>17}" for c in cells))
    lines.append("cells: right answers on the changed field / on an unchanged field (asked), over the pairs whose "
                 "budget was below their changed tokens")
    return "\n".join(lines)


def _cell(kinds: dict) -> str:
    c, u = kinds.get(CHANGED, Tally()), kinds.get(UNCHANGED, Tally())
    if not c.asked:
        return "-"
    return f"{100 * c.right / c.asked:.0f}/{100 * u.right / max(1, u.asked):.0f}% ({c.asked})"


def table(result: dict) -> str:
    lines = [f"{'configuration':52} {'changed right':>13} {'stale':>6} {'unchanged right':>15} {'asked':>6}"]
    for name, kinds in result["tallies"].items():
        c, u = kinds.get(CHANGED, Tally()), kinds.get(UNCHANGED, Tally())

        def pct(n: int, of: int) -> str:
            return f"{100 * n / of:.1f}%" if of else "-"

        extra = f"  guard->miss {result['guard'][name]}" if result["guard"].get(name) else ""
        shares = result["encoded_share"].get(name)
        if shares:
            extra += f"  encoded {100 * sum(shares) / len(shares):.0f}% of tokens"
        lines.append(f"{name:52} {pct(c.right, c.asked):>13} {pct(c.stale, c.asked):>6} {pct(u.right, u.asked):>15} "
                     f"{c.asked + u.asked:>6}{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--sweep", action="store_true", help="rho x beta x W for entropy-aware, rho for baselines")
    parser.add_argument("--vision", nargs="+", default=["full"], choices=["full", "partial"])
    parser.add_argument("--chunked", action="store_true",
                        help="also rank the question-ranked selectors without the question (chunked prefill)")
    parser.add_argument("--tight", action="store_true",
                        help="only the tight-budget table: rho below the changed share, per selector")
    parser.add_argument("--table", action="store_true",
                        help="the reuse table: per kind of pair, a full prefill, the exact hits (same prefix; moved "
                             "with uniform r, and a profile's ratios with --profile) and the approximate selectors at "
                             "W 1-6 and at a tight budget")
    parser.add_argument("--size", choices=(ORACLE, DEEP_READER), default=ORACLE,
                        help="the reader that judges: the oracle, or the deep reader that also takes notes")
    parser.add_argument("--kinds", nargs="+", choices=(FIELD, *RELATIONAL_KINDS), default=None,
                        help="kinds of pairs (offline.reader_eval): field, left, above; default: the reader's")
    parser.add_argument("--max-fields", type=int, default=26,
                        help="--table: fields a pair's panel has at most")
    parser.add_argument("--profile", type=Path, default=None,
                        help="--table: also an exact moved hit with this recompute profile's per-layer ratios")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    model = ReferenceModel.load(build_model(QWEN2_5_VL, args.size))
    kinds = args.kinds or list(pair_kinds(args.size))
    if args.table:
        from plan import RecomputeProfile

        ratios = {f"r={r}": (r,) * model.num_layers for r in MOVED_RATIOS}
        if args.profile:
            profile = RecomputeProfile.load(args.profile)
            ratios["profile"] = tuple(profile.ratios)
        pairs = {kind: make_pairs(args.pairs, seed=args.seed, kind=kind, max_fields=args.max_fields) for kind in kinds}
        result = evaluate_table(model, pairs, table_configs(), ratios)
        print(f"{args.size}: {args.pairs} pairs of each kind, at most {args.max_fields} fields, "
              f"{result['seconds']:.0f} s")
        print(reuse_table(result))
        if args.json:
            args.json.write_text(json.dumps({
                "size": args.size, "pairs": args.pairs, "seconds": result["seconds"],
                "tallies": {kind: {path: {k: t.as_dict() for k, t in per.items()} for path, per in paths.items()}
                            for kind, paths in result["tallies"].items()},
                "guard": result["guard"]}, indent=1))
        return 0
    if args.tight:
        tight = evaluate_tight(model, args.pairs, args.seed)
        print(tight_table(tight))
        print(f"({tight['seconds']:.0f} s)")
        if args.json:
            args.json.write_text(json.dumps({
                "tight": {f"{s} {share} {rho}": {k: t.as_dict() for k, t in kinds.items()}
                          for (s, share, rho), kinds in tight["tallies"].items()},
                "changed_share": tight["changed_share"], "seconds": tight["seconds"]}, indent=1))
        return 0
    result = evaluate(model, make_pairs(args.pairs, seed=args.seed), configs(args.sweep, args.vision, args.chunked))
    print(table(result))
    full = result["tallies"]["full (miss)"]
    for vision in args.vision:
        def rate(name: str, kind: str) -> float:
            t = result["tallies"][name][kind]
            return 100 * t.right / t.asked if t.asked else float("nan")

        ours = Config(ENTROPY_AWARE, MatchSettings(), vision).name
        for name in (ours, *([Config(ENTROPY_AWARE, MatchSettings(), vision, question=False).name] if args.chunked
                             else [])):
            print(f"\ntargets ({name}): vs full prefill: changed "
                  f"{rate(name, CHANGED) - 100 * full[CHANGED].right / full[CHANGED].asked:+.1f} points, unchanged "
                  f"{rate(name, UNCHANGED) - 100 * full[UNCHANGED].right / full[UNCHANGED].asked:+.1f} "
                  "(target within 2)")
        for baseline in (FULL_REUSE, CACHEBLEND):
            other = Config(baseline, MatchSettings(), vision).name
            print(f"  entropy-aware vs {baseline} on changed fields: "
                  f"{rate(ours, CHANGED) - rate(other, CHANGED):+.1f} points (target >= +15)")
    print(f"({result['seconds']:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({
            "tallies": {n: {k: t.as_dict() for k, t in kinds.items()} for n, kinds in result["tallies"].items()},
            "guard": result["guard"], "seconds": result["seconds"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
