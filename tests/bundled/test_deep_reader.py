"""The deep reader: relational questions, its pairs, growing it from the oracle, and that it takes notes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from bundled import DEEP_READER, ORACLE, QWEN2_5_VL, build_model
from bundled.reader.batches import Batcher
from bundled.reader.panels import CELL, KEYS, kind_of
from bundled.reader.questions import (
    ABOVE,
    LEFT,
    NEIGHBOUR,
    QUESTION_KINDS,
    RELATION_MARK,
    RELATIONAL_KINDS,
    neighbour_key,
    random_question,
    sibling,
)
from bundled.reader.train import TASKS, accuracy_by_kind, grow_start, main
from offline.layer_probe import CHANGED_RECOMPUTED, STALE_ABOVE, probe
from offline.reader_eval import CHANGED, UNCHANGED, fresh_questions, make_pairs
from tests.bundled.readers_lib import trained_reference, untrained_reader

SINGLE_HOP = 0.9  # of 150 questions a kind; the bar is 95% of 1,000 (docs/notes/2026-12-07-deep-reader.md)
NOTES_STALE = 0.3


@pytest.fixture(scope="module")
def untrained():
    """The recipe with its deterministic random weights (what training starts from)."""
    return untrained_reader(DEEP_READER)


@pytest.fixture(scope="module")
def deep_reader_path():
    return build_model(QWEN2_5_VL, DEEP_READER)


@pytest.fixture(scope="module")
def deep_reference():
    return trained_reference(DEEP_READER)


def test_relational_questions_name_a_field_and_answer_its_neighbour(untrained) -> None:
    tokenizer = untrained[1].tokenizer
    for key in KEYS:
        for mark in RELATION_MARK.values():
            assert tokenizer.tokenize(f"{key}{mark}?") == [key, mark, "?"]
    rng = random.Random(8)
    for _ in range(150):
        for kind in RELATIONAL_KINDS:
            question = random_question(rng, kind)
            panel = question.panels[0]
            named = question.text[0]
            row, col = panel.cell_of(named)
            drow, dcol = NEIGHBOUR[kind]
            target = neighbour_key(panel, kind, named)
            assert target is not None and (row + drow, col + dcol) in panel.cells_of(target)
            assert question.answer == panel.value(target) and question.hops == ((1, question.answer),)
            twin = sibling(question, rng)  # the same text and layout, every value drawn afresh
            assert twin.text == question.text and twin.answer == twin.panels[0].value(target)
            assert [(cell, key, kind_of(v)) for cell, (key, v) in twin.panels[0].fields.items()] == [
                (cell, key, kind_of(v)) for cell, (key, v) in panel.fields.items()]


def test_relational_pairs_change_the_neighbour_of_a_value_the_question_names() -> None:
    """B differs from A in one field only: the neighbour of the field B's first question names; so its answer over
    A is A's value of that field (the stale answer), and the other question's answer is the same over A and B."""
    for kind in RELATIONAL_KINDS:
        for pair in make_pairs(40, seed=3, kind=kind):
            assert [k for k in pair.cached.keys if pair.cached.value(k) != pair.asked.value(k)] == list(pair.changed)
            (which, question, stale), (other, unchanged, none) = pair.questions()
            assert (which, other, none) == (CHANGED, UNCHANGED, None)
            assert question.kind == kind and question.answer == pair.asked.value(pair.changed[0])
            assert stale == pair.cached.value(pair.changed[0]) != question.answer
            assert unchanged.over((pair.cached,)).answer == unchanged.answer
            diff = np.argwhere((np.asarray(pair.cached.render()) != np.asarray(pair.asked.render())).any(-1))
            assert {tuple(p) for p in diff // CELL} <= set(pair.asked.cells_of(pair.changed[0]))


def test_growing_from_the_oracle_starts_from_what_the_oracle_computes(untrained) -> None:
    """Grown from the oracle's 8 layers, the 16-layer model's new layers add nothing: the same logits."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    model, processor = untrained
    copied, added = grow_start(model, QWEN2_5_VL, "qwen2_5_vl-oracle")
    assert added == 8 and copied > 0
    oracle = Qwen2_5_VLForConditionalGeneration.from_pretrained(build_model(QWEN2_5_VL, ORACLE), dtype=torch.float32)
    questions = [random_question(random.Random(2), kind, max_fields=8) for kind in QUESTION_KINDS]
    inputs = Batcher(AutoProcessor.from_pretrained(build_model(QWEN2_5_VL, ORACLE)))(questions, with_answers=False)
    assert Batcher(processor)(questions, with_answers=False)["input_ids"].equal(inputs["input_ids"])
    model.eval()
    with torch.no_grad():
        args = {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")}
        torch.testing.assert_close(model(**args).logits, oracle(**args).logits, rtol=1e-4, atol=1e-4)


def test_training_the_deep_reader_grows_it_and_resumes(tmp_path) -> None:
    common = ["--size", DEEP_READER, "--batch", "4", "--eval-every", "2", "--eval-questions", "2", "--threads", "1",
              "--grow-from", "qwen2_5_vl-oracle"]
    assert main(["--work", str(tmp_path / "straight"), "--steps", "3", *common]) == 0
    assert main(["--work", str(tmp_path / "resumed"), "--steps", "3", "--stop-at", "2", *common]) == 0
    assert main(["--work", str(tmp_path / "resumed"), "--steps", "3", *common]) == 0
    straight = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)
    for name, value in straight["model"].items():
        torch.testing.assert_close(resumed["model"][name], value, rtol=1e-5, atol=1e-6)
    assert set(TASKS[DEEP_READER].kinds) == set(QUESTION_KINDS) | set(RELATIONAL_KINDS)


