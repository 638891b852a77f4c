"""Panels of labelled fields: the readers' pictures.

A panel is a grid of cells, each exactly one language-model token wide and high (28 x 28 pixels for a patch of 14
merged 2 x 2). A field shows its key, an upper-case letter, on the left of its first cell, then its value: a digit,
a lower-case letter or a colour swatch in the same cell, or a short word running on into the next cell (a word
field is two cells wide). Cells are laid out as a table (grid lines) or as a panel (a tinted background per field),
on a light background, in dark ink; styles and font sizes vary per panel, grids from 1 to 8 cells a side.

The questions asked of panels, and their one-token answers, are in bundled.reader.questions. Changing one field's
value changes the pixels of its one or two tokens only, which is what judging reuse needs: stale tokens give the
old answer.

A ``Placement`` draws a panel moved inside a larger image (a page scrolled, a frame panned, by any number of pixels):
its content then straddles tokens, and a field's key and value may fall in different tokens.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field, replace
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

CELL = 28  # pixels per language-model token: patch 14 x spatial merge 2
KEYS = string.ascii_uppercase
DIGITS = string.digits
LETTERS = string.ascii_lowercase
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 210, 20),
    "orange": (245, 130, 20),
    "purple": (130, 40, 170),
    "pink": (245, 120, 190),
    "brown": (120, 70, 30),
    "gray": (128, 128, 128),
    "black": (10, 10, 10),
}
# Three-letter words that are one token each in the bundled tokenizer (and are not colour names).
WORDS = ("air", "all", "and", "are", "art", "bar", "big", "box", "bus", "car", "cat", "cup", "dog", "ear", "eat",
         "eye", "for", "hat", "hot", "ink", "man", "map", "new", "old", "one", "sea", "sky", "sun", "tab", "top")
VALUES = tuple(DIGITS) + tuple(LETTERS) + tuple(COLOURS) + WORDS
KINDS = ("digit", "letter", "colour", "word")
STYLES = ("table", "panel")
MAX_SIDE = 8  # cells per row or column


@lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


@dataclass(frozen=True)
class Panel:
    """What a panel shows; ``render`` draws it. ``fields`` maps a field's first cell (row, col) to (key, value); a
    word field also covers (row, col + 1)."""

    rows: int
    cols: int
    fields: dict[tuple[int, int], tuple[str, str]]
    style: str = "table"
    background: tuple[int, int, int] = (255, 255, 255)
    ink: tuple[int, int, int] = (0, 0, 0)
    font_size: int = 16
    tints: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return [key for key, _ in self.fields.values()]

    def value(self, key: str) -> str:
        for k, v in self.fields.values():
            if k == key:
                return v
        raise KeyError(key)

    def cell_of(self, key: str) -> tuple[int, int]:
        for cell, (k, _) in self.fields.items():
            if k == key:
                return cell
        raise KeyError(key)

    def cells_of(self, key: str) -> list[tuple[int, int]]:
        row, col = self.cell_of(key)
        return [(row, col), (row, col + 1)] if self.value(key) in WORDS else [(row, col)]

    def token_index(self, key: str) -> int:
        """The image token (raster order) that shows this field's key."""
        row, col = self.cell_of(key)
        return row * self.cols + col

    def token_indices(self, key: str) -> list[int]:
        """Every image token (raster order) that shows part of this field."""
        return [row * self.cols + col for row, col in self.cells_of(key)]

    @property
    def size(self) -> tuple[int, int]:
        return self.cols * CELL, self.rows * CELL

    def render(self) -> Image.Image:
        image = Image.new("RGB", self.size, self.background)
        draw = ImageDraw.Draw(image)
        font = _font(self.font_size)
        wide = {cell for cell, (_, value) in self.fields.items() if value in WORDS}
        for (row, col), tint in self.tints.items():
            x, y = col * CELL, row * CELL
            width = 2 * CELL if (row, col) in wide else CELL
            draw.rectangle((x + 1, y + 1, x + width - 2, y + CELL - 2), fill=tint)
        if self.style == "table":
            for row in range(self.rows + 1):
                y = min(row * CELL, self.size[1] - 1)
                draw.line((0, y, self.size[0] - 1, y), fill=self.ink)
            for row in range(self.rows):
                for col in range(self.cols + 1):
                    if (row, col - 1) not in wide:  # a word field's two cells are one
                        x = min(col * CELL, self.size[0] - 1)
                        draw.line((x, row * CELL, x, (row + 1) * CELL), fill=self.ink)
        for (row, col), (key, value) in self.fields.items():
            x, y = col * CELL, row * CELL
            _glyph(draw, font, key, x + 1, y, self.ink)
            if value in COLOURS:
                draw.rectangle((x + 16, y + 7, x + 25, y + 20), fill=COLOURS[value])
            elif value in WORDS:
                x0, y0, _, y1 = font.getbbox(value)
                draw.text((x + 15 - x0, y + (CELL - (y1 - y0)) // 2 - y0), value, font=font, fill=self.ink)
            else:
                _glyph(draw, font, value, x + 14, y, self.ink)
        return image


@dataclass(frozen=True)
class Placement:
    """Where a panel's content sits in the image that shows it: ``top`` / ``left`` pixels into a canvas ``pad``
    (rows, cols) cells larger than the panel, the rest the panel's background. ``Placement()`` is the panel as drawn;
    ``Placement(top=28 - k, pad=(1, 0))`` its content ``k`` pixels above where one blank row would put it (a page
    scrolled by k). Both tokens and glyphs stay whole only where top and left are multiples of CELL."""

    top: int = 0
    left: int = 0
    pad: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if not (0 <= self.top <= self.pad[0] * CELL and 0 <= self.left <= self.pad[1] * CELL):
            raise ValueError(f"content at ({self.top}, {self.left}) px does not fit a pad of {self.pad} cells")

    def grid(self, panel: Panel) -> tuple[int, int]:
        """(rows, cols) of tokens of the image."""
        return panel.rows + self.pad[0], panel.cols + self.pad[1]

    def render(self, panel: Panel) -> Image.Image:
        if self == Placement():
            return panel.render()
        rows, cols = self.grid(panel)
        image = Image.new("RGB", (cols * CELL, rows * CELL), panel.background)
        image.paste(panel.render(), (self.left, self.top))
        return image

    def token_labels(self, panel: Panel) -> tuple[dict[int, str], dict[int, str]]:
        """Which image token (raster order) shows each field's key, and which its value: the token holding the key
        glyph's centre, and the value glyph's (a word's: two points along it, so both its tokens). As drawn, a
        field's first token shows both, and a word's second token its value."""
        _, cols = self.grid(panel)
        keys: dict[int, str] = {}
        values: dict[int, str] = {}

        def token(x: float, y: float) -> int:
            return int((y + self.top) // CELL) * cols + int((x + self.left) // CELL)

        for (row, col), (key, value) in panel.fields.items():
            x, y = col * CELL, row * CELL + CELL / 2
            keys[token(x + 7, y)] = key
            for dx in ((22, 40) if value in WORDS else (20,)):
                values[token(x + dx, y)] = value
        return keys, values


def _glyph(draw: ImageDraw.ImageDraw, font, text: str, left: int, top: int, ink) -> None:
    """One character centred in a 13 x 28 box."""
    x0, y0, x1, y1 = font.getbbox(text)
    draw.text((left + (13 - (x1 - x0)) // 2 - x0, top + (CELL - (y1 - y0)) // 2 - y0), text, font=font, fill=ink)


def value_of_kind(rng: random.Random, kind: str) -> str:
    if kind == "digit":
        return rng.choice(DIGITS)
    if kind == "letter":
        return rng.choice(LETTERS)
    if kind == "word":
        return rng.choice(WORDS)
    return rng.choice(tuple(COLOURS))


def kind_of(value: str) -> str:
    return ("digit" if value in DIGITS else "letter" if value in LETTERS else "word" if value in WORDS
            else "colour")


def random_panel(rng: random.Random, *, max_fields: int = len(KEYS), min_fields: int = 1,
                 max_side: int = MAX_SIDE) -> Panel:
    """A panel of ``min_fields``..``max_fields`` fields on a grid just large enough, or a little larger."""
    count = rng.randint(min_fields, max(min_fields, min(max_fields, len(KEYS))))
    kind_weights = rng.choice(((1, 1, 1, 1), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (2, 1, 1, 1)))
    kinds = rng.choices(KINDS, weights=kind_weights, k=count)
    while count + kinds.count("word") > max_side * max_side and "word" in kinds:  # words that cannot all fit
        kinds[kinds.index("word")] = "letter"
    for attempt in range(1000):
        if attempt and attempt % 50 == 0 and "word" in kinds:  # too many words to place: one becomes a letter
            kinds[kinds.index("word")] = "letter"
        needed = count + kinds.count("word")
        grids = _grids(needed, max_side, words="word" in kinds)
        rows, cols = rng.choice(grids)
        cells = _place(rng, rows, cols, kinds)
        if cells is not None:
            break
    else:
        raise ValueError(f"cannot lay out {count} fields on {max_side} x {max_side} cells")
    keys = rng.sample(KEYS, count)
    fields = {cell: (key, value_of_kind(rng, kind)) for cell, key, kind in zip(cells, keys, kinds, strict=True)}
    style = rng.choice(STYLES)
    light = rng.randint(225, 255)
    background = (light, rng.randint(225, 255), rng.randint(225, 255))
    dark = rng.randint(0, 50)
    ink = (dark, rng.randint(0, 50), rng.randint(0, 50))
    tints = {}
    if style == "panel":
        for cell in cells:
            tints[cell] = (rng.randint(200, 245), rng.randint(200, 245), rng.randint(200, 245))
    return Panel(rows=rows, cols=cols, fields=fields, style=style, background=background, ink=ink,
                 font_size=rng.choice((15, 16, 17)), tints=tints)


def _grids(needed: int, max_side: int, *, words: bool) -> list[tuple[int, int]]:
    """Grids with room for `needed` cells and not much more (at least 4 cells; two columns for a word)."""
    fits = [(r, c) for r in range(1, max_side + 1) for c in range(2 if words else 1, max_side + 1)
            if r * c >= max(needed, 4)]
    snug = [(r, c) for r, c in fits if r * c <= needed * 2 + 2]
    return snug or fits


def _place(rng: random.Random, rows: int, cols: int, kinds: list[str]) -> list[tuple[int, int]] | None:
    """A first cell per field (word fields first: they need two free cells side by side); None if they do not fit."""
    free = {(r, c) for r in range(rows) for c in range(cols)}
    cells: dict[int, tuple[int, int]] = {}
    for index in sorted(range(len(kinds)), key=lambda i: kinds[i] != "word"):
        if kinds[index] == "word":
            options = sorted(cell for cell in free if (cell[0], cell[1] + 1) in free)
        else:
            options = sorted(free)
        if not options:
            return None
        cell = rng.choice(options)
        cells[index] = cell
        free.discard(cell)
        if kinds[index] == "word":
            free.discard((cell[0], cell[1] + 1))
    return [cells[index] for index in range(len(kinds))]


def changed(panel: Panel, rng: random.Random, count: int = 1) -> tuple[Panel, list[str]]:
    """The same panel with ``count`` fields given a different value of the same kind; returns the changed keys."""
    keys = rng.sample(panel.keys, min(count, len(panel.fields)))
    fields = dict(panel.fields)
    for key in keys:
        cell = panel.cell_of(key)
        old = fields[cell][1]
        kind = kind_of(old)
        new = old
        while new == old:
            new = value_of_kind(rng, kind)
        fields[cell] = (key, new)
    return replace(panel, fields=fields), keys


def revalued(panel: Panel, rng: random.Random) -> Panel:
    """The same panel (layout, keys, kinds, style) with every value drawn afresh: a sibling, whose values are
    independent of this panel's (a drawn value may equal the old one)."""
    fields = {cell: (key, value_of_kind(rng, kind_of(value))) for cell, (key, value) in panel.fields.items()}
    return replace(panel, fields=fields)


def with_values(panel: Panel, values: dict[str, str]) -> Panel:
    """The panel with the named keys set to the given values (each of its field's kind: a word stays a word)."""
    fields = dict(panel.fields)
    for key, value in values.items():
        cell = panel.cell_of(key)
        if kind_of(value) != kind_of(fields[cell][1]):
            raise ValueError(f"{key}: {value!r} is not a {kind_of(fields[cell][1])}")
        fields[cell] = (key, value)
    return replace(panel, fields=fields)


def with_key(panel: Panel, key: str, rng: random.Random) -> Panel:
    """The panel with ``key`` among its keys: if absent, a random field is renamed to it."""
    if key in panel.keys:
        return panel
    fields = dict(panel.fields)
    cell = rng.choice(sorted(fields))
    fields[cell] = (key, fields[cell][1])
    return replace(panel, fields=fields)

