"""The partial vision pass over the transformers towers (offline.reference.vision) and the token sets it encodes
(engine_ext.vision.margin_tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers.vision_utils import get_vision_window_index

from bundled import ARCHS
from engine_ext.vision import (
    QWEN2_5_VL,
    QWEN3_VL,
    changed_tokens,
    margin_tokens,
    patch_rows,
    window_order,
    window_tokens_of,
)
from offline.reference import Prompt, ReferenceModel
from offline.reference.vision import encode_partial


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tiny_models: dict[str, Path]) -> ReferenceModel:
    return ReferenceModel.load(tiny_models[request.param])


@pytest.fixture(scope="module")
def picture(astronaut: Image.Image) -> Image.Image:
    return astronaut.resize((224, 168))  # Qwen2.5-VL: 6 x 8 tokens, the bottom row of windows 2 tokens high


@pytest.fixture(scope="module")
def prompt(model: ReferenceModel, picture: Image.Image) -> Prompt:
    return model.prompt([picture, "What is it?"])


def token_count(prompt: Prompt) -> int:
    return len(prompt.images[0])


def grid_of(prompt: Prompt) -> tuple[int, int]:
    _, h, w = prompt.images[0].grid
    return h, w


def subset_around(model: ReferenceModel, prompt: Prompt, row: int, col: int) -> torch.Tensor:
    """The margin tokens of one changed token."""
    changed = torch.zeros(grid_of(prompt), dtype=torch.bool)
    changed[row, col] = True
    margin = margin_tokens(changed, arch=model.arch, window_tokens=window_tokens_of(model.hf.model.visual))
    return margin.flatten().nonzero()[:, 0]


# --- the pass ---


def test_every_token_is_the_full_pass(model: ReferenceModel, prompt: Prompt) -> None:
    full = model.encode(prompt)[0]
    ours = encode_partial(model, prompt, torch.arange(token_count(prompt)))
    assert len(ours.deepstack) == len(full.deepstack)
    torch.testing.assert_close(ours.flat(), full.flat(), rtol=1e-5, atol=1e-5)


def test_tokens_come_back_in_the_order_given(model: ReferenceModel, prompt: Prompt) -> None:
    full = model.encode(prompt)[0].flat()
    order = torch.randperm(token_count(prompt), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(encode_partial(model, prompt, order).flat(), full[order], rtol=1e-5, atol=1e-5)
    subset = subset_around(model, prompt, 1, 2)
    assert torch.equal(encode_partial(model, prompt, subset.flip(0)).flat(),
                       encode_partial(model, prompt, subset).flat().flip(0))


def test_a_later_image_of_a_prompt(model: ReferenceModel, picture: Image.Image, coffee: Image.Image) -> None:
    prompt = model.prompt([picture, "and", coffee.resize((112, 140)), "?"])
    full = model.encode(prompt)[1]
    ours = encode_partial(model, prompt, torch.arange(len(prompt.images[1])), image=1)
    torch.testing.assert_close(ours.flat(), full.flat(), rtol=1e-5, atol=1e-5)


def test_a_subset_has_one_row_per_token(model: ReferenceModel, prompt: Prompt) -> None:
    subset = subset_around(model, prompt, 4, 5)
    out = encode_partial(model, prompt, subset)
    hidden = model.hidden
    assert out.embeds.shape == (len(subset), hidden)
    deepstack = model.hf.config.vision_config.deepstack_visual_indexes if model.arch == QWEN3_VL else []
    assert [d.shape for d in out.deepstack] == [(len(subset), hidden)] * len(deepstack)
    assert torch.isfinite(out.flat()).all()


def test_a_subset_ignores_the_other_patches(model: ReferenceModel, prompt: Prompt) -> None:
    subset = subset_around(model, prompt, 4, 5)
    inside = torch.zeros(prompt.pixel_values.shape[0], dtype=torch.bool)
    inside[patch_rows(subset)] = True
    before = encode_partial(model, prompt, subset).flat()
    noise = torch.randn(prompt.pixel_values.shape, generator=torch.Generator().manual_seed(1))

    outside_changed = torch.where(inside[:, None], prompt.pixel_values, noise)
    assert torch.equal(encode_partial(model, (outside_changed, prompt.image_grid_thw), subset).flat(), before)

    one_patch = prompt.pixel_values.clone()
    one_patch[patch_rows(subset)[0]] = noise[0]
    after = encode_partial(model, (one_patch, prompt.image_grid_thw), subset).flat()
    assert not torch.allclose(after, before, atol=1e-4)


def test_a_subset_differs_from_the_full_pass_only_by_its_context(model: ReferenceModel, prompt: Prompt) -> None:
    """Positions are the full image's: the subset's outputs stay close to the full pass (a crop's would not)."""
    subset = subset_around(model, prompt, 2, 2)
    full = model.encode(prompt)[0].embeds[subset]
    ours = encode_partial(model, prompt, subset).embeds
    assert not torch.allclose(ours, full, atol=1e-4)
    assert float(torch.nn.functional.cosine_similarity(ours, full, dim=-1).mean()) > 0.5


def test_bad_tokens_are_refused(model: ReferenceModel, prompt: Prompt) -> None:
    n = token_count(prompt)
    for tokens in ([], [0, 0], [n], [-1]):
        with pytest.raises(ValueError):
            encode_partial(model, prompt, tokens)


def test_changed_tokens_are_the_tokens_whose_patches_differ(model: ReferenceModel, prompt: Prompt) -> None:
    h, w = grid_of(prompt)
    edited = prompt.pixel_values.clone()
    edited[patch_rows(torch.tensor([w + 3]))[-1], 0] += 1  # the last patch of token (1, 3)
    changed = changed_tokens(prompt.pixel_values, edited, prompt.image_grid_thw)
    assert changed.shape == (h, w) and changed.sum() == 1 and changed[1, 3]


def test_tiny_towers_window_sizes(model: ReferenceModel) -> None:
    visual = model.hf.model.visual
    if model.arch == QWEN2_5_VL:
        assert window_tokens_of(visual) == 4  # 112 px / patch 14 / merge 2
        assert list(visual.fullatt_block_indexes) == [1, 3]  # and blocks 0, 2 are windowed
    else:
        assert window_tokens_of(visual) is None


# --- margin_tokens ---


def one_hot(h: int, w: int, *cells: tuple[int, int]) -> torch.Tensor:
    changed = torch.zeros(h, w, dtype=torch.bool)
    for row, col in cells:
        changed[row, col] = True
    return changed


def model_windows(h: int, w: int, window_tokens: int) -> list[set[int]]:
    """The token sets of the windows Qwen2.5-VL's own window index tiles an (h, w) token grid into."""
    window_index, cu = get_vision_window_index(torch.tensor([[1, 2 * h, 2 * w]]), spatial_merge_size=2,
                                               window_size=window_tokens * 28, patch_size=14)
    bounds = (cu // 4).tolist()
    return [set(window_index[a:b].tolist()) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@pytest.mark.parametrize("h, w, window_tokens", [(6, 8, 4), (5, 7, 4), (8, 8, 4), (1, 1, 4), (9, 4, 2), (3, 10, 3)])
def test_qwen2_5_windows_are_the_models(h: int, w: int, window_tokens: int) -> None:
    windows = model_windows(h, w, window_tokens)
    assert sorted(t for window in windows for t in window) == list(range(h * w))
    for token in range(h * w):
        margin = margin_tokens(one_hot(h, w, divmod(token, w)), arch=QWEN2_5_VL, window_tokens=window_tokens)
        (window,) = [window for window in windows if token in window]
        assert set(margin.flatten().nonzero()[:, 0].tolist()) == window


def test_qwen2_5_windows_tile_from_the_top_left() -> None:
    margin = margin_tokens(one_hot(6, 8, (5, 7)), arch=QWEN2_5_VL, window_tokens=4)
    expected = torch.zeros(6, 8, dtype=torch.bool)
    expected[4:, 4:] = True  # the last row of windows is 2 tokens high
    assert torch.equal(margin, expected)
    both = margin_tokens(one_hot(6, 8, (0, 0), (5, 7)), arch=QWEN2_5_VL, window_tokens=4)
    expected[:4, :4] = True
    assert torch.equal(both, expected)
    assert not margin_tokens(one_hot(6, 8), arch=QWEN2_5_VL, window_tokens=4).any()


def test_qwen3_ring() -> None:
    centre = margin_tokens(one_hot(5, 7, (2, 3)), arch=QWEN3_VL, window_tokens=None)
    expected = torch.zeros(5, 7, dtype=torch.bool)
    expected[1:4, 2:5] = True
    assert torch.equal(centre, expected)
    assert margin_tokens(one_hot(5, 7, (0, 0)), arch=QWEN3_VL, window_tokens=None).sum() == 4  # clipped at a corner
    edge = margin_tokens(one_hot(5, 7, (4, 3)), arch=QWEN3_VL, window_tokens=None)
    assert edge.sum() == 6 and edge[3:, 2:5].all()
    assert margin_tokens(one_hot(5, 7, (2, 3)), arch=QWEN3_VL, window_tokens=None, ring=2).sum() == 25
    assert margin_tokens(one_hot(5, 7, (2, 3)), arch=QWEN3_VL, window_tokens=4, ring=0).sum() == 1
    assert margin_tokens(one_hot(1, 1, (0, 0)), arch=QWEN3_VL, window_tokens=None).sum() == 1


def test_margin_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        margin_tokens(one_hot(2, 2), arch=QWEN2_5_VL, window_tokens=None)
    with pytest.raises(ValueError):
        margin_tokens(one_hot(2, 2), arch="llava", window_tokens=4)
    with pytest.raises(ValueError):
        margin_tokens(torch.zeros(2, 2), arch=QWEN3_VL, window_tokens=None)
    with pytest.raises(ValueError):
        margin_tokens(one_hot(2, 2), arch=QWEN3_VL, window_tokens=None, ring=-1)


def test_window_order_of_every_token_is_the_models() -> None:
    window_index, cu = get_vision_window_index(torch.tensor([[1, 12, 16]]), spatial_merge_size=2, window_size=112,
                                               patch_size=14)
    tokens = torch.arange(48)
    order, ours = window_order(window_index, cu, tokens)
    assert torch.equal(tokens[order], window_index) and torch.equal(ours, cu)
    subset = torch.tensor([47, 0, 5, 4])  # windows: 0 -> {0}, 1 -> {4, 5}, 3 -> {47}
    order, ours = window_order(window_index, cu, subset)
    assert subset[order].tolist() == [0, 4, 5, 47] and ours.tolist() == [0, 4, 12, 16]
