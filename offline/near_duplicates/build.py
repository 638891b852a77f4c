"""The set: every family's pairs built from the sources, counted, and written out to look at."""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from offline.near_duplicates.docs import rendered_pairs
from offline.near_duplicates.pairs import (
    DEFAULT_COUNTS,
    FAMILIES,
    LARGE_COUNTS,
    Pair,
    grid,
    interleave,
)
from offline.near_duplicates.panels import form_fills, panel_edits, panel_scrolls, panel_siblings
from offline.near_duplicates.scans import photo_pairs, region_pairs, scan_edits, scan_scrolls
from offline.near_duplicates.unrelated import unrelated
from offline.near_duplicates.video import find_clips, video_pairs

log = logging.getLogger(__name__)


def _rng(seed: int, family: str, source: str) -> random.Random:
    """An independent generator per family and source, so changing one family's count leaves the others alone."""
    return random.Random(f"near-duplicates/{seed}/{family}/{source}")


def build_pairs(*, seed: int = 0, large: bool = False, render_dir: Path | None = None,
                per_family: int | None = None, notes: list[str] | None = None) -> list[Pair]:
    """The labelled pairs, the same for the same seed (and the same installed sources). ``large``: about 4,000
    tokens an image and fewer pairs. ``render_dir``: where Chromium's renders of the documentation are cached;
    without it (or without Chromium or the docs) those pairs are left out. ``per_family`` caps each family.
    ``notes``, if given, receives a line per source left out or replaced."""
    notes = notes if notes is not None else []
    counts = LARGE_COUNTS if large else DEFAULT_COUNTS

    def need(number: int, sources: int = 1) -> int:
        return number if per_family is None else min(number, math.ceil(per_family / sources))

    clips = find_clips()
    rendered = rendered_pairs(_rng(seed, "rendered", "docs"), counts, large, render_dir, notes, per_family)
    video = video_pairs(_rng(seed, "video", "clips"), need(counts.single), large, notes)
    families: dict[str, list[list[Pair]]] = {
        "doc_edit": [scan_edits(_rng(seed, "doc_edit", "scan"), need(counts.per_source, 2), large),
                     panel_edits(_rng(seed, "doc_edit", "panel"), need(counts.per_source, 2), large)],
        "doc_scroll_whole": [scan_scrolls(_rng(seed, "doc_scroll_whole", "scan"), need(counts.per_source, 2), large,
                                           True),
                             panel_scrolls(_rng(seed, "doc_scroll_whole", "panel"), need(counts.per_source, 2),
                                            large, True)],
        "doc_scroll_partial": [scan_scrolls(_rng(seed, "doc_scroll_partial", "scan"), need(counts.per_source, 2),
                                             large, False),
                               panel_scrolls(_rng(seed, "doc_scroll_partial", "panel"), need(counts.per_source, 2),
                                              large, False)],
        "form_fill": [form_fills(_rng(seed, "form_fill", "panel"), need(counts.single), large)],
        "video_next": [video["video_next"]],
        "video_distant": [video["video_distant"]],
        "photo_jpeg": [photo_pairs(_rng(seed, "photo_jpeg", "photo"), need(counts.single), large, "photo_jpeg")],
        "photo_crop": [photo_pairs(_rng(seed, "photo_crop", "photo"), need(counts.single), large, "photo_crop")],
        "photo_bright": [photo_pairs(_rng(seed, "photo_bright", "photo"), need(counts.single), large,
                                      "photo_bright")],
        "unrelated": [unrelated(_rng(seed, "unrelated", "mixed"), need(counts.unrelated), large, clips)],
        "unrelated_same_site": [panel_siblings(_rng(seed, "unrelated_same_site", "panel"),
                                                need(2 * counts.same_site, 2), large),
                                region_pairs(_rng(seed, "unrelated_same_site", "regions"), need(counts.same_site, 2),
                                              large)],
    }
    for family, pairs in rendered.items():
        families[family].insert(0, pairs)
    out: list[Pair] = []
    for family in FAMILIES:
        out.extend(interleave(families[family], per_family))
    for note in notes:
        log.info("%s", note)
    names = [pair.name for pair in out]
    if len(set(names)) != len(names):
        raise AssertionError(f"pair names are not unique: {sorted(n for n in names if names.count(n) > 1)}")
    return out


def summary(pairs: Sequence[Pair]) -> dict[str, int]:
    """How many pairs of each family (every family named, zero where absent)."""
    counts = dict.fromkeys(FAMILIES, 0)
    for pair in pairs:
        counts[pair.family] += 1
    return counts


def _mask_rows(mask: np.ndarray | None) -> list[str] | None:
    return None if mask is None else ["".join("#" if cell else "." for cell in row) for row in mask]


def write(pairs: Sequence[Pair], out: Path) -> Path:
    """Each pair as out/<family>/<i>-a.png and -b.png, and out/labels.json with every label (``changed`` as rows of
    '#' (changed) and '.'), to look at."""
    entries = []
    numbers: dict[str, int] = {}
    for pair in pairs:
        number = numbers.get(pair.family, 0)
        numbers[pair.family] = number + 1
        folder = out / pair.family
        folder.mkdir(parents=True, exist_ok=True)
        pair.a.save(folder / f"{number}-a.png")
        pair.b.save(folder / f"{number}-b.png")
        entries.append({"name": pair.name, "family": pair.family, "a": f"{pair.family}/{number}-a.png",
                        "b": f"{pair.family}/{number}-b.png", "near_duplicate": pair.near_duplicate,
                        "shift": list(pair.shift) if pair.shift is not None else None,
                        "motion_px": list(motion) if (motion := pair.true_motion()) is not None else None,
                        "tokens_a": grid(pair.a), "tokens_b": grid(pair.b), "changed": _mask_rows(pair.changed)})
    labels = out / "labels.json"
    labels.write_text(json.dumps({"summary": summary(pairs), "pairs": entries}, indent=1) + "\n")
    return labels
