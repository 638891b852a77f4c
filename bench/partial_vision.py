"""The partial vision pass on near-duplicate pairs: how much of the image it encodes, how close the composite encoder
output comes to a full pass, and how long it takes next to the full pass.

Pairs are the readers' panels (bundled.reader.panels, made as offline.reader_eval makes them): A, and B = A with one
field given another value. Per pair, on the reference's transformers tower (offline.reference.vision):

    changed     the LLM tokens whose patches differ between A's and B's pixel_values
    encoded     margin_tokens(changed): whole attention windows on Qwen2.5-VL, changed tokens plus a ring on Qwen3-VL
    composite   B's encoder output made of the partial pass over the encoded tokens of B and A's full-pass output
                everywhere else (what reuse of A's entry with a partial pass would feed the decoder)

and prints per model (and panel scale): the share of tokens encoded, per-token cosine of the composite's embeddings
to B's full pass (mean and min, over all tokens and over the changed tokens), the same cosine for A's output taken
as it is ("stale": no pass at all, changed tokens), for Qwen3-VL the min cosine over the deepstack features, and the
median time of the partial and the full pass of B, measured alternately in the same run.

Models: the tiny Qwen2.5-VL and Qwen3-VL (random weights; panels also scaled up 2x and 4x, nearest-neighbour, for
larger grids) and the trained Qwen2.5-VL oracle reader (native panels: it reads at most 64 tokens).

    .venv/bin/python bench/partial_vision.py [--pairs 32] [--scales 1 2 4] [--repeats 5] [--ring 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bundled import ARCHS, ORACLE, QWEN2_5_VL, TINY, build_model  # noqa: E402
from engine_ext.vision import QWEN3_VL, changed_tokens, margin_tokens, window_tokens_of  # noqa: E402
from offline.reader_eval import Pair, make_pairs  # noqa: E402
from offline.reference import EncoderOutput, ReferenceModel  # noqa: E402
from offline.reference.vision import encode_partial  # noqa: E402

QUESTION = "?"


@dataclass
class Row:
    """One model at one panel scale, over its pairs."""

    model: str
    scale: int
    pairs: int = 0
    tokens: list[int] = field(default_factory=list)  # per pair: the image's LLM tokens
    encoded: list[float] = field(default_factory=list)  # per pair: share of tokens the partial pass encodes
    changed: list[float] = field(default_factory=list)  # per pair: share of tokens whose patches changed
    cos_all: list[float] = field(default_factory=list)  # per token, every pair: composite vs B's full pass
    cos_changed: list[float] = field(default_factory=list)  # the same, changed tokens only
    stale_changed: list[float] = field(default_factory=list)  # A's full pass vs B's, changed tokens
    deepstack_min: list[float] = field(default_factory=list)  # per pair: min composite cosine over deepstack layers
    partial_s: list[float] = field(default_factory=list)  # per pair: median seconds of the partial pass
    full_s: list[float] = field(default_factory=list)  # per pair: median seconds of the full pass

    def summary(self) -> dict:
        def mean(xs: list[float]) -> float | None:
            return round(statistics.fmean(xs), 4) if xs else None

        def low(xs: list[float]) -> float | None:
            return round(min(xs), 4) if xs else None

        partial = statistics.median(self.partial_s) if self.partial_s else None
        full = statistics.median(self.full_s) if self.full_s else None
        return {
            "model": self.model, "scale": self.scale, "pairs": self.pairs,
            "tokens_median": statistics.median(self.tokens) if self.tokens else None,
            "encoded_share": mean(self.encoded), "changed_share": mean(self.changed),
            "cos_all_mean": mean(self.cos_all), "cos_all_min": low(self.cos_all),
            "cos_changed_mean": mean(self.cos_changed), "cos_changed_min": low(self.cos_changed),
            "stale_changed_mean": mean(self.stale_changed), "stale_changed_min": low(self.stale_changed),
            "deepstack_min": low(self.deepstack_min),
            "partial_ms": round(1e3 * partial, 2) if partial else None,
            "full_ms": round(1e3 * full, 2) if full else None,
            "speedup": round(full / partial, 2) if partial and full else None,
        }


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def scaled(image: Image.Image, scale: int) -> Image.Image:
    return image if scale == 1 else image.resize((image.width * scale, image.height * scale), Image.Resampling.NEAREST)


def timed(fn, repeats: int) -> tuple[float, float]:
    """fn is (partial, full); both run ``repeats`` times, alternating, after one warm-up each: their medians."""
    run_partial, run_full = fn
    run_partial(), run_full()
    partial_s, full_s = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        run_partial()
        partial_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        run_full()
        full_s.append(time.perf_counter() - started)
    return statistics.median(partial_s), statistics.median(full_s)


@torch.no_grad()
def measure(model: ReferenceModel, name: str, pairs: list[Pair], scale: int, *, ring: int, repeats: int) -> Row:
    row = Row(model=name, scale=scale)
    window_tokens = window_tokens_of(model.hf.model.visual)
    for pair in pairs:
        a = model.prompt([scaled(pair.cached.render(), scale), QUESTION])
        b = model.prompt([scaled(pair.asked.render(), scale), QUESTION])
        assert a.pixel_values is not None and b.pixel_values is not None
        assert a.image_grid_thw is not None and b.image_grid_thw is not None
        if not torch.equal(a.image_grid_thw, b.image_grid_thw):
            continue
        changed = changed_tokens(a.pixel_values, b.pixel_values, b.image_grid_thw).flatten()
        if not changed.any():
            continue
        _, h, w = b.images[0].grid
        margin = margin_tokens(changed.reshape(h, w), arch=model.arch, window_tokens=window_tokens, ring=ring)
        tokens = margin.flatten().nonzero()[:, 0]
        full_a, full_b = model.encode(a)[0], model.encode(b)[0]
        subset = encode_partial(model, b, tokens)
        composite = EncoderOutput(full_a.embeds.clone(), tuple(d.clone() for d in full_a.deepstack))
        composite.embeds[tokens] = subset.embeds
        for mine, theirs in zip(composite.deepstack, subset.deepstack, strict=True):
            mine[tokens] = theirs

        cos = cosines(composite.embeds, full_b.embeds)
        row.pairs += 1
        row.tokens.append(h * w)
        row.encoded.append(len(tokens) / (h * w))
        row.changed.append(float(changed.float().mean()))
        row.cos_all += cos.tolist()
        row.cos_changed += cos[changed].tolist()
        row.stale_changed += cosines(full_a.embeds, full_b.embeds)[changed].tolist()
        if composite.deepstack:
            row.deepstack_min.append(min(float(cosines(mine, theirs).min())
                                         for mine, theirs in zip(composite.deepstack, full_b.deepstack, strict=True)))
        partial_s, full_s = timed((lambda b=b, tokens=tokens: encode_partial(model, b, tokens),
                                   lambda b=b: model.encode(b)), repeats)
        row.partial_s.append(partial_s)
        row.full_s.append(full_s)
    return row


def table(rows: list[dict]) -> str:
    def f(value, spec: str = ".3f") -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"{'model':20} {'scale':>5} {'pairs':>5} {'tokens':>6} {'encoded':>8} {'changed':>8} "
             f"{'cos all mean/min':>17} {'cos changed mean/min':>21} {'stale changed':>14} {'deepstack':>9} "
             f"{'partial ms':>10} {'full ms':>8} {'speedup':>7}"]
    for r in rows:
        lines.append(
            f"{r['model']:20} {r['scale']:>5} {r['pairs']:>5} {f(r['tokens_median'], '.0f'):>6} "
            f"{f(r['encoded_share'], '.1%'):>8} {f(r['changed_share'], '.1%'):>8} "
            f"{f(r['cos_all_mean']) + ' / ' + f(r['cos_all_min']):>17} "
            f"{f(r['cos_changed_mean']) + ' / ' + f(r['cos_changed_min']):>21} "
            f"{f(r['stale_changed_mean']) + ' / ' + f(r['stale_changed_min']):>14} {f(r['deepstack_min']):>9} "
            f"{f(r['partial_ms'], '.2f'):>10} {f(r['full_ms'], '.2f'):>8} {f(r['speedup'], '.2f'):>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=32, help="pairs per model and scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 2, 4], help="panel scales for the tiny models")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each pass per pair")
    parser.add_argument("--ring", type=int, default=1, help="Qwen3-VL margin ring, in tokens")
    parser.add_argument("--oracle", default=None, help="the oracle reader's model directory (default: the bundled)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)

    pairs = make_pairs(args.pairs, seed=args.seed)
    # (name, its directory when needed, panel scales)
    runs: list[tuple[str, Callable[[], Path], list[int]]] = [
        (f"{arch}-{TINY}", partial(build_model, arch, TINY), args.scales) for arch in ARCHS]
    oracle = partial(Path, args.oracle) if args.oracle else partial(build_model, QWEN2_5_VL, ORACLE)
    runs.append((f"{QWEN2_5_VL}-{ORACLE}", oracle, [1]))
    started = time.perf_counter()
    rows = []
    for name, path, scales in runs:
        model = ReferenceModel.load(path())
        visual = model.hf.model.visual
        layout = (f"window {window_tokens_of(visual)} tokens, full attention in blocks "
                  f"{list(visual.fullatt_block_indexes)} of {len(visual.blocks)}" if model.arch != QWEN3_VL
                  else f"global attention in all {len(visual.blocks)} blocks, ring {args.ring}")
        print(f"{name}: {layout}", file=sys.stderr, flush=True)
        for scale in scales:
            rows.append(measure(model, name, pairs, scale, ring=args.ring, repeats=args.repeats).summary())
            print(f"  scale {scale}: {rows[-1]['pairs']} pairs, {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
    print(f"{args.pairs} pairs (one field changed), {torch.get_num_threads()} threads, "
          f"{time.perf_counter() - started:.0f} s; cosines of embeddings, composite vs B's full pass")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
