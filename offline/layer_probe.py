"""The layer-sensitivity probe: from which decoder layers does a reader take an image field's value, and does it
take it from notes other tokens took?

Pairs A/B differ in one field (offline.reader_eval.make_pairs). B is asked about its changed field (by its key,
"K?", or, for relational pairs, by the value next to it: "x<?", "x^?") once per layer l = 0 .. L and per plan
below, each executed by offline.reference with A's entry as a full prefill of A leaves it, and B's own vision-tower
output. At layers < l every row is computed on B; at layers >= l:

    stale_above         every image token takes A's KV (l = 0: A's entry reused as it is)
    changed_recomputed  the changed field's tokens are computed, every other image token takes A's KV
    changed_dropped     the changed field's tokens are dropped (invisible), every other image token takes A's KV

l = L computes every layer on B: a full prefill. For each cell the probe counts B's value ("right") and A's
("stale"). A reader that reads late answers stale_above with A's value until l passes the layers it reads from, and
has nothing to read once the changed tokens are dropped there; a reader that reads at layer 0 is right in every
cell from l = 1 on, which is why the first reader could not judge approximate reuse.

``changed_recomputed`` asked a relational question is the notes test: the changed field's own K/V are B's at every
layer, and only what the other tokens hold is A's. A reader that reads the field itself stays right there; one that
answers from what the named field's token noted about its neighbour during prefill answers with A's value for the
l at and below the layers it reads those notes from. A judge of reuse that never goes stale there cannot tell a
plan that leaves stale notes from one that does not.

``python -m offline.reader_eval probe`` prints the table and can write it as JSON.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from offline.reader_eval import Pair, Tally, answer_ids, cached_entry

STALE_ABOVE, CHANGED_RECOMPUTED, CHANGED_DROPPED = "stale_above", "changed_recomputed", "changed_dropped"
PLANS = (STALE_ABOVE, CHANGED_RECOMPUTED, CHANGED_DROPPED)


@dataclass
class ProbeReport:
    layers: int
    kind: str = "field"  # the pairs' kind (offline.reader_eval.Pair.kind)
    pairs: int = 0
    seconds: float = 0.0
    tallies: dict[str, list[Tally]] = dataclasses.field(default_factory=dict)  # plan -> per l (0 .. layers)
    # per pair: the l at which changed_recomputed answered A's value (the notes test)
    stale_layers: list[list[int]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        for plan in PLANS:
            self.tallies.setdefault(plan, [Tally() for _ in range(self.layers + 1)])

    def right(self, plan: str, layer: int) -> float:
        tally = self.tallies[plan][layer]
        return tally.right / tally.asked

    def as_dict(self) -> dict:
        return {"layers": self.layers, "kind": self.kind, "pairs": self.pairs, "seconds": round(self.seconds, 1),
                "notes_stale_at_3_or_above": round(self.stale_somewhere(3), 4),
                "from_layer": {plan: [dict(tally.as_dict(), layer=layer) for layer, tally in enumerate(tallies)]
                               for plan, tallies in self.tallies.items()}}

    def table(self) -> str:
        """Per l: B's changed field right (and stale, A's value) under each plan."""
        head = (f"{'l':>3}  {'A above l: right':>16} {'stale':>6}  {'changed recomputed: right':>25} {'stale':>6}  "
                f"{'changed dropped: right':>22} {'stale':>6}")
        lines = [head]
        for layer in range(self.layers + 1):
            stale, fixed, dropped = (self.tallies[plan][layer] for plan in PLANS)
            lines.append(f"{layer:>3}  {_pct(stale.right, stale.asked):>16} {_pct(stale.stale, stale.asked):>6}  "
                         f"{_pct(fixed.right, fixed.asked):>25} {_pct(fixed.stale, fixed.asked):>6}  "
                         f"{_pct(dropped.right, dropped.asked):>22} {_pct(dropped.stale, dropped.asked):>6}")
        return "\n".join(lines)

    def stale_somewhere(self, from_layer: int = 3) -> float:
        """The notes test's figure: the share of pairs that answered A's value under ``changed_recomputed`` at some
        l >= ``from_layer`` (needs the per-pair record, ``stale_layers``)."""
        if not self.pairs:
            return 0.0
        return sum(any(layer >= from_layer for layer in layers) for layers in self.stale_layers) / self.pairs


def _pct(count: int, of: int) -> str:
    return f"{100 * count / of:.1f}%" if of else "-"


def plan_for(name: str, layer: int, encoder, entry, changed_rows: Sequence[int], tokens: int):
    """The reference's ImagePlan for B's image under plan ``name`` from layer ``layer`` on."""
    from offline.reference import Approximate

    changed = set(changed_rows)
    others = [row for row in range(tokens) if row not in changed]
    if name == STALE_ABOVE:
        return Approximate(encoder=encoder, alias=entry, warmup=layer, reuse=range(tokens), recompute=())
    if name == CHANGED_RECOMPUTED:
        return Approximate(encoder=encoder, alias=entry, warmup=layer, reuse=others, recompute=sorted(changed))
    if name == CHANGED_DROPPED:
        return Approximate(encoder=encoder, alias=entry, warmup=layer, reuse=others, recompute=())
    raise ValueError(f"unknown probe plan {name!r}; expected one of {PLANS}")


@torch.no_grad()
def probe(model, pairs: Sequence[Pair], progress: Callable[[int, int], None] | None = None) -> ProbeReport:
    """``model`` is an offline.reference.ReferenceModel of a reader; ``pairs`` differ in one field each."""
    from offline.reference import prefill

    names = answer_ids(model.processor.tokenizer)
    if len({pair.kind for pair in pairs}) > 1:
        raise ValueError("the probe's pairs are of one kind")
    report = ProbeReport(layers=model.num_layers, kind=pairs[0].kind if pairs else "field")
    started = time.perf_counter()
    for done, pair in enumerate(pairs, 1):
        if len(pair.changed) != 1:
            raise ValueError("the probe's pairs differ in exactly one field")
        entry = cached_entry(model, pair)
        (_, question, stale), _ = pair.questions()
        prompt = model.prompt([pair.asked.render(), question.text])
        encoder = model.encode(prompt)[0]
        rows, tokens = pair.asked.token_indices(pair.changed[0]), len(prompt.images[0])
        stale_at = []
        for name in PLANS:
            for layer in range(model.num_layers + 1):
                result = prefill(model, prompt, [plan_for(name, layer, encoder, entry, rows, tokens)])
                answer = names.get(int(result.logits.argmax()), "?")
                report.tallies[name][layer].add(answer, question.answer, stale)
                if name == CHANGED_RECOMPUTED and answer == stale:
                    stale_at.append(layer)
        report.stale_layers.append(stale_at)
        report.pairs = done
        if progress:
            progress(done, len(pairs))
    report.seconds = time.perf_counter() - started
    return report
