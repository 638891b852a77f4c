"""Judging reuse by a reader's answers: does reused image KV change them?

Pairs (A cached, B asked), B being A with one or a few fields given another value. For each pair the reader is
asked about a changed field of B (right answer: B's value; A's value means the stale KV was read) and about an
unchanged field (right answer: the same in A and B). Two ways to run it:

reference   offline.reference executes each reference plan for B's image, given A's entry as a full prefill
            of A leaves it (encoder output, K/V, positions) and B's own encoder output. Reference plans are functions
            ``Case -> ImagePlan``; built in:
                full               B from scratch (Fresh): the accuracy every plan is held to
                stale              A's KV as they are, nothing recomputed (Reuse, ratios 0): what an approximate
                                   match must never do; on a reader that really reads it answers with A's value
                recompute_changed  the changed fields' tokens computed at every layer on B's encoder output, every
                                   other image token taken from A (Approximate, warmup 0): the cheapest plan that
                                   knows exactly what changed
gateway     through a running gateway and its SGLang workers, with the real ``openai`` client: per pair, A is
            asked first (so A is cached), then B about its changed field, then B about an unchanged field. Each
            answer is tallied under the reuse the gateway reported for it (x-revisit-reuse: miss,
            exact_same_prefix, exact_moved, approximate, and whatever later plan kinds it reports; parameters such
            as the similarity left out), so a new reuse path is measured by switching it on in the gateway, with no
            change here.

probe       the layer-sensitivity probe (offline.layer_probe): from which layers the reader takes a field.

``python -m offline.reader_eval reference|gateway|probe --size reader|oracle ...`` prints a table and can write
JSON. ``reference`` and ``gateway`` first measure plain full-prefill accuracy on fresh questions of every kind the
reader is trained on (bundled.reader.questions).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import io
import json
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bundled.reader.panels import KEYS, MAX_SIDE, Panel, changed, kind_of, random_panel, value_of_kind, with_values
from bundled.reader.questions import (
    FIELD,
    LEFT,
    RELATIONAL_KINDS,
    Question,
    anchors,
    field,
    neighbour_key,
    random_question,
    relational,
)

if TYPE_CHECKING:  # at run time, offline.reference is imported only in the functions that use it
    from offline.reference import EncoderOutput, ImageKV
    from offline.reference.plans import ImagePlan

PAIR_SEED = "pairs"
QUESTION_SEED = "questions"
CHANGED, UNCHANGED = "changed", "unchanged"


@dataclass(frozen=True)
class Pair:
    cached: Panel  # A
    asked: Panel  # B: A with the fields in `changed` given other values
    changed: tuple[str, ...]
    unchanged: str  # one key whose value A and B share
    # What B is asked (bundled.reader.questions): FIELD asks for the changed field and the unchanged one by key; a
    # relational kind (LEFT, ABOVE) names the value of ``named[0]``, whose neighbour is the changed field, and of
    # ``named[1]``, whose neighbour is the unchanged one (neither named field changed).
    kind: str = FIELD
    named: tuple[str, str] | None = None

    def questions(self) -> tuple[tuple[str, Question, str | None], tuple[str, Question, str | None]]:
        """(CHANGED or UNCHANGED, the question asked of B, A's answer to it where it differs from B's) for the two
        questions asked of B: about the changed field, and about an unchanged one."""
        out = []
        named = self.named or ("", "")
        for which, key, value_of in ((CHANGED, self.changed[0], named[0]), (UNCHANGED, self.unchanged, named[1])):
            question = field(self.asked, key) if self.kind == FIELD else relational(self.asked, self.kind, value_of)
            stale = question.over((self.cached,)).answer if which == CHANGED else None
            out.append((which, question, stale))
        return out[0], out[1]

    def question_of_cached(self) -> Question:
        """B's question about the changed field, asked of A (whose answer is A's value)."""
        return self.questions()[0][1].over((self.cached,))


def make_pairs(count: int, *, seed: int = 0, changes: int = 1, max_fields: int = len(KEYS),
               max_side: int = MAX_SIDE, kind: str = FIELD) -> list[Pair]:
    """``count`` pairs of B = A with ``changes`` fields given other values, asked questions of ``kind``."""
    if kind != FIELD:
        return relational_pairs(count, seed=seed, kind=kind, max_fields=max_fields, max_side=max_side)
    rng = random.Random(f"{PAIR_SEED}:{seed}:{changes}")
    pairs: list[Pair] = []
    while len(pairs) < count:
        a = random_panel(rng, min_fields=changes + 1, max_fields=max_fields, max_side=max_side)
        b, keys = changed(a, rng, changes)
        unchanged = rng.choice([key for key in a.keys if key not in keys])
        pairs.append(Pair(cached=a, asked=b, changed=tuple(keys), unchanged=unchanged))
    return pairs


def relational_pairs(count: int, *, seed: int = 0, kind: str = LEFT, max_fields: int = len(KEYS),
                     max_side: int = MAX_SIDE) -> list[Pair]:
    """Pairs for a relational question kind: B is A with one field changed, the neighbour (``kind``) of another
    field; B is asked about that field (its answer is the changed field's value, and A's answer is A's value of it:
    the notes a causal reader took of the neighbour went stale) and about a field whose neighbour did not change."""
    rng = random.Random(f"{PAIR_SEED}:{seed}:{kind}")
    pairs: list[Pair] = []
    while len(pairs) < count:
        a = random_panel(rng, min_fields=4, max_fields=max_fields, max_side=max_side)
        options = anchors(a, kind)
        if len(options) < 2:
            continue
        named = rng.choice(options)
        target = neighbour_key(a, kind, named)
        others = [key for key in options if key != named and key != target
                  and neighbour_key(a, kind, key) not in (target, named)]
        if target is None or not others:
            continue
        other = rng.choice(others)
        old = a.value(target)
        new = old
        while new == old:
            new = value_of_kind(rng, kind_of(old))
        b = with_values(a, {target: new})
        pairs.append(Pair(cached=a, asked=b, changed=(target,), unchanged=neighbour_key(a, kind, other) or other,
                          kind=kind, named=(named, other)))
    return pairs


def fresh_questions(count: int, *, seed: int = 0, kinds: Sequence[str] = (FIELD,)) -> list[Question]:
    """``count`` full-difficulty questions of each kind (bundled.reader.questions), from generators that training
    never uses."""
    out = []
    for kind in kinds:
        rng = random.Random(f"{QUESTION_SEED}:{seed}" + ("" if kind == FIELD else f":{kind}"))
        out += [random_question(rng, kind) for _ in range(count)]
    return out


@dataclass
class Tally:
    asked: int = 0
    right: int = 0  # B's value
    stale: int = 0  # A's value (only for changed fields, where it differs)

    def add(self, answer: str, right: str, stale: str | None = None) -> None:
        self.asked += 1
        self.right += answer == right
        self.stale += stale is not None and answer == stale

    def as_dict(self) -> dict:
        rate = (lambda n: round(n / self.asked, 4)) if self.asked else (lambda n: None)
        return {"asked": self.asked, "right": rate(self.right), "stale": rate(self.stale)}


@dataclass
class Report:
    """Per reference plan (reference) or per reported reuse (gateway): a tally for changed and for unchanged fields."""

    mode: str
    tallies: dict[str, dict[str, Tally]] = dataclasses.field(
        default_factory=lambda: defaultdict(lambda: defaultdict(Tally)))
    seconds: float = 0.0
    # gateway: (approximate hit right, its repeat right) -> pairs, for B's first question asked twice
    repeats: Counter[tuple[bool, bool]] = dataclasses.field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "seconds": round(self.seconds, 1),
                "results": {name: {kind: tally.as_dict() for kind, tally in kinds.items()}
                            for name, kinds in self.tallies.items()},
                **({"repeats": self.repeat_summary()} if self.repeats else {})}

    def repeat_summary(self) -> dict[str, int]:
        """Of the approximate hits asked again: how many each was right, and how many the repeat got worse."""
        return {"asked": sum(self.repeats.values()),
                "approximate_right": sum(n for (hit, _), n in self.repeats.items() if hit),
                "repeat_right": sum(n for (_, again), n in self.repeats.items() if again),
                "repeat_worse": self.repeats[(True, False)]}

    def table(self) -> str:
        width = max([22, *map(len, self.tallies)])
        lines = [f"{'':{width}} {'changed: right':>15} {'changed: stale':>15} {'unchanged: right':>17} {'asked':>7}"]
        for name, kinds in self.tallies.items():
            c, u = kinds.get(CHANGED, Tally()), kinds.get(UNCHANGED, Tally())

            def pct(n: int, of: int) -> str:
                return f"{100 * n / of:.1f}%" if of else "-"

            lines.append(f"{name:{width}} {pct(c.right, c.asked):>15} {pct(c.stale, c.asked):>15} "
                         f"{pct(u.right, u.asked):>17} {c.asked + u.asked:>7}")
        return "\n".join(lines)


# --- through the reference implementation ---


@dataclass(frozen=True)
class Case:
    """What a reference plan gets to plan B's image with."""

    pair: Pair
    cached: ImageKV  # A's entry, as a full prefill of A's prompt leaves it
    encoder: EncoderOutput  # B's own vision-tower output
    changed_rows: tuple[int, ...]  # image-local token indices of the changed fields (a word field has two)
    tokens: int


