"""Panels of labelled fields: the reader's pictures, questions and answers.

A panel is a grid of cells, each exactly one language-model token wide and high (28 x 28 pixels for a patch of 14
merged 2 x 2). A filled cell is a field: its key, an upper-case letter, on the left, and its value on the right:
a digit, a lower-case letter, or a colour swatch. Cells are laid out as a table (grid lines) or as a panel (a tinted
background per field), on a light background, in dark ink; styles vary per panel.

A question names one key ("K?") and its answer is that field's value: "7", "q" or a colour name such as
"red" (one token each in the bundled tokenizer). Because a field is one token, changing one field's value changes
one image token's pixels, which is what the reuse oracle needs: a stale token gives the old answer.
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
VALUES = tuple(DIGITS) + tuple(LETTERS) + tuple(COLOURS)
KINDS = ("digit", "letter", "colour")
STYLES = ("table", "panel")
MAX_SIDE = 8  # cells per row or column


@lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


@dataclass(frozen=True)
class Panel:
    """What a panel shows; ``render`` draws it. ``fields`` maps a cell (row, col) to (key, value)."""

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

    def token_index(self, key: str) -> int:
        """The image token (raster order) that shows this field."""
        row, col = self.cell_of(key)
        return row * self.cols + col

    @property
    def size(self) -> tuple[int, int]:
        return self.cols * CELL, self.rows * CELL

    def render(self) -> Image.Image:
        image = Image.new("RGB", self.size, self.background)
        draw = ImageDraw.Draw(image)
        font = _font(self.font_size)
        for (row, col), tint in self.tints.items():
            x, y = col * CELL, row * CELL
            draw.rectangle((x + 1, y + 1, x + CELL - 2, y + CELL - 2), fill=tint)
        if self.style == "table":
            for col in range(self.cols + 1):
                x = min(col * CELL, self.size[0] - 1)
                draw.line((x, 0, x, self.size[1] - 1), fill=self.ink)
            for row in range(self.rows + 1):
                y = min(row * CELL, self.size[1] - 1)
                draw.line((0, y, self.size[0] - 1, y), fill=self.ink)
        for (row, col), (key, value) in self.fields.items():
            x, y = col * CELL, row * CELL
            _glyph(draw, font, key, x + 1, y, self.ink)
            if value in COLOURS:
                draw.rectangle((x + 16, y + 7, x + 25, y + 20), fill=COLOURS[value])
            else:
                _glyph(draw, font, value, x + 14, y, self.ink)
        return image

    def question(self, key: str) -> str:
        return question(key)


def question(key: str) -> str:
    # "K?": the key is a token of its own for every letter (after a space, the bundled tokenizer merges some letters
    # with the space and not others).
    return f"{key}?"


def _glyph(draw: ImageDraw.ImageDraw, font, text: str, left: int, top: int, ink) -> None:
    """One character centred in a 13 x 28 box."""
    x0, y0, x1, y1 = font.getbbox(text)
    draw.text((left + (13 - (x1 - x0)) // 2 - x0, top + (CELL - (y1 - y0)) // 2 - y0), text, font=font, fill=ink)


def value_of_kind(rng: random.Random, kind: str) -> str:
    if kind == "digit":
        return rng.choice(DIGITS)
    if kind == "letter":
        return rng.choice(LETTERS)
    return rng.choice(tuple(COLOURS))


def random_panel(rng: random.Random, *, max_fields: int = len(KEYS), min_fields: int = 1,
                 max_side: int = MAX_SIDE) -> Panel:
    """A panel of ``min_fields``..``max_fields`` fields on a grid just large enough, or a little larger."""
    count = rng.randint(min_fields, max(min_fields, min(max_fields, len(KEYS))))
    while True:
        rows, cols = rng.randint(1, max_side), rng.randint(1, max_side)
        if count <= rows * cols <= count * 2 + 2 and rows * cols >= 4:
            break
    cells = rng.sample([(r, c) for r in range(rows) for c in range(cols)], count)
    keys = rng.sample(KEYS, count)
    kind_weights = rng.choice(((1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (2, 1, 1)))
    fields = {}
    for cell, key in zip(cells, keys, strict=True):
        kind = rng.choices(KINDS, weights=kind_weights)[0]
        fields[cell] = (key, value_of_kind(rng, kind))
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


def changed(panel: Panel, rng: random.Random, count: int = 1) -> tuple[Panel, list[str]]:
    """The same panel with ``count`` fields given a different value of the same kind; returns the changed keys."""
    keys = rng.sample(panel.keys, min(count, len(panel.fields)))
    fields = dict(panel.fields)
    for key in keys:
        cell = panel.cell_of(key)
        old = fields[cell][1]
        kind = "digit" if old in DIGITS else "letter" if old in LETTERS else "colour"
        new = old
        while new == old:
            new = value_of_kind(rng, kind)
        fields[cell] = (key, new)
    return replace(panel, fields=fields), keys
