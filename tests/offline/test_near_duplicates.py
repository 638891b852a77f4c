"""The near-duplicate pair set: token-aligned sizes, labels that agree with the pixels, determinism, every family."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from offline import near_duplicates as nd

TOKEN = 28
# Rendered documentation needs render_dir (and Chromium); without it every family still comes from other sources.
PER_FAMILY = 2


@pytest.fixture(scope="module")
def built() -> tuple[list[nd.Pair], list[str]]:
    notes: list[str] = []
    return nd.build_pairs(seed=0, per_family=PER_FAMILY, notes=notes), notes


@pytest.fixture(scope="module")
def pairs(built: tuple[list[nd.Pair], list[str]]) -> list[nd.Pair]:
    return built[0]


def tokens(image) -> np.ndarray:
    """(rows, cols, 28, 28, 3) int16: the image cut into its tokens."""
    pixels = np.asarray(image, dtype=np.int16)
    rows, cols = pixels.shape[0] // TOKEN, pixels.shape[1] // TOKEN
    return pixels.reshape(rows, TOKEN, cols, TOKEN, 3).transpose(0, 2, 1, 3, 4)


def test_every_family_is_present_and_capped(pairs: list[nd.Pair]) -> None:
    counts = nd.summary(pairs)
    assert set(counts) == set(nd.FAMILIES)
    for family in nd.FAMILIES:
        assert 1 <= counts[family] <= PER_FAMILY, family
    assert all(pair.family in nd.FAMILIES for pair in pairs)
    assert len({pair.name for pair in pairs}) == len(pairs)


def test_renders_are_left_out_without_a_render_dir(built: tuple[list[nd.Pair], list[str]]) -> None:
    pairs, notes = built
    assert any("rendered docs" in note for note in notes)
    assert not any("/python/" in pair.name or "/sqlite/" in pair.name for pair in pairs)


def test_images_are_rgb_on_the_token_grid(pairs: list[nd.Pair]) -> None:
    for pair in pairs:
        for image in (pair.a, pair.b):
            assert image.mode == "RGB", pair.name
            assert image.width % TOKEN == 0 and image.height % TOKEN == 0, (pair.name, image.size)
            count = (image.width // TOKEN) * (image.height // TOKEN)
            assert 4 <= count <= nd.MAX_TOKENS, (pair.name, count)


def test_labels_have_the_shapes_they_promise(pairs: list[nd.Pair]) -> None:
    for pair in pairs:
        if pair.changed is not None:
            assert pair.changed.dtype == bool
            assert pair.changed.shape == (pair.b.height // TOKEN, pair.b.width // TOKEN), pair.name
        if pair.shift is not None:
            assert all(isinstance(step, int) for step in pair.shift)
        if pair.family in ("unrelated", "unrelated_same_site"):
            assert pair.near_duplicate is False, pair.name
        elif pair.family == "video_distant":
            assert pair.near_duplicate is None
        else:
            assert pair.near_duplicate is True, pair.name
        if pair.family in ("photo_jpeg", "photo_bright", "photo_crop"):
            assert pair.changed is not None and not pair.changed.any()
        if pair.family in nd.LOSSLESS_FAMILIES:
            assert pair.changed is not None and pair.shift is not None
        if pair.family == "doc_scroll_partial":
            assert pair.shift is None and pair.changed is None
        if pair.family in ("doc_edit", "form_fill"):
            assert pair.changed is not None and 0 < pair.changed.sum() < pair.changed.size / 4, pair.name


def test_lossless_labels_agree_with_the_pixels(pairs: list[nd.Pair]) -> None:
    """An unchanged token is (up to the threshold) A's token at the aligned position; a changed one is not, or has
    no aligned token. Checked here token by token, independently of the builder's vectorised rule."""
    checked = 0
    for pair in pairs:
        if pair.family not in nd.LOSSLESS_FAMILIES:
            continue
        assert pair.changed is not None and pair.shift is not None
        ta, tb = tokens(pair.a), tokens(pair.b)
        dy, dx = pair.shift
        for (row, col), changed in np.ndenumerate(pair.changed):
            ra, ca = row - dy, col - dx
            inside = 0 <= ra < ta.shape[0] and 0 <= ca < ta.shape[1]
            if not changed:
                assert inside, (pair.name, row, col)
                difference = int(np.abs(tb[row, col] - ta[ra, ca]).max())
                assert difference <= nd.EXACT_THRESHOLD, (pair.name, row, col, difference)
                if pair.family in ("photo_crop", "doc_scroll_whole"):
                    assert difference == 0, (pair.name, row, col)
                checked += 1
            elif inside:
                assert int(np.abs(tb[row, col] - ta[ra, ca]).max()) > nd.EXACT_THRESHOLD, (pair.name, row, col)
    assert checked > 1000


def test_shifts_point_the_right_way(pairs: list[nd.Pair]) -> None:
    for pair in pairs:
        if pair.family == "photo_crop":
            assert pair.shift is not None and pair.shift[0] <= 0 and pair.shift[1] <= 0 and pair.shift != (0, 0)
            assert pair.b.width < pair.a.width or pair.b.height < pair.a.height
        if pair.family == "doc_scroll_whole":
            assert pair.shift is not None and pair.shift[1] == 0 and pair.shift[0] != 0
            assert pair.changed is not None
            rows = abs(pair.shift[0])
            new = pair.changed[-rows:] if pair.shift[0] < 0 else pair.changed[:rows]  # scrolled into view
            assert new.all(), pair.name