ReferencePlan = Callable[[Case], "ImagePlan"]


def _full(case: Case):
    from offline.reference import Fresh

    return Fresh(case.encoder)


def _stale(case: Case):
    from offline.reference import Reuse

    return Reuse(case.cached, ())


def _recompute_changed(case: Case):
    from offline.reference import Approximate

    changed_rows = set(case.changed_rows)
    return Approximate(encoder=case.encoder, alias=case.cached, warmup=0,
                       reuse=[i for i in range(case.tokens) if i not in changed_rows],
                       recompute=sorted(changed_rows))


REFERENCE_PLANS: dict[str, ReferencePlan] = {
    "full": _full, "stale": _stale, "recompute_changed": _recompute_changed,
}


def answer_ids(tokenizer) -> dict[int, str]:
    """Token id -> answer, to read the reader's greedy token."""
    from bundled.reader.batches import value_token_ids

    return {token: value for value, token in value_token_ids(tokenizer).items()}


@torch.no_grad()
def cached_entry(model, pair: Pair) -> ImageKV:
    """A's entry as a full prefill of A (asked about its unchanged field) leaves it in the store."""
    from offline.reference import Fresh, capture, prefill

    prompt = model.prompt([pair.cached.render(), field(pair.cached, pair.unchanged).text])
    encoder = model.encode(prompt)[0]
    return capture(prefill(model, prompt, [Fresh(encoder)]).state, prompt.images[0], encoder)


