"""The response cache (gateway/response_cache), measured: how often each level answers and how often wrongly, on
the oracle reader's questions; and what a hit costs next to a KV-reuse hit and a miss.

    .venv/bin/python bench/response_cache.py quality [--groups 60] [--seed 0] [--sweep] [--json FILE]
    .venv/bin/python bench/response_cache.py latency [--size tiny|bench] [--rounds 5]

quality: groups of questions over the reader's panels (bundled.reader.panels), asked in plain English
(bundled.reader.phrasings). Each group caches one question (its seed: one phrasing over one or two panels) with
the reader's answer, then looks up probes without storing them:

    repeat                  the seed again                                    the answer stands
    paraphrase              three other phrasings of it, the same panels      the answer stands
    changed_question        another field's value, the negated equality, or   the answer may change
                            the other panel, phrased like the seed and not
    near_duplicate_asked    a panel with the asked field redrawn              the answer may change
    near_duplicate_other    a panel with another field redrawn                the answer stands
    re_encoded              the same panels uploaded as JPEG (quality 90)     the answer stands
    other_question          another question about the same fields or panel  no cached answer is right
                            that no reader answers ("What kind of value does
                            field K hold?", "How many fields does this panel
                            show?")

Requests go through the gateway's own intake (keys, token features), its sentence embedder, the guard and the
approximate-match index (the seeds' images indexed, as planning indexes them), in this process. The right answer
to a probe is the oracle's own: the reader's answer to the probe's reader form over the probe's pixels (flipped for
a negated question), from transformers' forward (offline.reference). A hit is wrong when the cached answer differs
from it. ``--sweep`` runs the thresholds (paraphrase and similar alike), the guard on and off and the changed tokens
the similar level allows; the defaults are the first line.

latency: a gateway with the response cache in front of one SGLang CPU worker (bundled model, default tiny):
end-to-end times of a miss (a new image), a KV-reuse hit (a cached image, a new question: exact_same_prefix), and
response-cache hits at each level; and the lookup cost per level inside the gateway (its histogram in /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import itertools
import json
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bundled import ORACLE, QWEN2_5_VL, build_model  # noqa: E402
from bundled.reader.panels import Panel, kind_of, random_panel, value_of_kind, with_values  # noqa: E402
from bundled.reader.phrasings import (  # noqa: E402
    OTHER_FIELD_QUESTIONS,
    OTHER_PAIR_QUESTIONS,
    OTHER_PANEL_QUESTIONS,
    Phrased,
    flip,
    phrasings,
)
from bundled.reader.questions import (  # noqa: E402
    EQUAL,
    FIELD,
    TWO_IMAGES,
    Question,
    random_question,
    two_images,
)
from bundled.reader.questions import field as field_question  # noqa: E402
from gateway.config import (  # noqa: E402
    RESPONSE_CACHE_LEVELS,
    GatewayConfig,
    MatchSettings,
    ProcessorSettings,
    ResponseCacheSettings,
)
from gateway.image_fetch import ImageFetcher  # noqa: E402
from gateway.intake import Intake, IntakeResult  # noqa: E402
from gateway.matching import extractor_for, scope  # noqa: E402
from gateway.matching.matcher import Matcher  # noqa: E402
from gateway.response_cache import Answer, ResponseCache, TextEmbedder, asked  # noqa: E402

CATEGORIES = ("repeat", "paraphrase", "changed_question", "near_duplicate_asked", "near_duplicate_other",
              "re_encoded", "other_question")
MODEL_ID = "revisit-oracle"
NAMESPACE = "bench"
THRESHOLDS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
MAX_CHANGED = (0, 2, 8)


@dataclass(frozen=True)
class Upload:
    """One image as sent: its bytes, and the pixels a worker decodes from them."""

    data: bytes
    mime: str

    @classmethod
    def of(cls, panel: Panel, jpeg_quality: int | None = None) -> Upload:
        out = io.BytesIO()
        if jpeg_quality is None:
            panel.render().save(out, format="PNG")
            return cls(out.getvalue(), "image/png")
        panel.render().save(out, format="JPEG", quality=jpeg_quality)
        return cls(out.getvalue(), "image/jpeg")

    def pixels(self) -> Image.Image:
        return Image.open(io.BytesIO(self.data)).convert("RGB")


@dataclass(frozen=True)
class Probe:
    category: str
    uploads: tuple[Upload, ...]
    phrased: Phrased  # its text, and its reader form over the panels the uploads show
    foreign: bool = False  # a question no reader answers: no answer to it is right

    def body(self) -> dict[str, Any]:
        import base64

        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": f"data:{u.mime};base64," + base64.b64encode(u.data).decode()}}
            for u in self.uploads]
        content.append({"type": "text", "text": self.phrased.text})
        return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "temperature": 0,
                "max_tokens": 1}


@dataclass
class Group:
    kind: str
    seed: Probe
    probes: list[Probe] = field(default_factory=list)


def _redrawn(panel: Panel, key: str, rng: random.Random) -> Panel:
    old = panel.value(key)
    new = old
    while new == old:
        new = value_of_kind(rng, kind_of(old))
    return with_values(panel, {key: new})


def make_groups(count: int, *, seed: int = 0) -> list[Group]:
    """``count`` groups, the question kinds in turn (see the module docstring)."""
    rng = random.Random(f"response-cache:{seed}")
    kinds = itertools.cycle((FIELD, EQUAL, TWO_IMAGES))
    groups: list[Group] = []
    while len(groups) < count:
        kind = next(kinds)
        if kind == FIELD:
            panel = random_panel(rng, min_fields=3, max_fields=8)
            question = field_question(panel, rng.choice(panel.keys))
        else:
            question = random_question(rng, kind, max_fields=8)
        groups.append(_group(rng, question))
    return groups


def _group(rng: random.Random, question: Question) -> Group:
    panels = question.panels
    uploads = tuple(Upload.of(p) for p in panels)
    own = phrasings(question)
    chosen = rng.randrange(len(own))
    seed = Probe("repeat", uploads, own[chosen])
    group = Group(question.kind, seed, [seed])
    others = [p for i, p in enumerate(own) if i != chosen]
    for phrased in rng.sample(others, 3):
        group.probes.append(Probe("paraphrase", uploads, phrased))
    # Changed questions, phrased like the seed (the closest a different question gets) and otherwise.
    if question.kind == FIELD:
        key = rng.choice([k for k in panels[0].keys if k != question.key])
        changed = phrasings(field_question(panels[0], key))
    elif question.kind == EQUAL:
        changed = phrasings(question, negated=True)
    else:
        which = 2 if question.text[1] == "1" else 1
        changed = phrasings(two_images(panels[0], panels[1], question.key, which))
    group.probes.append(Probe("changed_question", uploads, changed[chosen]))
    group.probes.append(Probe("changed_question", uploads, rng.choice([p for i, p in enumerate(changed)
                                                                       if i != chosen])))
    # Near-duplicates: the asked field redrawn, or another field.
    asked_panel = int(question.text[1]) - 1 if question.kind == TWO_IMAGES else 0
    asked_keys = {question.text[0], question.text[2]} if question.kind == EQUAL else {question.key}
    for category, index, keys in (
            ("near_duplicate_asked", asked_panel, [question.key]),
            ("near_duplicate_other", 1 - asked_panel if question.kind == TWO_IMAGES else 0,
             [k for k in panels[0].keys if k not in asked_keys] if question.kind != TWO_IMAGES else [question.key])):
        if not keys:
            continue
        edited = list(panels)
        edited[index] = _redrawn(panels[index], rng.choice(keys), rng)
        moved = question.over(tuple(edited))
        edited_uploads = tuple(Upload.of(p) for p in edited)
        for phrased in (own[chosen], rng.choice(others)):
            group.probes.append(Probe(category, edited_uploads, phrased.over(moved)))
    jpeg = tuple(Upload.of(p, jpeg_quality=90) for p in panels)
    for phrased in (own[chosen], *rng.sample(others, 2)):
        group.probes.append(Probe("re_encoded", jpeg, phrased))
    # Other questions: none has a right answer here (no reader answers them), so any hit on one is wrong.
    named = OTHER_PAIR_QUESTIONS if question.kind == EQUAL else OTHER_FIELD_QUESTIONS
    for text in (rng.choice(named).format(K=question.text[0], L=question.text[2] if question.kind == EQUAL else ""),
                 rng.choice(OTHER_PANEL_QUESTIONS)):
        group.probes.append(Probe("other_question", uploads, Phrased(text, question), foreign=True))
    return group


class OracleAnswers:
    """The oracle's answers through transformers' forward, remembered per (pixels, reader question)."""

    def __init__(self) -> None:
        from offline.reader_eval import answer_ids
        from offline.reference import ReferenceModel

        self.path = build_model(QWEN2_5_VL, ORACLE)
        self.model = ReferenceModel.load(self.path)
        self.names = answer_ids(self.model.processor.tokenizer)
        self._known: dict[tuple[bytes, ...], str] = {}
        self.asked = 0

    def __call__(self, probe: Probe) -> str | None:
        import torch

        if probe.foreign:
            return None

        key = (*(u.data for u in probe.uploads), probe.phrased.question.text.encode())
        if key not in self._known:
            prompt = self.model.prompt([*(u.pixels() for u in probe.uploads), probe.phrased.question.text])
            with torch.no_grad():
                logits = self.model.hf_forward(prompt).logits[0, -1]
            self._known[key] = self.names.get(int(logits.argmax()), "?")
            self.asked += 1
        answer = self._known[key]
        return flip(answer) if probe.phrased.negated else answer


@dataclass
class Tally:
    probes: int = 0
    hits: Counter[str] = field(default_factory=Counter)  # level -> hits
    wrong: Counter[str] = field(default_factory=Counter)  # level -> hits whose answer was not the model's
    by_category: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    def add(self, category: str, level: str | None, wrong: bool) -> None:
        self.probes += 1
        self.by_category[category]["probes"] += 1
        if level is None:
            return
        self.hits[level] += 1
        self.wrong[level] += wrong
        self.by_category[category][f"{level}_hits"] += 1
        self.by_category[category][f"{level}_wrong"] += wrong

    def as_dict(self) -> dict[str, Any]:
        hits = sum(self.hits.values())
        return {"probes": self.probes, "hits": dict(self.hits), "wrong": dict(self.wrong),
                "hit_rate": hits / self.probes if self.probes else 0.0,
                "wrong_rate_of_hits": sum(self.wrong.values()) / hits if hits else 0.0,
                "by_category": {c: dict(v) for c, v in self.by_category.items()}}


@dataclass(frozen=True)
class Prepared:
    """The groups' requests through the intake, the right answers, and an index of the seeds' images."""

    seeds: list[tuple[Probe, IntakeResult, str]]  # (seed, intake, the oracle's answer)
    probes: list[tuple[Probe, IntakeResult, str | None]]  # (probe, intake, the oracle's answer; None: none is)
    matcher: Matcher
    truth_agreement: float  # how often the oracle's answer is the panel's truth


async def prepare(groups: list[Group], oracle: OracleAnswers) -> Prepared:
    processor = ProcessorSettings.from_model_dir(oracle.path)
    config = GatewayConfig(model=MODEL_ID, workers=("http://127.0.0.1:9",), processor=processor)
    match = MatchSettings()
    extractor = extractor_for(match)
    intake = Intake(config, ImageFetcher(config.images), extractor)
    matcher = Matcher(match, scope=scope(MODEL_ID, processor, extractor), features=None)
    seeds, probes, agree, answered = [], [], 0, 0
    for group in groups:
        for probe in group.probes:
            result = await intake.process(orjson.dumps(probe.body()), namespace=NAMESPACE)
            answer = oracle(probe)
            if answer is not None:
                answered += 1
                agree += answer == probe.phrased.answer
            if probe is group.seed:
                assert answer is not None
                seeds.append((probe, result, answer))
                for image in result.images:
                    if image.features is not None:
                        matcher.add(image.key, NAMESPACE, image.features)
            probes.append((probe, result, answer))
    return Prepared(seeds, probes, matcher, agree / answered)


async def evaluate(prepared: Prepared, settings: ResponseCacheSettings, embedder: TextEmbedder,
                   timings: dict[str, list[float]] | None = None) -> Tally:
    cache = ResponseCache(settings, embedder=embedder, matcher=prepared.matcher)
    if timings is not None:
        cache.observe = lambda level, seconds: timings[level].append(seconds)
    for _seed, result, answer in prepared.seeds:
        await cache.remember(asked(result), Answer(model=MODEL_ID, message={"role": "assistant", "content": answer,
                                                                             "refusal": None},
                                                   finish_reason="stop", usage=None))
    tally = Tally()
    for probe, result, right in prepared.probes:
        found = await cache.lookup(asked(result), RESPONSE_CACHE_LEVELS[-1], result.images)
        if found.entry is None:
            tally.add(probe.category, None, False)
        else:
            tally.add(probe.category, found.level, found.entry.answer.message["content"] != right)
    return tally


def sweep_settings(sweep: bool) -> list[tuple[str, ResponseCacheSettings]]:
    base = ResponseCacheSettings(namespaces=("*",))
    out = [("defaults", base)]
    if sweep:
        for threshold, guard, max_changed in itertools.product(THRESHOLDS, (True, False), MAX_CHANGED):
            settings = dataclasses.replace(base, paraphrase_threshold=threshold, similar_text_threshold=threshold,
                                           guard=guard, similar_max_changed=max_changed)
            if settings != base:
                out.append((f"threshold={threshold} guard={'on' if guard else 'off'} changed<={max_changed}",
                            settings))
    return out


def quality(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    groups = make_groups(args.groups, seed=args.seed)
    oracle = OracleAnswers()
    prepared = asyncio.run(prepare(groups, oracle))
    print(f"{len(groups)} groups, {len(prepared.probes)} probes; the oracle answered {oracle.asked} questions, "
          f"{100 * prepared.truth_agreement:.1f}% of them as the panels say; {time.perf_counter() - started:.0f} s",
          flush=True)
    embedder = TextEmbedder()
    embedder.start().result()
    timings: dict[str, list[float]] = defaultdict(list)
    results: dict[str, dict[str, Any]] = {}

    async def run_all() -> None:
        for name, settings in sweep_settings(args.sweep):
            tally = await evaluate(prepared, settings, embedder, timings if name == "defaults" else None)
            results[name] = {"settings": {k: v for k, v in dataclasses.asdict(settings).items()
                                          if k not in ("namespaces", "embedder_path")}, **tally.as_dict()}

    asyncio.run(run_all())
    print(table(results))
    print("\nat the defaults, by category (hits / wrong per level):")
    for category in CATEGORIES:
        counts = results["defaults"]["by_category"].get(category, {})
        levels = ", ".join(f"{level} {counts.get(f'{level}_hits', 0)}/{counts.get(f'{level}_wrong', 0)}"
                           for level in RESPONSE_CACHE_LEVELS)
        print(f"  {category:22} {counts.get('probes', 0):4} probes: {levels}")
    cost = lookup_cost(embedder, prepared, timings)
    print("\nlookup cost per level (p50 / p95):")
    for level, figures in cost.items():
        print(f"  {level:28} {figures['p50_us']:9.1f} / {figures['p95_us']:9.1f} us  ({figures['n']} lookups)")
    if args.json:
        Path(args.json).write_text(json.dumps({"groups": len(groups), "probes": len(prepared.probes),
                                               "oracle_truth_agreement": prepared.truth_agreement,
                                               "results": results, "lookup_cost": cost}, indent=2))
    return 0


def lookup_cost(embedder: TextEmbedder, prepared: Prepared, timings: dict[str, list[float]]) -> dict[str, dict]:
    """Per level, from the defaults' run (its embeddings were remembered after the first use of each question);
    and the embedding of a question not seen before, which a paraphrase lookup of a new question pays."""
    fresh = []
    for i, (probe, _, _) in enumerate(prepared.probes[:100]):
        text = f"{probe.phrased.text} (variant {i})"
        started = time.perf_counter()
        embedder.encode([text])
        fresh.append(time.perf_counter() - started)
    out = {}
    for name, values in (*timings.items(), ("embedding a new question", fresh)):
        ordered = sorted(values)
        out[name] = {"n": len(ordered), "p50_us": 1e6 * statistics.median(ordered),
                     "p95_us": 1e6 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]}
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    head = f"{'configuration':38} {'hit rate':>8} " + " ".join(f"{level + ' hits/wrong':>22}"
                                                                for level in RESPONSE_CACHE_LEVELS)
    lines = [head + f" {'wrong of hits':>13}"]
    for name, result in results.items():
        cells = " ".join(f"{result['hits'].get(level, 0):>14}/{result['wrong'].get(level, 0):<7}"
                         for level in RESPONSE_CACHE_LEVELS)
        lines.append(f"{name:38} {100 * result['hit_rate']:7.1f}% {cells} "
                     f"{100 * result['wrong_rate_of_hits']:12.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sections = parser.add_subparsers(dest="section", required=True)
    q = sections.add_parser("quality", help="hit and wrong-answer rates per level on the oracle's questions")
    q.add_argument("--groups", type=int, default=60)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--sweep", action="store_true")
    q.add_argument("--json")
    lat = sections.add_parser("latency", help="a response-cache hit vs a KV-reuse hit vs a miss, through a gateway")
    lat.add_argument("--size", default="tiny", choices=("tiny", "bench"))
    lat.add_argument("--side", type=int, default=224, help="square image side in pixels")
    lat.add_argument("--rounds", type=int, default=5)
    lat.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    if args.section == "quality":
        return quality(args)
    from bench.response_cache_latency import latency

    return latency(args)


if __name__ == "__main__":
    raise SystemExit(main())
