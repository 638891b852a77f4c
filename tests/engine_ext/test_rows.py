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