@torch.no_grad()
def evaluate_reference(model, pairs: Sequence[Pair], plans: dict[str, ReferencePlan] | None = None,
                       progress: Callable[[int, int], None] | None = None) -> Report:
    """``model`` is an offline.reference.ReferenceModel of the reader."""
    from offline.reference import prefill

    plans = plans or REFERENCE_PLANS
    names = answer_ids(model.processor.tokenizer)
    report = Report(mode="reference")
    started = time.perf_counter()
    for done, pair in enumerate(pairs, 1):
        entry = cached_entry(model, pair)
        image = pair.asked.render()
        b_encoder = None
        for kind, question, stale in pair.questions():
            prompt = model.prompt([image, question.text])
            if b_encoder is None:
                b_encoder = model.encode(prompt)[0]
            case = Case(pair=pair, cached=entry, encoder=b_encoder, tokens=len(prompt.images[0]),
                        changed_rows=tuple(i for k in pair.changed for i in pair.asked.token_indices(k)))
            for name, make_plan in plans.items():
                result = prefill(model, prompt, [make_plan(case)])
                answer = names.get(int(result.logits.argmax()), "?")
                report.tallies[name][kind].add(answer, question.answer, stale)
        if progress:
            progress(done, len(pairs))
    report.seconds = time.perf_counter() - started
    return report


