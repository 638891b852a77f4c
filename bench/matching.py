"""Approximate matching, measured: descriptor cost per image, matching quality on the labelled set, and lookup
latency and memory as the index grows.

    .venv/bin/python bench/matching.py [--render-dir DIR] [--large] [--sections cost quality crowd motion tune video
                                       scale] [--scales 1000 10000 100000] [--json FILE]

cost      the extractor's time per image at about 1K and 4K tokens, token-aligned and needing a resize, beside
          decoding the same image from PNG (what intake pays anyway), medians over repeats
quality   offline.near_duplicates' labelled pairs (rendered documentation pages too with --render-dir, where
          Chromium and the docs are installed). Alone: each pair's A is the only indexed image and B is planned
          as the gateway plans it (matched = an approximate plan, after the guard). In a crowd: every pair's A is
          indexed in one namespace, and a B that matches should match its own A (or, at similarity >= 0.99, an
          identical picture that the set uses as another pair's A). Per family: matched share, mean
          similarity, the shift found, and per-token change-map accuracy against the pixel truth (a changed token
          taken for unchanged is the costly error: recall of changed tokens is printed on its own)
crowd     every labelled image indexed at once, each scrolled and panned by parts of a token within the bounds
          planned and looked up among them: how often its own image is found, and the lookup's time
          (bench/matching_crowd.py)
motion    pixel-level motion (gateway/matching/motion.py: phase correlation) on every labelled pair, with the images
          reduced 1x, 2x and 4x: per family the confidence's spread, how often the motion found is within 1 and
          0.5 px of the pair's true motion (scrolls and pans by any number of pixels, whole-token shifts, content
          left in place), and the time per pair; then the highest confidence of an unrelated pair beside the
          lowest of a near-duplicate whose motion was found; and per quarter of the frame (regional motions), how
          often each region finds its pair's motion
video     next frames of opencv-doc's clips, camera still or moving, planned or why not (bench/matching_video.py)
tune      the match threshold and the guard (max_changed_share) chosen on one half of the labelled pairs (every
          other pair of each family): the most near-duplicates matched with no unrelated pair matched, counting
          only the near-duplicates in reach (content moved by whole tokens, or off the grid within the bounds planned:
          the oracle's verdict, bench/moved_quality.py); then matched per family on the other half, at the chosen
          and the current values
scale     lookup + plan latency (p50/p99) with 1k, 10k and 100k images indexed (256-token pages: each one's
          per-token record is read from the feature store when it is a candidate), the index's memory per entry
          (a rebuilt index: Python and numpy memory by tracemalloc, plus the HNSW graphs' own count) and the
          time to rebuild it from the feature store
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.config import MatchSettings  # noqa: E402
from gateway.matching import extractor_for  # noqa: E402
from gateway.matching.align import CHANGED  # noqa: E402
from gateway.matching.features import Extractor, TokenFeatures  # noqa: E402
from gateway.matching.matcher import Matcher  # noqa: E402
from gateway.matching.motion import find_motion, grey_of, regional_motions  # noqa: E402
from gateway.matching.moved import MovedImage  # noqa: E402
from gateway.matching.plans import approximate_plan  # noqa: E402
from offline.near_duplicates import FAMILIES, Pair, build_pairs  # noqa: E402
from plan import ENTROPY_AWARE  # noqa: E402
from store import FeatureStore  # noqa: E402

CELL = 28


def key(label: object) -> str:
    import hashlib

    return hashlib.sha256(str(label).encode()).hexdigest()


def extract(extractor: Extractor, image: Image.Image) -> TokenFeatures:
    return extractor.extract(image, (image.height // CELL, image.width // CELL), CELL)


# --- cost ------------------------------------------------------------------------------------------------------


def cost(extractor: Extractor, repeats: int) -> list[dict[str, Any]]:
    from skimage import data

    photo = Image.fromarray(data.astronaut()).convert("RGB")
    rows = []
    for side in (32, 64):  # 1,024 and 4,096 tokens
        for resize in (False, True):
            size = (side * CELL + (13 if resize else 0), side * CELL + (7 if resize else 0))
            image = photo.resize(size, Image.Resampling.BICUBIC)
            png = io.BytesIO()
            image.save(png, "PNG", compress_level=1)
            encoded = png.getvalue()
            grid = (side, side)
            extract_s, decode_s = [], []
            for _ in range(repeats):
                started = time.perf_counter()
                decoded = Image.open(io.BytesIO(encoded))
                decoded.load()
                decode_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                extractor.extract(decoded.convert("RGB"), grid, CELL)
                extract_s.append(time.perf_counter() - started)
            rows.append({"tokens": side * side, "resized": resize, "extract_ms": 1e3 * statistics.median(extract_s),
                         "png_decode_ms": 1e3 * statistics.median(decode_s)})
            print(f"  {side * side:5d} tokens{' (resized)' if resize else '          '}: extract "
                  f"{rows[-1]['extract_ms']:6.1f} ms, PNG decode {rows[-1]['png_decode_ms']:6.1f} ms "
                  f"(extract / decode {rows[-1]['extract_ms'] / rows[-1]['png_decode_ms']:.2f}x)", flush=True)
    return rows


# --- quality ---------------------------------------------------------------------------------------------------


def planned(matcher: Matcher, settings: MatchSettings, b_key: str, fb: TokenFeatures,
            moved: MovedImage | None = None):
    """(the best match or None, the approximate plan or None) for B, as the planner decides it (``moved``: B's
    pixels, to line up content moved by part of a token, as the planner has them)."""
    found = matcher.lookup("ns", b_key, fb, moved)
    if not found.matches:
        return None, None, found
    match = found.matches[0]
    plan = approximate_plan(match, fb.entropy, key=b_key, grid=fb.grid, prefix_digest="", settings=settings,
                            selector=ENTROPY_AWARE, layers=36)
    return match, plan, found


def moved_of(extractor: Extractor, settings: MatchSettings, image: Image.Image) -> MovedImage:
    return MovedImage.of_image(image, extractor, grid=(image.height // CELL, image.width // CELL), factor=CELL,
                               settings=settings)


def off_grid(pair: Pair) -> tuple[int, int] | None:
    """How many pixels off the token grid the pair's content moved, per axis (dy, dx, each after whole tokens, as
    gateway/matching/moved.py splits a move), where the pair says."""
    motion = pair.true_motion()
    if motion is None:
        return None
    dy, dx = (m - round(m / CELL) * CELL for m in motion)
    return dy, dx


def near_grid_row(family: str) -> str:
    return f"{family} (planned offsets)"


def quality(extractor: Extractor, settings: MatchSettings, pairs: list[Pair], scratch: Path) -> dict[str, Any]:
    features = [(extract(extractor, p.a), extract(extractor, p.b)) for p in pairs]
    per: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(float))
    for i, (pair, (fa, fb)) in enumerate(zip(pairs, features, strict=True)):
        matcher = Matcher(settings, scope="bench", features=None)
        matcher.add(key(("a", i)), "ns", fa)
        match, plan, found = planned(matcher, settings, key(("b", i)), fb, moved_of(extractor, settings, pair.b))
        off = off_grid(pair)
        if off is not None and settings.plans_offset(off):  # off the grid, where the oracle says reuse holds
            near = per[near_grid_row(pair.family)]
            near["pairs"] += 1
            near["similar"] += match is not None
            near["matched"] += plan is not None
        row = per[pair.family]
        row["pairs"] += 1
        row["labelled_match"] += pair.near_duplicate is True
        row["similar"] += match is not None
        row["matched"] += plan is not None
        row["near_miss"] += found.near_miss
        if found.best_similarity is not None:
            row["similarity_sum"] += found.best_similarity
            row["scored"] += 1
        if match is None:
            continue
        alignment = match.alignment
        if pair.shift is not None:
            row["shift_checked"] += 1
            row["shift_right"] += tuple(alignment.shift) == tuple(pair.shift)
        if pair.changed is not None:
            truth = pair.changed.reshape(-1)
            said = alignment.changes == CHANGED
            row["tokens"] += truth.size
            row["tokens_right"] += int((truth == said).sum())
            row["changed_truth"] += int(truth.sum())
            row["changed_found"] += int((truth & said).sum())
            row["changed_said"] += int(said.sum())
    crowd = crowd_quality(extractor, settings, pairs, features, scratch)
    return {"families": {family: dict(row) for family, row in per.items()}, "crowd": crowd}


def crowd_quality(extractor: Extractor, settings: MatchSettings, pairs: list[Pair], features,
                  scratch: Path) -> dict[str, int]:
    with FeatureStore(scratch / "crowd-features", sync=False) as store:
        matcher = Matcher(settings, scope="bench", features=store)
        digests: dict[bytes, str] = {}
        for i, (fa, _) in enumerate(features):
            content = fa.digests.tobytes()  # pairs built from one image share an identical A: one entry
            digests.setdefault(content, key(("a", i)))
            matcher.add(digests[content], "ns", fa)
        counts: defaultdict[str, int] = defaultdict(int)
        for i, (pair, (fa, fb)) in enumerate(zip(pairs, features, strict=True)):
            _, plan, _ = planned(matcher, settings, key(("b", i)), fb, moved_of(extractor, settings, pair.b))
            own = digests[fa.digests.tobytes()]
            if plan is None:
                counts["unmatched"] += 1
            elif plan.alias == own:
                counts["own_alias"] += 1
            elif plan.similarity >= 0.99:  # the set uses some pictures in several pairs: B is another pair's A
                counts["same_picture_as_another_pairs_a"] += 1
            elif pair.near_duplicate is False:
                counts["unrelated_matched_another_a"] += 1
            else:
                counts["another_a"] += 1
        return dict(counts)


def print_quality(name: str, result: dict[str, Any], settings: MatchSettings) -> None:
    print(f"\n  extractor {name}: matched = an approximate plan after the guard (similar = above the match "
          "threshold before it)")
    print(f"  {'family':22s} {'pairs':>5s} {'label':>6s} {'similar':>8s} {'matched':>8s} {'mean sim':>8s} "
          f"{'shift ok':>9s} {'token acc':>9s} {'chg recall':>10s} {'chg prec':>9s}")
    totals: defaultdict[str, float] = defaultdict(float)
    for family in FAMILIES:
        row = result["families"].get(family)
        if not row:
            continue
        verdict = _label(family)
        label = "-" if verdict is None else ("match" if verdict else "never")

        def pct(num: float, den: float) -> str:
            return f"{100 * num / den:.1f}%" if den else "-"

        print(f"  {family:22s} {int(row['pairs']):5d} {label:>6s} {pct(row['similar'], row['pairs']):>8s} "
              f"{pct(row['matched'], row['pairs']):>8s} "
              f"{row['similarity_sum'] / row['scored'] if row.get('scored') else float('nan'):8.3f} "
              f"{pct(row.get('shift_right', 0), row.get('shift_checked', 0)):>9s} "
              f"{pct(row.get('tokens_right', 0), row.get('tokens', 0)):>9s} "
              f"{pct(row.get('changed_found', 0), row.get('changed_truth', 0)):>10s} "
              f"{pct(row.get('changed_found', 0), row.get('changed_said', 0)):>9s}")
        near = result["families"].get(near_grid_row(family))
        if near:  # the pairs off the grid within the bounds planned: where reuse was measured to hold
            print(f"    {'of which off the grid, within the bounds':36s} "
                  f"{int(near['pairs']):5d} {pct(near['similar'], near['pairs']):>8s} "
                  f"{pct(near['matched'], near['pairs']):>8s}")
        bucket = label
        totals[f"{bucket}_pairs"] += row["pairs"]
        totals[f"{bucket}_matched"] += row["matched"]
    tp, fp = totals["match_matched"], totals["never_matched"]
    print(f"  near-duplicates matched (recall): {tp:.0f} / {totals['match_pairs']:.0f} = "
          f"{100 * tp / max(1, totals['match_pairs']):.1f}%; unrelated pairs matched: {fp:.0f} / "
          f"{totals['never_pairs']:.0f}; precision {100 * tp / max(1, tp + fp):.1f}%")
    print(f"  in a crowd (every A indexed at once): {result['crowd']}")


MOTION_REDUCTIONS = (1, 2, 4)


def motion_quality(pairs: list[Pair]) -> dict[str, Any]:
    """Per reduction and family: motion found against the truth, confidence and time (see the module docstring)."""
    rows: dict[int, dict[str, list[tuple[float, float | None, float]]]] = defaultdict(lambda: defaultdict(list))
    for reduce in MOTION_REDUCTIONS:
        for pair in pairs:
            a, b = grey_of(pair.a, reduce), grey_of(pair.b, reduce)
            started = time.perf_counter()
            motion = find_motion(a, b, reduce=reduce)
            seconds = time.perf_counter() - started
            truth = pair.true_motion()
            error = None if truth is None else max(abs(motion.dy - truth[0]), abs(motion.dx - truth[1]))
            rows[reduce][pair.family].append((motion.confidence, error, seconds))
    result: dict[str, Any] = {}
    for reduce, families in rows.items():
        table = {}
        for family, found in sorted(families.items()):
            confidence = sorted(c for c, _, _ in found)
            errors = [e for _, e, _ in found if e is not None]
            table[family] = {"pairs": len(found), "confidence_min": confidence[0],
                             "confidence_median": statistics.median(confidence), "confidence_max": confidence[-1],
                             "known": len(errors), "within_1px": sum(e <= 1.0 for e in errors),
                             "within_half_px": sum(e <= 0.5 for e in errors),
                             "ms_median": 1e3 * statistics.median(t for _, _, t in found)}
        unrelated = [c for c, _, _ in families.get("unrelated", [])]
        moved = [c for family, found in families.items() if _label(family)
                 for c, e, _ in found if e is not None and e <= 1.0]
        result[str(reduce)] = {"families": table, "unrelated_max": max(unrelated, default=None),
                               "found_min": min(moved, default=None)}
    # Per quarter of the frame (regional_motions, reduced 2x): each pair here moves as a whole, so every region
    # should find the pair's motion.
    regions: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for pair in pairs:
        truth = pair.true_motion()
        if truth is None or not _label(pair.family):
            continue
        for part in regional_motions(grey_of(pair.a, 2), grey_of(pair.b, 2), regions=(2, 2), reduce=2):
            regions[pair.family][0] += max(abs(part.motion.dy - truth[0]), abs(part.motion.dx - truth[1])) <= 1.0
            regions[pair.family][1] += 1
    result["regions"] = {family: {"within_1px": n, "regions": total} for family, (n, total) in sorted(regions.items())}
    return result


def print_motion(result: dict[str, Any]) -> None:
    for reduce, part in result.items():
        if reduce == "regions":
            continue
        print(f"\n  reduced {reduce}x: {'family':22s} {'pairs':>5s} {'confidence min / median / max':>30s} "
              f"{'within 1 px':>12s} {'0.5 px':>7s} {'ms':>6s}")
        for family, row in part["families"].items():
            known = f"{row['within_1px']} / {row['known']}" if row["known"] else "-"
            half = str(row["within_half_px"]) if row["known"] else "-"
            print(f"  {'':12s}{family:22s} {row['pairs']:5d} {row['confidence_min']:10.3f} / "
                  f"{row['confidence_median']:.3f} / {row['confidence_max']:.3f} {known:>12s} {half:>7s} "
                  f"{row['ms_median']:6.1f}")
        print(f"  unrelated pairs' highest confidence {part['unrelated_max']:.3f}; the near-duplicates' lowest, of "
              f"those found within 1 px of their motion, {part['found_min']:.3f}")
    print("\n  per quarter of the frame (reduced 2x), regions within 1 px of their pair's motion: "
          + ", ".join(f"{family} {row['within_1px']} / {row['regions']}" for family, row in result["regions"].items()))


def _label(family: str) -> bool | None:
    if family.startswith("unrelated"):
        return False
    return None if family == "video_distant" else True


# --- scale -----------------------------------------------------------------------------------------------------


def scale(extractor: Extractor, settings: MatchSettings, scales: list[int], scratch: Path,
          queries: int) -> list[dict[str, Any]]:
    """Pages of 16 x 16 tokens: a pool of real ones, each indexed many times with its digests salted (so no two
    entries share a digest) and its vectors and shades jittered, so that the coarse stage passes several candidates
    per query as real look-alike pages do and the fine stage reads their records from the store."""
    pool = [p for p in build_pairs(seed=1, per_family=6) if p.family in ("doc_edit", "form_fill", "photo_jpeg")]
    bases = [extract(extractor, p.a.resize((16 * CELL, 16 * CELL))) for p in pool]
    rng = np.random.default_rng(0)
    rows = []
    for count in scales:
        path = scratch / f"scale-{count}"
        with FeatureStore(path, sync=False, map_size=1 << 32) as store:
            matcher = Matcher(settings, scope="bench", features=store)
            started = time.perf_counter()
            for i in range(count):
                base = bases[i % len(bases)]
                jitter = base.vectors.astype(np.float32) + rng.normal(0, 0.08, base.vectors.shape)
                salted = TokenFeatures(grid=base.grid, digests=base.digests ^ np.uint64(i * 0x9E3779B97F4A7C15 % 2**64),
                                       vectors=(jitter / np.linalg.norm(jitter, axis=1, keepdims=True)).astype(
                                           np.float16), entropy=base.entropy,
                                       shades=np.clip(base.shades + rng.integers(-2, 3, base.shades.shape), 0,
                                                      255).astype(np.uint8), chroma=base.chroma)
                matcher.add(key(("entry", i)), "ns", salted)
            add_s = time.perf_counter() - started
            del matcher
            # A restarted gateway's index: records only, no per-token features cached. Python and numpy memory
            # from tracemalloc, the HNSW graphs' from usearch itself.
            matcher = Matcher(settings, scope="bench", features=store)
            tracemalloc.start()
            started = time.perf_counter()
            matcher.rebuild(stored=lambda k: True)
            rebuild_s = time.perf_counter() - started
            traced = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            graphs = sum(t.graph_bytes() for t in matcher.index._tables.values())  # noqa: SLF001
            grown = traced + graphs
            latencies, candidates = [], []
            for q in range(queries):
                base = bases[q % len(bases)]
                started = time.perf_counter()
                _, plan, found = planned(matcher, settings, key(("query", q)), base)
                latencies.append(time.perf_counter() - started)
                candidates.append(found.candidates)
            rows.append({"entries": count, "p50_ms": 1e3 * float(np.percentile(latencies, 50)),
                         "p99_ms": 1e3 * float(np.percentile(latencies, 99)),
                         "candidates": float(np.mean(candidates)), "index_bytes_per_entry": grown / count,
                         "add_ms_per_entry": 1e3 * add_s / count, "rebuild_s": rebuild_s,
                         "graph": any(t.uses_graph for t in matcher.index._tables.values())})  # noqa: SLF001
            r = rows[-1]
            print(f"  {count:7d} entries: lookup + plan p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms "
                  f"({r['candidates']:.1f} candidates compared; {'HNSW graph' if r['graph'] else 'scan'}), "
                  f"memory {r['index_bytes_per_entry']:.0f} B/entry, add {r['add_ms_per_entry']:.2f} ms/entry, "
                  f"rebuild {r['rebuild_s']:.1f} s", flush=True)
    return rows


def coarse_search(scales: list[int], queries: int) -> list[dict[str, Any]]:
    """The coarse stage alone, a plain scan against the HNSW graph over the same descriptors: what decides the
    scan limit. Random unit regional descriptors (4 x LAYOUT_DIM), queries near stored ones."""
    from gateway.matching.features import LAYOUT_DIM
    from gateway.matching.index import CoarseTable

    rng = np.random.default_rng(0)
    rows = []
    for count in scales:
        regional = rng.standard_normal((count, 4, LAYOUT_DIM)).astype(np.float32)
        regional /= np.linalg.norm(regional, axis=2, keepdims=True)
        keys = [key(("coarse", i)) for i in range(count)]
        tables = {"scan": CoarseTable(LAYOUT_DIM, scan_limit=count + 1), "graph": CoarseTable(LAYOUT_DIM, scan_limit=0)}
        row: dict[str, Any] = {"entries": count}
        for name, table in tables.items():
            table.add_many(keys, regional)
            times, found = [], 0
            for _ in range(queries):
                target = int(rng.integers(count))
                query = regional[target] + 0.05 * rng.standard_normal((4, LAYOUT_DIM)).astype(np.float32)
                query /= np.linalg.norm(query, axis=1, keepdims=True)
                started = time.perf_counter()
                best = table.search(query, threshold=0.8, count=5)
                times.append(time.perf_counter() - started)
                found += bool(best) and best[0][0] == keys[target]
            row[f"{name}_p50_ms"] = 1e3 * float(np.percentile(times, 50))
            row[f"{name}_p99_ms"] = 1e3 * float(np.percentile(times, 99))
            row[f"{name}_found"] = found / queries
        rows.append(row)
        print(f"  {count:7d} entries: scan p50 {row['scan_p50_ms']:.2f} ms (p99 {row['scan_p99_ms']:.2f}), HNSW p50 "
              f"{row['graph_p50_ms']:.2f} ms (p99 {row['graph_p99_ms']:.2f}); nearest found: scan "
              f"{100 * row['scan_found']:.0f}%, HNSW {100 * row['graph_found']:.0f}%", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--render-dir", type=Path, help="render documentation pages with Chromium, cached here")
    parser.add_argument("--large", action="store_true", help="the labelled set at about 4,000 tokens a pair")
    parser.add_argument("--sections", nargs="+", default=["cost", "quality", "crowd", "motion", "scale"],
                        choices=["cost", "quality", "crowd", "motion", "tune", "video", "scale"])
    parser.add_argument("--scales", nargs="+", type=int, default=[1000, 10_000, 100_000])
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--extractors", nargs="+", default=["pixel"], choices=["pixel", "encoder", "clip"],
                        help="clip: bundled.clip's random-weight ViT (no CLIP weights ship offline), or --clip-path")
    parser.add_argument("--clip-path", type=Path, help="an open_clip model folder for the clip extractor")
    parser.add_argument("--encoder-model", default="oracle",
                        help="bundled Qwen2.5-VL size whose vision tower the encoder extractor runs (default: the "
                             "oracle, trained here to read panels)")
    parser.add_argument("--per-family", type=int, help="cap the labelled pairs per family (the encoder is slow)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    settings = MatchSettings.from_env()  # REVISIT_MATCH_* as the gateway reads them
    report: dict[str, Any] = {"settings": settings.__dict__}
    with tempfile.TemporaryDirectory(prefix="revisit-bench-matching-") as tmp:
        scratch = Path(tmp)
        for name in args.extractors:
            extractor_path = None
            if name == "encoder":
                from bundled import build_model

                extractor_path = build_model("qwen2_5_vl", args.encoder_model)
            elif name == "clip":
                from bundled.clip import build_clip

                extractor_path = args.clip_path or build_clip(scratch / "clip-random")
            extractor = extractor_for(MatchSettings(extractor=name, extractor_path=extractor_path))
            part = report.setdefault(name, {})
            if "cost" in args.sections:
                print(f"descriptor cost per image ({name}):", flush=True)
                part["cost"] = cost(extractor, args.repeats)
            if "quality" in args.sections:
                notes: list[str] = []
                pairs = build_pairs(render_dir=args.render_dir, large=args.large, notes=notes,
                                    per_family=args.per_family)
                print(f"\nmatching quality ({name}) on {len(pairs)} labelled pairs; {'; '.join(notes) or ''}",
                      flush=True)
                part["quality"] = quality(extractor, settings, pairs, scratch)
                print_quality(name, part["quality"], settings)
            if "crowd" in args.sections:
                from bench.matching_crowd import moved_crowd, print_moved_crowd

                pairs = build_pairs(render_dir=args.render_dir, large=args.large, per_family=args.per_family)
                print(f"\ncontent moved by a pixel or two, among look-alikes ({name}):", flush=True)
                part["crowd"] = moved_crowd(extractor, settings, pairs)
                print_moved_crowd(part["crowd"])
            if "tune" in args.sections:
                from bench.matching_tune import print_tune, tune

                pairs = build_pairs(render_dir=args.render_dir, large=args.large, per_family=args.per_family)
                print(f"\nthresholds tuned on half of {len(pairs)} labelled pairs, reported on the other ({name}):",
                      flush=True)
                part["tune"] = tune(extractor, settings, pairs)
                print_tune(part["tune"])
            if "video" in args.sections:
                from bench.matching_video import print_video_next, video_next

                print(f"\nnext frames of real clips, the camera still or moving ({name}):", flush=True)
                part["video"] = video_next(extractor, settings)
                print_video_next(part["video"])
            if "motion" in args.sections and name == args.extractors[0]:  # pixels: the same for every extractor
                pairs = build_pairs(render_dir=args.render_dir, large=args.large, per_family=args.per_family)
                print(f"\npixel motion (phase correlation) on {len(pairs)} labelled pairs:", flush=True)
                report["motion"] = motion_quality(pairs)
                print_motion(report["motion"])
            if "scale" in args.sections:
                if name == args.extractors[0]:
                    print("\nthe coarse stage alone, scan against HNSW graph:", flush=True)
                    report["coarse"] = coarse_search(args.scales, args.queries)
                print(f"\nlookup + plan latency and memory as the index grows ({name}):", flush=True)
                part["scale"] = scale(extractor, settings, args.scales, scratch, args.queries)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