# The committed deep reader does not yet answer relational questions as well as the bar asks (90% of 1,000
# fresh questions of each relational kind): docs/notes/2026-12-07-deep-reader.md has its figures. These tests hold
# it to that bar; strict, so that a reader that meets it fails them until the marks are removed.
NOT_YET = pytest.mark.xfail(strict=True, reason="the committed deep reader answers relational questions below the "
                                                "bar (docs/notes/2026-12-07-deep-reader.md)")


def test_full_prefill_answers_single_hop_questions(deep_reference) -> None:
    """The oracle's questions, answered through the reference one prompt at a time (measured on 1,000 of each:
    98.2%, 95.0%, 97.5%)."""
    from offline.reader_eval import reference_accuracy

    rates = reference_accuracy(deep_reference, fresh_questions(150, seed=13, kinds=QUESTION_KINDS))
    assert all(rates[kind] >= SINGLE_HOP for kind in QUESTION_KINDS), rates


@NOT_YET
def test_full_prefill_answers_relational_questions(deep_reader_path) -> None:
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(deep_reader_path)
    batcher = Batcher(AutoProcessor.from_pretrained(deep_reader_path))
    rates = accuracy_by_kind(model, batcher, fresh_questions(150, seed=13, kinds=RELATIONAL_KINDS))
    assert all(rates[kind] >= 0.88 for kind in RELATIONAL_KINDS), rates


@pytest.mark.parametrize("kind", [LEFT, ABOVE])
def test_the_deep_reader_reads_notes_that_go_stale(deep_reference, kind) -> None:
    """Relational pairs on panels of at most 6 fields (where it reads relations best): with the changed field's
    tokens computed on B at every layer and A's K/V for every other image token from layer 3 up, the deep reader
    answers fewer of them right than a full prefill does, and answers A's value on some: what it answers from is what
    the named field's token noted of its (changed) neighbour. Measured on 300 left pairs: a full prefill 46% right,
    2.7% A's value; at l = 3, 19% and 13%."""
    pairs = make_pairs(40, seed=19, kind=kind, max_fields=6)
    report = probe(deep_reference, pairs)
    layers = deep_reference.num_layers
    full, noted = report.tallies[CHANGED_RECOMPUTED][layers], report.tallies[CHANGED_RECOMPUTED][3]
    assert report.tallies[STALE_ABOVE][layers].right == full.right, report.table()  # both a full prefill
    assert noted.right + 4 <= full.right and noted.stale >= full.stale + 2, report.table()


@NOT_YET
@pytest.mark.parametrize("kind", [LEFT, ABOVE])
def test_the_notes_test_meets_the_bar(deep_reference, kind) -> None:
    """The issue's bar: at least 30% of relational pairs answer A's value with the changed tokens recomputed and A's
    K/V elsewhere from some l >= 3 (measured: 9% of left pairs and 19% of above pairs, of 100, over every panel)."""
    report = probe(deep_reference, make_pairs(16, seed=19, kind=kind))
    assert report.stale_somewhere(3) >= NOTES_STALE, report.table()
