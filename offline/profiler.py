"""The offline recompute profiler: per-layer sensitivity on a calibration set, then a greedy allocation of a
recompute budget across layers (non-increasing with depth), written as a JSON profile the gateway loads.

The method follows VLCache. For each calibration sample (a real image and a question):

1. cache: a full prefill of the image after one text (a different preamble, "Please describe this image.") gives
   the entry that a later request would reuse;
2. baseline: a full prefill of the image after another preamble and the real question, and `tokens` greedy tokens;
   the baseline's next-token distributions along that answer are the target;
3. reuse: the same prompt and answer scored in one pass with the cached entry moved to its new position and the
   first r of the image's tokens recomputed in layers 0..j (for every layer j and every r of the grid).

The error of a run is the mean KL(baseline || reuse) over the answer's tokens. Layer j's gain at r is how much
extending recompute at r from layers 0..j-1 to layers 0..j lowers the error. Assuming gains add up across layers,
the search repeatedly takes the step (raise a layer to the next grid value, and every earlier layer to at least
that) with the best predicted gain per unit of budget, while the mean ratio stays within the budget. The profile
records the errors measured (not predicted) for no recompute, a uniform ratio at the budget, and the profile.

    python -m offline.profiler --model PATH [--budget 0.05] [--samples 8] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from offline.reference import (
    Fresh,
    ImageKV,
    Prompt,
    ReferenceModel,
    Reuse,
    build,
    capture,
    greedy,
    prefill,
    run,
)
from plan import PROFILE_FILE, RecomputeProfile, check_ratios

GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
# Real images bundled with scikit-image (no download), and questions about them.
IMAGES = ("astronaut", "coffee", "chelsea", "rocket", "page", "text", "camera", "hubble_deep_field",
          "immunohistochemistry", "horse", "clock", "coins", "moon", "brick", "colorwheel", "cell")
QUESTIONS = ("What is in the picture?", "Describe the colours you see.", "What is written here, if anything?",
             "Where could this have been taken?", "Count the main objects.", "What stands out most?")
PREAMBLES = ("You are a careful assistant.", "The user has shared a file with you. Look at it closely.",
             "Earlier we talked about something else entirely; now a new topic.", "Hi!")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Sample:
    image: Image.Image
    cache_preamble: str
    preamble: str
    question: str


def calibration_set(count: int, side: int) -> list[Sample]:
    """count samples of real images (resized to side x side) with varied preambles and questions."""
    from skimage import data

    samples = []
    for i in range(count):
        pixels = np.asarray(getattr(data, IMAGES[i % len(IMAGES)])())
        image = Image.fromarray(pixels).convert("RGB").resize((side, side), Image.Resampling.BICUBIC)
        samples.append(Sample(image, PREAMBLES[i % len(PREAMBLES)], PREAMBLES[(i + 1) % len(PREAMBLES)] + " " +
                              PREAMBLES[(i + 2) % len(PREAMBLES)], QUESTIONS[i % len(QUESTIONS)]))
    return samples


@dataclass
class _Prepared:
    entry: ImageKV
    scored: Prompt  # the question's prompt followed by the baseline answer
    target: torch.Tensor  # (tokens, vocab) baseline log-probabilities along the answer
    tail: int


def _prepare(model: ReferenceModel, sample: Sample, tokens: int) -> _Prepared:
    cached = model.prompt([sample.cache_preamble, sample.image, "Please describe this image."])
    encoder = model.encode(cached)[0]
    entry = capture(prefill(model, cached, [Fresh(encoder)]).state, cached.images[0], encoder)
    prompt = model.prompt([sample.preamble, sample.image, sample.question])
    answer = greedy(model, prefill(model, prompt, [Fresh(encoder)]), tokens)
    scored = prompt.extended(answer[:-1])  # row k predicts answer[k]
    full = run(model, build(model, scored, [Fresh(encoder)]), scored.positions, tail=tokens)
    assert full.tail_logits is not None, "run() returns tail_logits only for tail > 1"
    return _Prepared(entry, scored, full.tail_logits.double().log_softmax(-1), tokens)


def _error(model: ReferenceModel, prepared: _Prepared, ratios: Sequence[float]) -> float:
    plan = build(model, prepared.scored, [Reuse(prepared.entry, ratios)])
    result = run(model, plan, prepared.scored.positions, tail=prepared.tail)
    assert result.tail_logits is not None, "run() returns tail_logits only for tail > 1"
    reuse = result.tail_logits.double().log_softmax(-1)
    p = prepared.target
    return float((p.exp() * (p - reuse)).sum(-1).clamp_min(0).mean())


def _prefix(layers: int, depth: int, ratio: float) -> tuple[float, ...]:
    """ratio at layers 0..depth, 0 after."""
    return tuple(ratio if i <= depth else 0.0 for i in range(layers))


def allocate(gains: np.ndarray, grid: Sequence[float], budget: float) -> tuple[float, ...]:
    """Greedy allocation: gains[j, g] is layer j's predicted error reduction at grid[g] (gains[:, 0] = 0).

    Each step raises one layer j to a higher grid value and every earlier layer to at least that value (the
    ratios stay non-increasing with depth), choosing the step with the best gain per unit of added ratio whose
    result keeps the mean ratio within budget; it stops when no step fits or none helps.
    """
    layers = gains.shape[0]
    level = [0] * layers  # grid index per layer
    limit = budget * layers + 1e-9

    def total(levels: Sequence[int]) -> float:
        return sum(grid[g] for g in levels)

    while True:
        best, best_rate = None, 0.0
        for j in range(layers):
            for g in range(level[j] + 1, len(grid)):
                new = [max(level[i], g) if i <= j else level[i] for i in range(layers)]
                cost = total(new) - total(level)
                if total(new) > limit or cost <= 0:
                    continue
                gain = sum(gains[i, new[i]] - gains[i, level[i]] for i in range(layers))
                if gain / cost > best_rate:
                    best, best_rate = new, gain / cost
        if best is None:
            return check_ratios([grid[g] for g in level], layers)
        level = best


def profile(model: ReferenceModel, samples: Sequence[Sample], budget: float, *, model_name: str,
            tokens: int = 16, grid: Sequence[float] = GRID, progress: Progress = print) -> RecomputeProfile:
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    layers = model.num_layers
    grid = tuple(sorted(set(grid) | {0.0}))
    started = time.monotonic()
    prepared = []
    for index, sample in enumerate(samples):
        prepared.append(_prepare(model, sample, tokens))
        progress(f"prepared sample {index + 1}/{len(samples)} ({time.monotonic() - started:.0f} s)")

    def mean_error(ratios: Sequence[float]) -> float:
        return statistics.fmean(_error(model, p, ratios) for p in prepared)

    none = mean_error((0.0,) * layers)
    errors = np.zeros((layers, len(grid)))  # errors[j, g]: ratio grid[g] at layers 0..j
    for j in range(layers):
        for g, ratio in enumerate(grid):
            errors[j, g] = none if ratio == 0.0 else mean_error(_prefix(layers, j, ratio))
        progress(f"layer {j + 1}/{layers} measured ({time.monotonic() - started:.0f} s)")
    previous = np.vstack([np.full(len(grid), none), errors[:-1]])
    gains = previous - errors  # what adding layer j at each ratio saves, given layers before it at that ratio
    ratios = allocate(gains, grid, budget)
    uniform = (budget,) * layers
    measured = {"none": none, "uniform": mean_error(uniform), "profile": mean_error(ratios)}
    progress(f"mean KL: no recompute {measured['none']:.4f}, uniform {budget} {measured['uniform']:.4f}, "
             f"profile {measured['profile']:.4f} ({time.monotonic() - started:.0f} s)")
    return RecomputeProfile(
        model=model_name, layers=layers, budget=budget, ratios=ratios,
        metric=f"mean KL(full || reuse) over {tokens} teacher-forced answer tokens",
        calibration={"samples": len(samples), "grid": list(grid), "error": measured,
                     "layer_errors": [[round(float(e), 6) for e in row] for row in errors]},
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offline.profiler", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="model directory (e.g. a bundled model)")
    parser.add_argument("--budget", type=float, default=0.05, help="mean recompute ratio allowed (default 0.05)")
    parser.add_argument("--samples", type=int, default=8, help="calibration samples (default 8)")
    parser.add_argument("--tokens", type=int, default=16, help="answer tokens scored per sample (default 16)")
    parser.add_argument("--image-side", type=int, default=224, help="calibration images are side x side")
    parser.add_argument("--out", type=Path, help=f"where to write the profile (default MODEL/{PROFILE_FILE})")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        parser.error(f"{args.model} is not a model directory (no config.json)")
    if args.samples < 1 or args.tokens < 2 or not 0.0 < args.budget <= 1.0:
        parser.error("need --samples >= 1, --tokens >= 2 and 0 < --budget <= 1")
    torch.manual_seed(0)
    model = ReferenceModel.load(args.model, dtype=torch.float32)
    result = profile(model, calibration_set(args.samples, args.image_side), args.budget,
                     model_name=args.model.resolve().name, tokens=args.tokens,
                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    out = args.out or args.model / PROFILE_FILE
    result.save(out)
    print(f"ratios {list(result.ratios)} (mean {result.mean_ratio:.4f}) written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