def test_video_labels_follow_the_tolerant_rule(pairs: list[nd.Pair]) -> None:
    for pair in pairs:
        if pair.family in ("video_next", "video_distant"):
            assert pair.a.size == pair.b.size and pair.shift == (0, 0) and pair.changed is not None
            mean = np.abs(tokens(pair.b) - tokens(pair.a)).mean(axis=(2, 3, 4))
            assert np.array_equal(pair.changed, mean > nd.VIDEO_THRESHOLD), pair.name


def test_the_build_is_deterministic_for_a_seed(pairs: list[nd.Pair]) -> None:
    again = nd.build_pairs(seed=0, per_family=PER_FAMILY)
    assert [pair.name for pair in again] == [pair.name for pair in pairs]
    for first, second in zip(pairs, again, strict=True):
        assert first.a.tobytes() == second.a.tobytes() and first.b.tobytes() == second.b.tobytes(), first.name
        assert first.shift == second.shift and first.near_duplicate == second.near_duplicate
        assert (first.changed is None) == (second.changed is None)
        if first.changed is not None and second.changed is not None:
            assert np.array_equal(first.changed, second.changed)
    seen = {pair.a.tobytes() for pair in pairs}
    other = nd.build_pairs(seed=1, per_family=PER_FAMILY)
    assert sum(pair.a.tobytes() not in seen for pair in other) > len(other) / 2


def test_an_html_edit_changes_one_word_of_the_first_paragraphs() -> None:
    html = ("<html><head><title>t</title></head><body><nav>menu</nav><h1>Title</h1>"
            "<p>The <b>quick</b> brown fox jumps.</p><p>Second paragraph here.</p></body></html>")
    edited = nd.edit_html(html, random.Random(0))
    assert edited is not None
    text, label = edited
    old, new = label.split(">")
    assert old != new and new in text and text != html
    assert text.replace(new, old, 1) == html or text.count(new) > html.count(new)
    assert nd.edit_html("<html><body><h1>x</h1></body></html>", random.Random(0)) is None


def test_the_writer_lays_pairs_out_for_people(pairs: list[nd.Pair], tmp_path: Path) -> None:
    some = [pair for pair in pairs if pair.family in ("doc_edit", "unrelated")]
    labels = json.loads(nd.write(some, tmp_path).read_text())
    assert labels["summary"]["doc_edit"] == sum(pair.family == "doc_edit" for pair in some)
    first = labels["pairs"][0]
    assert (tmp_path / first["a"]).exists() and (tmp_path / first["b"]).exists()
    assert first["changed"] is None or len(first["changed"]) == first["tokens_b"][0]


def test_without_a_clip_the_video_families_are_synthetic_pans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("offline.near_duplicates.video.find_clips", lambda: [])  # where video_pairs looks it up
    notes: list[str] = []
    video = nd.video_pairs(random.Random(0), 2, False, notes)
    assert [len(video["video_next"]), len(video["video_distant"])] == [2, 2]
    assert all("/video-pan/" in pair.name for pairs in video.values() for pair in pairs)
    assert any("synthetic" in note for note in notes)
    for pair in video["video_next"]:
        assert pair.a.size == pair.b.size and pair.near_duplicate is True and pair.changed is not None


def test_a_pairs_true_motion_moves_a_onto_b(monkeypatch: pytest.MonkeyPatch) -> None:
    """Partial scrolls and synthetic pans say in pixels how far B's content moved: A moved so lines up with B
    pixel for pixel where they overlap. The default count of pans builds on every photo (the window fits the
    photo enlarged as much as its path needs)."""
    from offline.near_duplicates.build import _rng
    from offline.near_duplicates.pairs import DEFAULT_COUNTS
    from offline.near_duplicates.scans import scan_scrolls

    monkeypatch.setattr("offline.near_duplicates.video.find_clips", lambda: [])
    pans = nd.video_pairs(_rng(0, "video", "clips"), DEFAULT_COUNTS.single, False, [])
    moved = pans["video_next"] + pans["video_distant"][:4] + scan_scrolls(random.Random(1), 3, False, False)
    for pair in moved:
        motion = pair.true_motion()
        assert motion is not None and pair.motion == motion, pair.name
        dy, dx = motion
        a, b = np.asarray(pair.a, dtype=np.int16), np.asarray(pair.b, dtype=np.int16)
        height, width = b.shape[0] - abs(dy), b.shape[1] - abs(dx)
        assert height > 0 and width > 0, pair.name
        b_part = b[max(dy, 0):max(dy, 0) + height, max(dx, 0):max(dx, 0) + width]
        a_part = a[max(-dy, 0):max(-dy, 0) + height, max(-dx, 0):max(-dx, 0) + width]
        assert np.array_equal(a_part, b_part), pair.name
    scrolled = [pair for pair in moved if pair.family == "doc_scroll_partial"]
    assert scrolled and all(pair.motion[0] % TOKEN for pair in scrolled)  # type: ignore[index]