@torch.no_grad()
def reference_accuracy(model, questions: Sequence[Question],
                       progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """Full-prefill accuracy per question kind (transformers' own forward, one prompt at a time)."""
    names = answer_ids(model.processor.tokenizer)
    right: Counter[str] = Counter()
    for done, question in enumerate(questions, 1):
        prompt = model.prompt([*(panel.render() for panel in question.panels), question.text])
        logits = model.hf_forward(prompt).logits[0, -1]
        right[question.kind] += names.get(int(logits.argmax())) == question.answer
        if progress:
            progress(done, len(questions))
    return _rates(right, questions)


def _rates(right: Counter[str], questions: Sequence[Question]) -> dict[str, float]:
    asked = Counter(question.kind for question in questions)
    return {kind: right[kind] / asked[kind] for kind in asked}


# --- through the gateway ---


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def ask(client, model: str, question: Question) -> tuple[str, str]:
    """The reader's answer through the gateway, and the reuse the gateway reported for the images."""
    images = [{"type": "image_url", "image_url": {"url": data_url(panel.render())}} for panel in question.panels]
    raw = await client.chat.completions.with_raw_response.create(
        model=model, temperature=0, max_tokens=1,
        messages=[{"role": "user", "content": [*images, {"type": "text", "text": question.text}]}],
    )
    completion = raw.parse()
    kinds = ",".join(kind.split(";")[0] for kind in raw.headers.get("x-revisit-reuse", "none").split(","))
    return (completion.choices[0].message.content or "").strip(), kinds


async def evaluate_gateway(client, model: str, pairs: Sequence[Pair], *, pause_s: float = 0.0,
                           settle: Callable[[], Awaitable[None]] | None = None,
                           progress: Callable[[int, int], None] | None = None) -> Report:
    """Per pair: A about its changed field (caches A); B about the changed field and about an unchanged one, in
    turn first (the first sight of B is the near-duplicate: approximate, where the gateway plans so; the second
    finds what that left, a derived entry); then B's first question again, tallied as "B again", and compared
    with B's first answer in ``repeats`` when that was approximate (a repeat must answer no worse).

    Between answers, ``settle`` is awaited when given (it should return once the worker's background store write of
    the last new image has landed), else ``pause_s`` is slept: otherwise the next question about that image may be
    planned as a miss again (it is tallied as such).
    """
    report = Report(mode="gateway")
    started = time.perf_counter()
    for done, pair in enumerate(pairs, 1):
        of_a = pair.question_of_cached()
        answer, reuse = await ask(client, model, of_a)
        report.tallies[f"A: {reuse}"][CHANGED].add(answer, of_a.answer)
        questions = pair.questions() if done % 2 else pair.questions()[::-1]
        answers = []  # (answer, reuse) of B's questions in turn: first, second, first again
        for turn, (kind, question, stale) in enumerate((*questions, questions[0])):
            await (settle() if settle is not None else asyncio.sleep(pause_s))
            answer, reuse = await ask(client, model, question)
            right = question.answer
            report.tallies[f"{'B again' if turn == 2 else 'B'}: {reuse}"][kind].add(answer, right, stale)
            answers.append((answer, reuse))
        (first, first_reuse), _, (again, _) = answers
        if first_reuse == "approximate":
            report.repeats[(first == right, again == right)] += 1
        if progress:
            progress(done, len(pairs))
    report.seconds = time.perf_counter() - started
    return report


async def gateway_accuracy(client, model: str, questions: Sequence[Question],
                           progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """Accuracy per question kind through the gateway."""
    right: Counter[str] = Counter()
    for done, question in enumerate(questions, 1):
        answer, _ = await ask(client, model, question)
        right[question.kind] += answer == question.answer
        if progress:
            progress(done, len(questions))
    return _rates(right, questions)


# --- command line ---


def _progress(label: str) -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        if done == total or done % max(1, total // 20) == 0:
            print(f"  {label}: {done}/{total}", file=sys.stderr, flush=True)

    return show


def pair_kinds(size: str) -> tuple[str, ...]:
    """The kinds of pairs a reader is asked by default: FIELD, and the relational kinds it was trained on."""
    from bundled.reader.train import TASKS

    return (FIELD, *(kind for kind in TASKS[size].kinds if kind in RELATIONAL_KINDS))


def main(argv: list[str] | None = None) -> int:
    from bundled.recipes import DEEP_READER, ORACLE, READER

    parser = argparse.ArgumentParser(description="A reader's accuracy, under reference plans, and from which layers "
                                                 "it reads.")
    sub = parser.add_subparsers(dest="mode", required=True)
    ref = sub.add_parser("reference", help="through offline.reference")
    gate = sub.add_parser("gateway", help="through a running gateway")
    gate.add_argument("--url", required=True, help="the gateway's base URL, e.g. http://127.0.0.1:8000/v1")
    gate.add_argument("--model", default="default", help="model name as the gateway serves it")
    gate.add_argument("--api-key", default="none")
    gate.add_argument("--pause", type=float, default=0.2, help="seconds between questions (store writes land)")
    layers = sub.add_parser("probe", help="the layer-sensitivity probe (offline.layer_probe), through the reference")
    for command in (ref, layers):
        command.add_argument("--model", default=None, help="model directory (default: the bundled --size)")
    for command in (ref, gate, layers):
        command.add_argument("--size", choices=(READER, ORACLE, DEEP_READER), default=ORACLE,
                             help="which reader: the bundled model (reference, probe) and the question kinds asked")
        command.add_argument("--pairs", type=int, default=500, help="pairs per kind of pair")
        command.add_argument("--max-fields", type=int, default=len(KEYS),
                             help="fields a pair's panel has at most (default: every panel the readers are asked)")
        command.add_argument("--pair-kinds", nargs="+", choices=(FIELD, *RELATIONAL_KINDS), default=None,
                             help="what B is asked: its changed and an unchanged field by key (field), or by the "
                                  "value next to them (left, above); default: every kind the reader was trained on")
        command.add_argument("--seed", type=int, default=0)
        command.add_argument("--json", default=None, help="also write the results here")
    for command in (ref, gate):
        command.add_argument("--questions", type=int, default=1000,
                             help="fresh questions of each kind for plain accuracy")
        command.add_argument("--changes", type=int, default=1, help="fields changed per pair")
    args = parser.parse_args(argv)
    if args.mode == "probe":
        return _probe(args)
    from bundled.reader.train import TASKS

    kinds = args.pair_kinds or pair_kinds(args.size)
    if args.changes != 1 and kinds != [FIELD]:
        parser.error("--changes applies to field pairs only (relational pairs change one field)")
    pairs = {kind: make_pairs(args.pairs, seed=args.seed, changes=args.changes, kind=kind, max_fields=args.max_fields)
             for kind in kinds}
    questions = fresh_questions(args.questions, seed=args.seed, kinds=TASKS[args.size].kinds)
    accuracy: dict[str, float] | None
    reports: dict[str, Report] = {}
    if args.mode == "reference":
        from offline.reference import ReferenceModel

        model = ReferenceModel.load(args.model or _bundled(args.size))
        accuracy = reference_accuracy(model, questions, _progress("questions")) if questions else None
        for kind, chosen in pairs.items():
            reports[kind] = evaluate_reference(model, chosen, progress=_progress(f"{kind} pairs"))
    else:
        from openai import AsyncOpenAI

        async def run() -> dict[str, float] | None:
            client = AsyncOpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=600)
            acc = await gateway_accuracy(client, args.model, questions, _progress("questions")) if questions else None
            for kind, chosen in pairs.items():
                reports[kind] = await evaluate_gateway(client, args.model, chosen, pause_s=args.pause,
                                                       progress=_progress(f"{kind} pairs"))
            return acc

        accuracy = asyncio.run(run())
    for kind, rate in (accuracy or {}).items():
        print(f"full-prefill accuracy, {args.questions} fresh {kind} questions: {100 * rate:.1f}%")
    for kind, report in reports.items():
        print(f"\n{len(pairs[kind])} {kind} pairs, {args.changes} field(s) changed, {report.seconds:.0f} s")
        print(report.table())
        if report.repeats:
            repeats = report.repeat_summary()
            print(f"approximate hits asked again: {repeats['asked']}; right the first time "
                  f"{repeats['approximate_right']}, again {repeats['repeat_right']}, right then wrong again "
                  f"{repeats['repeat_worse']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"accuracy": accuracy, "questions_per_kind": args.questions,
                       "pairs": {kind: report.as_dict() for kind, report in reports.items()}}, handle, indent=2)
    return 0


def _bundled(size: str):
    from bundled import QWEN2_5_VL, build_model

    return build_model(QWEN2_5_VL, size)


def _probe(args) -> int:
    from offline.layer_probe import probe
    from offline.reference import ReferenceModel

    model = ReferenceModel.load(args.model or _bundled(args.size))
    reports = {}
    for kind in args.pair_kinds or pair_kinds(args.size):
        chosen = make_pairs(args.pairs, seed=args.seed, kind=kind, max_fields=args.max_fields)
        report = probe(model, chosen, progress=_progress(f"{kind} pairs"))
        print(f"\n{report.pairs} {kind} pairs of at most {args.max_fields} fields differing in one field, "
              f"{model.num_layers} layers, {report.seconds:.0f} s: B asked about its changed field, layers >= l "
              "planned as below")
        print(report.table())
        print(f"notes test: {100 * report.stale_somewhere(3):.1f}% of pairs answered A's value with the changed tokens "
              f"recomputed at some l >= 3")
        reports[kind] = report
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({kind: report.as_dict() for kind, report in reports.items()}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
