"""Sources from the project's own reader panels (:mod:`bundled.reader.panels`) on larger grids: forms and tables edited,
filled in, scrolled, and different panels of one look."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from bundled.reader import panels
from bundled.reader.panels import Panel
from offline.near_duplicates.pairs import DEFAULT_TOKENS, LARGE_TOKENS, Pair, changed_exact, shape_for
from offline.near_duplicates.scans import scrolls


@dataclass(frozen=True)
class _Look:
    """What panels of one "site" share: style, colours, font."""

    style: str
    background: tuple[int, int, int]
    ink: tuple[int, int, int]
    font_size: int


def random_look(rng: random.Random) -> _Look:
    return _Look(style=rng.choice(panels.STYLES),
                 background=(rng.randint(225, 255), rng.randint(225, 255), rng.randint(225, 255)),
                 ink=(rng.randint(0, 50), rng.randint(0, 50), rng.randint(0, 50)),
                 font_size=rng.choice((15, 16, 17)))


def random_panel(rng: random.Random, look: _Look, rows: int, cols: int, *, empty: float = 0.0) -> Panel:
    """A panel (or form) of ``rows`` x ``cols`` cells, between a third and three quarters of them fields; with
    ``empty``, that share of fields has no value yet (an empty form field shows only its key)."""
    density = rng.uniform(0.35, 0.75)
    kinds = rng.choice(((1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 0, 1), (0, 0, 0, 1), (1, 0, 0, 0)))
    fields: dict[tuple[int, int], tuple[str, str]] = {}
    taken: set[tuple[int, int]] = set()
    for row in range(rows):
        for col in range(cols):
            if (row, col) in taken or rng.random() > density:
                continue
            kind = rng.choices(panels.KINDS, weights=kinds)[0]
            if kind == "word" and (col + 1 >= cols or (row, col + 1) in taken):
                kind = "letter"
            value = "" if rng.random() < empty else panels.value_of_kind(rng, kind)
            if kind == "word":
                taken.add((row, col + 1))
            taken.add((row, col))
            fields[(row, col)] = (rng.choice(panels.KEYS), value)
    tints = {}
    if look.style == "panel":
        tints = {cell: (rng.randint(200, 245), rng.randint(200, 245), rng.randint(200, 245)) for cell in fields}
    return Panel(rows=rows, cols=cols, fields=fields, style=look.style, background=look.background, ink=look.ink,
                 font_size=look.font_size, tints=tints)


def panel_shape(rng: random.Random, tokens: tuple[int, int]) -> tuple[int, int]:
    return shape_for(rng, rng.uniform(0.6, 1.8), tokens)


def panel_edits(rng: random.Random, count: int, large: bool) -> list[Pair]:
    tokens = LARGE_TOKENS if large else DEFAULT_TOKENS
    pairs: list[Pair] = []
    for index in range(count):
        panel = random_panel(rng, random_look(rng), *panel_shape(rng, tokens))
        cell = rng.choice(sorted(panel.fields))
        key, old = panel.fields[cell]
        kind = panels.kind_of(old)
        new = old
        while new == old:
            new = panels.value_of_kind(rng, kind)
        fields = dict(panel.fields)
        fields[cell] = (key, new)
        a, b = panel.render(), replace(panel, fields=fields).render()
        pairs.append(Pair(f"doc-edit/panel/{kind}-{index}", "doc_edit", a, b, True, changed_exact(a, b), (0, 0)))
    return pairs


def form_fills(rng: random.Random, count: int, large: bool) -> list[Pair]:
    """A form with empty fields (A), then the same form with one to six of them filled in (B)."""
    tokens = LARGE_TOKENS if large else DEFAULT_TOKENS
    pairs: list[Pair] = []
    for index in range(count):
        panel = random_panel(rng, random_look(rng), *panel_shape(rng, tokens), empty=rng.uniform(0.3, 0.7))
        empty = [cell for cell, (_, value) in sorted(panel.fields.items()) if value == ""]
        if not empty:
            continue
        fields = dict(panel.fields)
        filled = rng.sample(empty, min(len(empty), rng.randint(1, 6)))
        for cell in filled:
            wide = (cell[0], cell[1] + 1) not in panel.fields and cell[1] + 1 < panel.cols and rng.random() < 0.3
            fields[cell] = (fields[cell][0], panels.value_of_kind(rng, "word" if wide else rng.choice(
                ("digit", "letter", "colour"))))
        a, b = panel.render(), replace(panel, fields=fields).render()
        pairs.append(Pair(f"form-fill/panel/{len(filled)}-fields-{index}", "form_fill", a, b, True,
                          changed_exact(a, b), (0, 0)))
    return pairs


def panel_scrolls(rng: random.Random, count: int, large: bool, whole: bool) -> list[Pair]:
    tokens = LARGE_TOKENS if large else DEFAULT_TOKENS
    pairs: list[Pair] = []
    for index in range(count):
        rows, cols = panel_shape(rng, tokens)
        tall = random_panel(rng, random_look(rng), rows + 8, cols).render()
        pairs.extend(replace(pair, name=f"{pair.name}-{index}")
                     for pair in scrolls(rng, tall, 1, "panel", (rows * cols, rows * cols), whole))
    return pairs


def panel_siblings(rng: random.Random, count: int, large: bool) -> list[Pair]:
    """Two different panels of one look: half on the same layout with every key and value drawn afresh, half on a
    different layout of the same grid."""
    tokens = LARGE_TOKENS if large else DEFAULT_TOKENS
    pairs: list[Pair] = []
    for index in range(count):
        look = random_look(rng)
        rows, cols = panel_shape(rng, tokens)
        first = random_panel(rng, look, rows, cols)
        if index % 2 == 0:
            fields = {cell: (rng.choice(panels.KEYS), panels.value_of_kind(rng, panels.kind_of(value)))
                      for cell, (_, value) in first.fields.items()}
            second, how = replace(first, fields=fields), "revalued"
        else:
            second, how = random_panel(rng, look, rows, cols), "relaid"
        a, b = first.render(), second.render()
        pairs.append(Pair(f"unrelated-same-site/panel/{how}-{index}", "unrelated_same_site", a, b, False, None,
                          None))
    return pairs
