"""The reader: panels, the committed trained weights, its accuracy, and that reused KV shows in its answers."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bundled import DEEP_READER, ORACLE, QWEN2_5_VL, READER, build_model
from bundled.errors import BuildError
from bundled.reader import artifacts
from bundled.reader.batches import Batcher
from bundled.reader.panels import CELL, KEYS, VALUES, changed, random_panel
from bundled.reader.train import accuracy, main
from offline.reader_eval import (
    CHANGED,
    UNCHANGED,
    evaluate_reference,
    fresh_questions,
    make_pairs,
)


@pytest.fixture(scope="module")
def reader_path():
    return build_model(QWEN2_5_VL, READER)


@pytest.fixture(scope="module")
def reference(reader_path):
    from offline.reference import ReferenceModel

    return ReferenceModel.load(reader_path)


def test_a_field_is_one_token_and_a_change_touches_only_its_cell() -> None:
    rng = random.Random(3)
    for _ in range(60):
        panel = random_panel(rng)
        image = panel.render()
        assert image.size == (panel.cols * CELL, panel.rows * CELL)
        other, keys = changed(panel, rng)
        assert [k for k in KEYS if k in panel.keys and panel.value(k) != other.value(k)] == keys
        diff = np.argwhere((np.asarray(image) != np.asarray(other.render())).any(-1))
        assert len(diff), "a changed value must change pixels"
        cells = panel.cells_of(keys[0])
        assert {tuple(p) for p in diff // CELL} <= set(cells) and tuple(diff[0] // CELL) in cells
        assert panel.token_indices(keys[0]) == [row * panel.cols + col for row, col in cells]


def test_every_question_key_and_answer_is_one_token(reader_path) -> None:
    from transformers import AutoProcessor

    batcher = Batcher(AutoProcessor.from_pretrained(reader_path))
    assert len(set(batcher.value_ids.values())) == len(VALUES)
    tokenizer = batcher.processor.tokenizer
    for key in KEYS:
        assert tokenizer.tokenize(f"{key}?") == [key, "?"]


@pytest.mark.parametrize("size", [READER, ORACLE, DEEP_READER])
def test_the_build_uses_the_committed_weights_after_checking_them(size, tmp_path, monkeypatch) -> None:
    trained = f"qwen2_5_vl-{size}"
    reader_path = build_model(QWEN2_5_VL, size)
    committed = load_file(str(artifacts.trained_dir(trained) / artifacts.WEIGHTS))
    built = load_file(str(reader_path / "model.safetensors"))
    assert built.keys() == committed.keys()
    assert all(torch.equal(built[name], committed[name].float()) for name in committed)
    directory = artifacts.trained_dir(trained)
    config = json.loads((directory / artifacts.CONFIG).read_text())
    assert config == json.loads((reader_path / "config.json").read_text())
    assert artifacts.file_sha256(directory / artifacts.WEIGHTS) == artifacts.trained_sha256(trained)
    for name, digest in artifacts.read_sums(directory).items():
        assert artifacts.file_sha256(directory / name) == digest

    copy = tmp_path / "trained"
    shutil.copytree(artifacts.TRAINED_ROOT, copy)
    weights = copy / trained / artifacts.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(artifacts, "TRAINED_ROOT", copy)
    with pytest.raises(BuildError, match="checksum"):
        artifacts.load_trained(trained, torch.float32)
    (copy / trained / artifacts.SUMS).unlink()
    with pytest.raises(BuildError, match="bundled.reader.train"):
        artifacts.trained_sha256(trained)


def test_full_prefill_reads_fresh_panels(reader_path) -> None:
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(reader_path)
    batcher = Batcher(AutoProcessor.from_pretrained(reader_path))
    assert accuracy(model, batcher, fresh_questions(400, seed=11)) >= 0.95


def test_the_reader_tells_stale_kv_from_fresh(reference) -> None:
    """A's KV reused for B gives A's value for the changed field, and the right one for the others."""
    report = evaluate_reference(reference, make_pairs(40, seed=5))
    tallies = report.tallies
    assert tallies["full"][CHANGED].right >= 36 and tallies["full"][UNCHANGED].right >= 36
    assert tallies["stale"][CHANGED].stale >= 34  # A's answer: the stale token was read
    assert tallies["stale"][UNCHANGED].right >= 36
    assert tallies["recompute_changed"][CHANGED].right >= 32  # recomputing the changed token fixes it
    assert tallies["recompute_changed"][UNCHANGED].right >= 36


@pytest.mark.parametrize(("size", "start"), [(READER, []), (ORACLE, ["--init-from", "qwen2_5_vl-reader"]),
                                             (ORACLE, ["--fine-tune", "qwen2_5_vl-oracle", "--moved", "0.5"]),
                                             (ORACLE, ["--fine-tune", "qwen2_5_vl-oracle", "--moved", "0.5",
                                                       "--vision-steps", "3"])],
                         ids=["reader", "oracle", "oracle-moved", "oracle-vision-phase"])
def test_training_logs_checkpoints_resumes_and_exports(size, start, tmp_path, capsys) -> None:
    common = ["--size", size, "--batch", "4", "--eval-every", "2", "--eval-questions", "3", "--threads", "1", *start]
    assert main(["--work", str(tmp_path / "straight"), "--steps", "4", *common]) == 0
    assert main(["--work", str(tmp_path / "resumed"), "--steps", "4", "--stop-at", "2", *common]) == 0
    out = tmp_path / "export"
    assert main(["--work", str(tmp_path / "resumed"), "--steps", "4", "--export", str(out), *common]) == 0
    assert "resumed at step 2" in capsys.readouterr().out
    straight = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)
    assert straight["step"] == resumed["step"] == 4
    for name, value in straight["model"].items():  # the same batches and optimizer state either way
        torch.testing.assert_close(resumed["model"][name], value, rtol=1e-5, atol=1e-6)
    log = (tmp_path / "resumed" / artifacts.LOG).read_text().splitlines()
    assert [line.split(",")[0] for line in log] == ['{"step": 2', '{"step": 4']
    assert '"held_out_accuracy"' in log[-1]
    assert ('"held_out_moved_accuracy"' in log[-1]) == ("--moved" in start)
    vision_phase = "--vision-steps" in start  # steps 1-3 the tower alone, resumed inside that phase
    assert [json.loads(line).get("phase") for line in log] == (["vision", None] if vision_phase else [None, None])
    for name, digest in artifacts.read_sums(out).items():
        assert artifacts.file_sha256(out / name) == digest
    assert set(artifacts.read_sums(out)) == {artifacts.WEIGHTS, artifacts.CONFIG, artifacts.LOG, artifacts.SUMMARY}
