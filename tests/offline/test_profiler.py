"""The recompute profiler: the greedy allocation's rules, and a real (small) profiling run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from offline import profiler
from plan import RecomputeProfile

GRID = (0.0, 0.1, 0.2, 0.5)


def gains_for(per_layer_at: dict[int, list[float]], layers: int) -> np.ndarray:
    gains = np.zeros((layers, len(GRID)))
    for layer, values in per_layer_at.items():
        gains[layer] = values
    return gains


def test_allocation_spends_on_sensitive_layers_and_keeps_ratios_non_increasing() -> None:
    # Layer 2 is the sensitive one; getting there means raising layers 0 and 1 as well.
    gains = gains_for({2: [0, 1.0, 1.5, 1.6]}, layers=4)
    ratios = profiler.allocate(gains, GRID, budget=0.15)
    assert ratios == (0.2, 0.2, 0.2, 0.0)
    assert all(b <= a for a, b in zip(ratios, ratios[1:], strict=False))
    assert sum(ratios) <= 0.15 * 4 + 1e-9


def test_allocation_stops_when_nothing_helps_or_fits() -> None:
    assert profiler.allocate(np.zeros((3, len(GRID))), GRID, budget=0.5) == (0.0, 0.0, 0.0)
    gains = gains_for({0: [0, 1, 2, 3]}, layers=3)
    assert profiler.allocate(gains, GRID, budget=0.01) == (0.0, 0.0, 0.0)  # the smallest step is over budget
    assert profiler.allocate(gains, GRID, budget=0.5) == (0.5, 0.0, 0.0)  # helping nowhere else costs nothing


def test_a_real_profile_on_the_tiny_model(tiny_models: dict[str, Path], tmp_path: Path, capsys) -> None:
    model_dir = tiny_models["qwen2_5_vl"]
    out = tmp_path / "profile.json"
    assert profiler.main(["--model", str(model_dir), "--samples", "2", "--tokens", "4", "--budget", "0.2",
                          "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "prepared sample 2/2" in printed.err and str(out) in printed.out
    loaded = RecomputeProfile.load(out)
    assert loaded.layers == 4 and loaded.model == model_dir.name and loaded.mean_ratio <= 0.2 + 1e-9
    errors = loaded.calibration["error"]
    # Measured on the calibration set: the profile is found among configurations scored against "none".
    assert errors["none"] > 0 and errors["profile"] <= errors["none"] + 1e-12
    assert len(json.loads(out.read_text())["calibration"]["layer_errors"]) == 4


def test_cli_refuses_what_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        profiler.main(["--model", str(tmp_path)])
