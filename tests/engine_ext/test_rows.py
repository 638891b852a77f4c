"""Locating image rows in a flattened extend batch (SGLang's fields, duck-typed)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine_ext.executor import locate


def item(start: int, last: int, kind: str = "IMAGE", h: int = 7):
    return SimpleNamespace(modality=SimpleNamespace(name=kind), offsets=[(start, last)], hash=h)


def batch(requests: list[tuple[int, int, list]]):
    """requests: (prefix, extend, items) each; request i's pool row is i."""
    return SimpleNamespace(
        rids=[f"r{i}" for i in range(len(requests))],
        extend_prefix_lens_cpu=[p for p, _, _ in requests],
        extend_seq_lens_cpu=[e for _, e, _ in requests],
        req_pool_indices=torch.arange(len(requests)),
        mm_inputs=[SimpleNamespace(mm_items=items, mrope_positions=torch.arange(300).expand(3, -1)) if items
                   else None for _, _, items in requests],
    )


REQ_TO_TOKEN = torch.arange(3 * 300).reshape(3, 300) + 1000  # slot of (request i, row t) = 1000 + 300 i + t


def test_images_across_requests_prefixes_and_chunks() -> None:
    found = locate(batch([
        (0, 20, [item(5, 14)]),  # whole image in this extend
        (0, 10, None),  # text only
        (12, 30, [item(2, 9, h=1), item(20, 29, "VIDEO"), item(30, 49, h=2)]),  # one in the prefix, one cut
    ]), REQ_TO_TOKEN)
    assert [(r.rid, r.index, r.item_hash) for r in found] == [("r0", 0, 7), ("r2", 0, 1), ("r2", 1, 2)]
    first, in_prefix, cut = found
    assert (first.lo, first.hi, first.batch_lo, first.whole_in_extend, first.complete) == (5, 15, 5, True, True)
    assert first.batch_rows.tolist() == list(range(5, 15)) and first.slots[0] == 1005
    assert not in_prefix.in_extend and in_prefix.complete and in_prefix.slots.tolist() == list(range(1602, 1610))
    # request 2's rows start at batch row 30; its extend covers prompt rows 12..41, so the image is cut at 42
    assert (cut.lo, cut.hi, cut.batch_lo, cut.complete) == (30, 42, 48, False)
    assert cut.local_rows.tolist() == list(range(12)) and cut.positions.shape == (3, 20)


def video(spans: list[tuple[int, int]], patches: int, h: int = 9):
    return SimpleNamespace(modality=SimpleNamespace(name="VIDEO"), offsets=spans, hash=h,
                           video_grid_thw=torch.tensor([[patches, 4, 6]]))


def test_a_videos_patches_follow_the_requests_images() -> None:
    found = locate(batch([
        # Qwen2.5-VL: a video of 3 patches in one span of 3 x 6 rows, after an image
        (0, 60, [item(2, 9, h=1), video([(20, 37)], 3)]),
        # Qwen3-VL: a span a patch (a timestamp between), two videos; the first starts in the prefix
        (10, 40, [video([(5, 10), (13, 18)], 2, h=3), video([(30, 35), (38, 43)], 2, h=4)]),
    ]), REQ_TO_TOKEN)
    patches = [r for r in found if r.patch is not None]
    assert [(r.rid, r.index, r.patch, r.start, r.stop, r.encoder_rows, r.item_hash) for r in patches] == [
        ("r0", 1, 0, 20, 26, (0, 6), 9), ("r0", 2, 1, 26, 32, (6, 12), 9), ("r0", 3, 2, 32, 38, (12, 18), 9),
        ("r1", 0, 0, 5, 11, (0, 6), 3), ("r1", 1, 1, 13, 19, (6, 12), 3),
        ("r1", 2, 2, 30, 36, (0, 6), 4), ("r1", 3, 3, 38, 44, (6, 12), 4)]
    first = patches[3]
    assert (first.lo, first.hi, first.batch_lo, first.complete) == (10, 11, 60, True)  # rows 5..9 in the prefix
    assert [r.index for r in found if r.patch is None] == [0]
    second = patches[4]
    assert (second.lo, second.hi, second.batch_lo) == (13, 19, 60 + 3)
    assert second.positions.tolist() == [list(range(13, 19))] * 3 and second.slots[0] == 1000 + 300 + 13


def test_a_video_whose_spans_do_not_divide_into_its_patches_is_not_located() -> None:
    found = locate(batch([(0, 60, [video([(20, 36)], 3), video([(40, 45), (47, 52)], 3)])]), REQ_TO_TOKEN)
    assert found == []
