"""Optional sources: documentation pages (python3.11-doc, sqlite3-doc) rendered by headless Chromium, one word edited in
the HTML and rendered again; renders are cached in ``render_dir``."""

from __future__ import annotations

import hashlib
import logging
import random
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from PIL import Image

from offline.near_duplicates.pairs import (
    DEFAULT_TOKENS,
    EDIT_WORDS,
    LARGE_TOKENS,
    TOKEN,
    Counts,
    Pair,
    changed_exact,
)
from offline.near_duplicates.scans import photo_of, photos, scrolls, window

log = logging.getLogger(__name__)


# Documentation sites: (name, root, page globs). Pages of one site share a stylesheet, header and sidebar.
DOC_SITES = (("python", Path("/usr/share/doc/python3.11/html"), ("library/*.html", "tutorial/*.html",
                                                                  "reference/*.html", "howto/*.html")),
             ("sqlite", Path("/usr/share/doc/sqlite3"), ("*.html",)))
MIN_PAGE_BYTES = 12_000  # smaller pages are mostly navigation


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def site_pages(root: Path, globs: Sequence[str]) -> list[Path]:
    pages = sorted({page for pattern in globs for page in root.glob(pattern)})
    return [page for page in pages if page.stat().st_size >= MIN_PAGE_BYTES]


@dataclass(frozen=True)
class Renderer:
    """Headless Chromium screenshots of HTML, cached by content and size: a second build reads them back."""

    chromium: str
    cache: Path

    def html(self, page: Path) -> str:
        """The page's HTML with a <base> that points at its own directory, so a copy elsewhere (edited) finds its
        stylesheets and renders exactly like the original."""
        text = page.read_text(encoding="utf-8", errors="replace")
        base = f'<base href="{page.parent.as_uri()}/">'
        head = re.search(r"<head[^>]*>", text, flags=re.IGNORECASE)
        return text[:head.end()] + base + text[head.end():] if head else base + text

    def render(self, html: str, width: int, height: int) -> Image.Image:
        key = hashlib.sha256(f"{width}x{height}\n{html}".encode()).hexdigest()[:24]
        png = self.cache / f"{key}.png"
        if not png.exists():
            source = self.cache / "html" / f"{key}.html"
            source.parent.mkdir(parents=True, exist_ok=True)
            source.write_text(html, encoding="utf-8")
            with tempfile.TemporaryDirectory() as profile:
                shot = Path(profile) / "shot.png"
                subprocess.run([self.chromium, "--headless", "--no-sandbox", "--disable-gpu",
                                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                                "--no-first-run", f"--user-data-dir={profile}/user", "--hide-scrollbars",
                                "--force-device-scale-factor=1", f"--window-size={width},{height}",
                                f"--screenshot={shot}", source.as_uri()],
                               capture_output=True, check=True, timeout=120)
                shutil.move(shot, png)
        with Image.open(png) as image:
            return image.convert("RGB")

    def render_all(self, jobs: Sequence[tuple[str, int, int]]) -> list[Image.Image]:
        with ThreadPoolExecutor(max_workers=4) as pool:
            return list(pool.map(lambda job: self.render(*job), jobs))


_WORD = re.compile(r"\b[a-z]{4,12}\b")


def edit_html(html: str, rng: random.Random) -> tuple[str, str] | None:
    """The HTML with one word of the text of its first paragraphs (those after the first heading: on screen)
    replaced by another word of them; and a label "old>new". None if there is no such word."""
    heading = re.search(r"<h1", html, flags=re.IGNORECASE)
    start = heading.end() if heading else 0
    spots: list[tuple[int, int, str]] = []
    for paragraph in list(re.finditer(r"<p[ >].*?</p>", html[start:], flags=re.IGNORECASE | re.DOTALL))[:3]:
        for text in re.finditer(r">([^<]+)<", paragraph.group(0)):
            offset = start + paragraph.start() + text.start(1)
            spots.extend((offset + word.start(), offset + word.end(), word.group(0))
                         for word in _WORD.finditer(text.group(1)))
    if not spots:
        return None
    begin, end, old = rng.choice(spots)
    others = sorted({word for _, _, word in spots if word != old}) or [w for w in EDIT_WORDS if w != old]
    new = rng.choice(others)
    return html[:begin] + new + html[end:], f"{old}>{new}"


