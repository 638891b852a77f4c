"""What a reader is asked: one or two panels, a question, and its one-token answer.

    field       "K?"    one panel; the value of field K: "7", "q", "red", "cat"
    equal       "K=L?"  one panel; whether fields K and L (of one kind) hold the same value: "y" or "n"
    two_images  "K1?"   two panels that both have a field K; its value in the first ("K1?") or the second ("K2?")
    left        "K<?"   one panel; the value of the field just left of field K: "the amount next to the label Total",
                        where the amount comes first
    above       "K^?"   one panel; the value of the field just above field K: "the value over the label K"

``left`` and ``above`` are relational: the question names neither the field it is answered from nor its key, only
the field next to it, and the answer is whatever that neighbour holds. In reading order the answer's field comes
before the field the question names, so a causal decoder answers them from what the named field's token noted about
its neighbour during prefill (its "notes"): the kind of question on which reusing an unchanged token's K/V goes stale
when its neighbour changed (offline.layer_probe's notes test). (Naming the field by a value it alone holds, "x<?",
was tried first: after 1,500 steps the reader answered a random field's value 50-56% of the time, and right 22-27%.)

Every character of a question is one token in the bundled tokenizer (tested), so a question's token positions are
known: ``hops`` names the question tokens that can name a value on their own (K in "K?", K and L in "K=L?", the
image number in "K2?") and the value each names. Training asks those tokens for it too (the one-hop signal, see
bundled.reader.train).

A ``sibling`` of a question is the same question over the same panels (layout, keys, kinds, style) with every
value drawn afresh: what the oracle's training shows the question in place of the real image below its reading
layers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bundled.reader.panels import (
    KEYS,
    MAX_SIDE,
    Panel,
    kind_of,
    random_panel,
    revalued,
    value_of_kind,
    with_key,
    with_values,
)

FIELD, EQUAL, TWO_IMAGES = "field", "equal", "two_images"
QUESTION_KINDS = (FIELD, EQUAL, TWO_IMAGES)
LEFT, ABOVE = "left", "above"
RELATIONAL_KINDS = (LEFT, ABOVE)
# The neighbour a relational question's answer comes from: (rows, cols) from the cell of the value it names.
NEIGHBOUR = {LEFT: (0, -1), ABOVE: (-1, 0)}
RELATION_MARK = {LEFT: "<", ABOVE: "^"}
YES, NO = "y", "n"  # one token each (they are letter values too; the question says which is meant)


@dataclass(frozen=True)
class Question:
    kind: str
    panels: tuple[Panel, ...]
    text: str
    answer: str
    hops: tuple[tuple[int, str], ...]  # (index of a token of `text`, the value that token names)

    @property
    def key(self) -> str:
        """The (first) key the question names."""
        return self.text[0]

    def over(self, panels: tuple[Panel, ...]) -> Question:
        """The same question asked of other panels (a sibling's, or the changed panel of a pair)."""
        return ask(self.kind, panels, self.text)


def ask(kind: str, panels: tuple[Panel, ...], text: str) -> Question:
    """The question ``text`` of ``kind`` over ``panels``, with its answer and hops read off the panels."""
    if kind == FIELD:
        value = panels[0].value(text[0])
        return Question(kind, panels, text, value, ((0, value),))
    if kind == EQUAL:
        first, second = panels[0].value(text[0]), panels[0].value(text[2])
        return Question(kind, panels, text, YES if first == second else NO, ((0, first), (2, second)))
    if kind == TWO_IMAGES:
        value = panels[int(text[1]) - 1].value(text[0])
        return Question(kind, panels, text, value, ((1, value),))
    if kind in RELATIONAL_KINDS:
        target = neighbour_key(panels[0], kind, text[0])
        if target is None:
            raise ValueError(f"{text!r}: field {text[0]} has no field {kind} it")
        value = panels[0].value(target)
        return Question(kind, panels, text, value, ((1, value),))
    raise ValueError(f"unknown question kind {kind!r}; expected one of {QUESTION_KINDS}")


def neighbour_key(panel: Panel, kind: str, key: str) -> str | None:
    """The key of the field covering the cell next to ``key``'s field in the direction of relational ``kind``
    (a word's second cell counts as its field), or None."""
    row, col = panel.cell_of(key)
    drow, dcol = NEIGHBOUR[kind]
    cell = (row + drow, col + dcol)
    for key_, cells in ((k, panel.cells_of(k)) for k in panel.keys):
        if cell in cells:
            return key_
    return None


def anchors(panel: Panel, kind: str) -> list[str]:
    """Keys of the fields a relational question of ``kind`` can name: those with a neighbour that way."""
    return [key for key in panel.keys if neighbour_key(panel, kind, key) is not None]


def relational(panel: Panel, kind: str, key: str) -> Question:
    """The relational question of ``kind`` naming field ``key``."""
    return ask(kind, (panel,), f"{key}{RELATION_MARK[kind]}?")


def field(panel: Panel, key: str) -> Question:
    # "K?": the key is a token of its own for every letter (after a space, the bundled tokenizer merges some
    # letters with the space and not others).
    return ask(FIELD, (panel,), f"{key}?")


def equal(panel: Panel, key: str, other: str) -> Question:
    return ask(EQUAL, (panel,), f"{key}={other}?")


def two_images(first: Panel, second: Panel, key: str, which: int) -> Question:
    return ask(TWO_IMAGES, (first, second), f"{key}{which}?")


def random_question(rng: random.Random, kind: str, *, max_fields: int = len(KEYS),
                    max_side: int = MAX_SIDE) -> Question:
    """A question of ``kind`` over fresh panels of at most ``max_fields`` fields and ``max_side`` cells a side each;
    ``equal`` is "y" half the time, and its two fields are always of one kind (else the kinds alone would answer
    it)."""
    if kind == FIELD:
        panel = random_panel(rng, max_fields=max_fields, max_side=max_side)
        return field(panel, rng.choice(panel.keys))
    if kind == EQUAL:
        while True:
            panel = random_panel(rng, min_fields=2, max_fields=max(2, max_fields), max_side=max_side)
            key = rng.choice(panel.keys)
            kind_ = kind_of(panel.value(key))
            others = [k for k in panel.keys if k != key and kind_of(panel.value(k)) == kind_]
            if others:
                break
        other = rng.choice(others)
        if rng.random() < 0.5:
            panel = with_values(panel, {other: panel.value(key)})
        elif panel.value(other) == panel.value(key):
            panel = with_values(panel, {other: _another(rng, panel.value(key))})
        return equal(panel, key, other)
    if kind == TWO_IMAGES:
        first = random_panel(rng, max_fields=max_fields, max_side=max_side)
        key = rng.choice(first.keys)
        second = with_key(random_panel(rng, max_fields=max_fields, max_side=max_side), key, rng)
        return two_images(first, second, key, rng.choice((1, 2)))
    if kind in RELATIONAL_KINDS:
        while True:
            panel = random_panel(rng, min_fields=2, max_fields=max(2, max_fields), max_side=max_side)
            options = anchors(panel, kind)
            if options:
                return relational(panel, kind, rng.choice(options))
    raise ValueError(f"unknown question kind {kind!r}; expected one of {QUESTION_KINDS}")


def sibling(question: Question, rng: random.Random) -> Question:
    """The question over its panels with every value drawn afresh, independently of the question's own values (an
    ``equal`` sibling is again "y" half the time)."""
    panels = tuple(revalued(panel, rng) for panel in question.panels)
    if question.kind == EQUAL:
        key, other = question.text[0], question.text[2]
        value = panels[0].value(key)
        same = rng.random() < 0.5
        if same or panels[0].value(other) == value:
            panels = (with_values(panels[0], {other: value if same else _another(rng, value)}),)
    return question.over(panels)


def _another(rng: random.Random, value: str) -> str:
    new = value
    while new == value:
        new = value_of_kind(rng, kind_of(value))
    return new