def rendered_pairs(rng: random.Random, counts: Counts, large: bool, render_dir: Path | None,
                    notes: list[str], per_family: int | None) -> dict[str, list[Pair]]:
    """Pairs from rendered documentation pages: one word edited in the HTML; scrolls of a tall render; two different
    pages of one site (same header, sidebar and stylesheet); a page against a photo."""
    if render_dir is None:
        notes.append("rendered docs: skipped (no render_dir)")
        return {}
    chromium = find_chromium()
    sites = [(name, site_pages(root, globs)) for name, root, globs in DOC_SITES if root.is_dir()]
    sites = [(name, pages) for name, pages in sites if len(pages) >= 4]
    if chromium is None or not sites:
        notes.append("rendered docs: skipped (needs chromium and python3.11-doc or sqlite3-doc: apt-get install "
                     "chromium python3.11-doc sqlite3-doc)")
        return {}
    render_dir.mkdir(parents=True, exist_ok=True)
    renderer = Renderer(chromium, render_dir)
    per_source = counts.per_source if per_family is None else min(counts.per_source, per_family)
    same_site = counts.same_site if per_family is None else min(counts.same_site, per_family)
    widths, height = ((1680,), 2240) if large else ((812, 1036, 1232), 1680)

    def rows_for(r: random.Random, cols: int) -> int:
        """Window rows: 70 (4,200 tokens at 60 columns) when large, else within DEFAULT_TOKENS and 30 rows."""
        return 70 if large else max(DEFAULT_TOKENS[0] // cols + 1, min(30, r.randint(*DEFAULT_TOKENS) // cols))

    # Plan: which page at which width for what, then render everything at once (in parallel, cached).
    plan: list[tuple[str, str, Path, int]] = []  # (use, site, page, width)
    for use, number in (("edit", per_source + per_source // 2), ("whole", per_source), ("partial", per_source),
                        ("unrelated", max(1, counts.unrelated // 5) if per_family is None else 1)):
        for index in range(number):
            site, pages = sites[index % len(sites)]
            plan.append((use, site, rng.choice(pages), rng.choice(widths)))
    siblings = []
    for index in range(same_site * len(sites)):
        site, pages = sites[index % len(sites)]
        first, second = rng.sample(pages, 2)
        siblings.append((site, first, second, rng.choice(widths)))
    originals: dict[tuple[Path, int], str] = {}
    for _, _, page, width in plan:
        originals[(page, width)] = renderer.html(page)
    for _, first, second, width in siblings:
        originals[(first, width)] = renderer.html(first)
        originals[(second, width)] = renderer.html(second)
    edits: list[tuple[int, str, str]] = []  # (plan index, edited html, label)
    for index, (use, _, page, width) in enumerate(plan):
        if use == "edit":
            edited = edit_html(originals[(page, width)], rng)
            if edited is not None:
                edits.append((index, *edited))
    keys = sorted(originals, key=lambda key: (str(key[0]), key[1]))
    started = time.monotonic()
    shots = renderer.render_all([(originals[key], key[1], height) for key in keys]
                                + [(html, plan[index][3], height) for index, html, _ in edits])
    log.info("rendered %d pages in %.1f s", len(shots), time.monotonic() - started)
    rendered = dict(zip(keys, shots[:len(keys)], strict=True))
    edited_shots = shots[len(keys):]
    tokens = LARGE_TOKENS if large else DEFAULT_TOKENS

    out: dict[str, list[Pair]] = {family: [] for family in ("doc_edit", "doc_scroll_whole", "doc_scroll_partial",
                                                             "unrelated", "unrelated_same_site")}
    for (index, _, label), shot in zip(edits, edited_shots, strict=True):
        if len(out["doc_edit"]) == per_source:
            break
        _, site, page, width = plan[index]
        cols = width // TOKEN
        rows = rows_for(rng, cols)
        a, b = window(rendered[(page, width)], 0, rows, cols), window(shot, 0, rows, cols)
        changed = changed_exact(a, b)
        if changed.any():
            out["doc_edit"].append(Pair(f"doc-edit/{site}/{page.stem}/{label}", "doc_edit", a, b, True, changed,
                                        (0, 0)))
    for index, (use, site, page, width) in enumerate(plan):
        if use in ("whole", "partial"):
            cols = width // TOKEN
            rows = rows_for(rng, cols)
            pair = scrolls(rng, rendered[(page, width)], 1, f"{site}/{page.stem}", (rows * cols, rows * cols),
                            use == "whole", max_rows=8 if large else 6)[0]
            out[pair.family].append(replace(pair, name=f"{pair.name}-{index}"))
        elif use == "unrelated":
            cols = width // TOKEN
            a = window(rendered[(page, width)], 0, rows_for(rng, cols), cols)
            name = rng.choice(photos())
            b = photo_of(rng, name, tokens)
            out["unrelated"].append(Pair(f"unrelated/{site}/{page.stem}/{name}-{index}", "unrelated", a, b, False,
                                         None, None))
    for index, (site, first, second, width) in enumerate(siblings):
        cols = width // TOKEN
        rows = rows_for(rng, cols)
        a, b = window(rendered[(first, width)], 0, rows, cols), window(rendered[(second, width)], 0, rows, cols)
        out["unrelated_same_site"].append(Pair(f"unrelated-same-site/{site}/{first.stem}-vs-{second.stem}-{index}",
                                               "unrelated_same_site", a, b, False, None, None))
    return out
