"""The executor's core without SGLang, on every device this machine has: attention for the computed rows over a
KV pool, how deep each image row is computed, and the K/V row groups read from a real store for a reuse span.

On a CPU-only host the CUDA cases are skipped (there is no device to run them on); on a GPU host they run."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import torch

from engine_ext.executor.attention import Sequences, attend_rows, attention_probs
from engine_ext.executor.entries import KVFetch, StoredImage, read_head, to_entry
from engine_ext.executor.events import FullPrefill
from engine_ext.executor.rows import reuse_depths
from engine_ext.rope import inv_freq, reposition
from plan import recompute_count
from store import DramTier

DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def test_attention_for_some_rows_equals_full_causal_attention(device: torch.device) -> None:
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 4, 2, 16
    prefix_lens, extend_lens = [3, 0], [5, 7]  # the first sequence has 3 rows cached from before
    pool = torch.randn(64, 2, kv_heads, head_dim, device=device)  # (slots, K|V, kv_heads, head_dim)
    order = torch.randperm(64, device=device)
    slots = [order[:8], order[8:15]]  # each sequence's rows live in scattered pool slots
    sequences = Sequences.of(prefix_lens=prefix_lens, extend_lens=extend_lens, slots=slots, device=device)
    q = torch.randn(12, heads * head_dim, device=device)  # one query per extend row
    active = torch.tensor([0, 2, 4, 5, 9, 11], device=device)  # the rows that ask

    out = attend_rows(q[active], pool[:, 0], pool[:, 1], sequences, active, scaling=head_dim**-0.5, heads=heads,
                      kv_heads=kv_heads)

    assert out.device.type == device.type and out.shape == (len(active), heads * head_dim)
    expected, row = [], 0
    for prefix, extend, seq_slots in zip(prefix_lens, extend_lens, slots, strict=True):
        k = pool[seq_slots, 0].repeat_interleave(heads // kv_heads, dim=1)  # (seq, heads, head_dim)
        v = pool[seq_slots, 1].repeat_interleave(heads // kv_heads, dim=1)
        for position in range(prefix, prefix + extend):
            query = q[row].view(heads, head_dim)
            weights = torch.softmax((k[: position + 1] * query).sum(-1) * head_dim**-0.5, dim=0)  # (seen, heads)
            expected.append((weights.unsqueeze(-1) * v[: position + 1]).sum(0).reshape(-1))
            row += 1
    torch.testing.assert_close(out, torch.stack(expected)[active], rtol=1e-4, atol=1e-5)


def test_hidden_keys_are_seen_by_no_query_and_probabilities_are_the_layers_own(device: torch.device) -> None:
    torch.manual_seed(1)
    heads, kv_heads, head_dim = 4, 2, 8
    pool = torch.randn(32, 2, kv_heads, head_dim, device=device)
    slots = [torch.arange(10, device=device), torch.arange(10, 16, device=device)]
    sequences = Sequences.of(prefix_lens=[4, 0], extend_lens=[6, 6], slots=slots, device=device)
    q = torch.randn(12, heads * head_dim, device=device)
    active = torch.arange(12, device=device)
    hidden = torch.zeros(10, dtype=torch.bool, device=device)
    hidden[[1, 2, 5]] = True  # positions of the first sequence no query may see (an approximate plan's D)
    out = attend_rows(q, pool[:, 0], pool[:, 1], sequences, active, scaling=0.3, heads=heads, kv_heads=kv_heads,
                      hidden=[hidden, None])
    # the same as attention over a pool where the hidden keys are absent
    kept = torch.tensor([0, 3, 4, 6, 7, 8, 9], device=device)
    for row, position in enumerate(range(4, 10)):
        seen = kept[kept <= position]
        k = pool[seen, 0].repeat_interleave(heads // kv_heads, dim=1)
        v = pool[seen, 1].repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax((k * q[row].view(heads, head_dim)).sum(-1) * 0.3, dim=0)
        torch.testing.assert_close(out[row], (weights.unsqueeze(-1) * v).sum(0).reshape(-1), rtol=1e-4, atol=1e-5)
    # the second sequence hid nothing: it equals plain causal attention
    plain = attend_rows(q, pool[:, 0], pool[:, 1], sequences, active, scaling=0.3, heads=heads, kv_heads=kv_heads)
    torch.testing.assert_close(out[6:], plain[6:])
    # probabilities of the last two rows of the first sequence on its keys 2..6, over every key they see
    probs = attention_probs(q[4:6], pool[:, 0], slots[0], sequences.where[4:6], slice(2, 7), scaling=0.3,
                            heads=heads)
    k = pool[slots[0], 0].repeat_interleave(heads // kv_heads, dim=1)  # (10, heads, hd)
    for index, position in enumerate((8, 9)):
        scores = (k[: position + 1] * q[4 + index].view(heads, head_dim)).sum(-1) * 0.3  # (seen, heads)
        torch.testing.assert_close(probs[:, index], torch.softmax(scores, dim=0)[2:7].T, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("ratios", [(), (0.5, 0.25, 0.25, 0.0), (1.0, 1.0, 0.3, 0.1)])
def test_each_row_is_computed_at_the_layers_its_ratio_gives_it(device: torch.device, ratios) -> None:
    tokens, layers = 20, 4
    counts = [recompute_count(r, tokens) for r in ratios]
    local = torch.arange(6, 20, device=device)  # the image rows of this chunk
    depth = reuse_depths(counts, local)
    assert depth.device.type == device.type
    for i, d in zip(local.tolist(), depth.tolist(), strict=True):
        computed_at = [layer for layer in range(layers) if counts and counts[layer] > i]
        assert computed_at == list(range(d))  # the first d layers and no others


@pytest.fixture
def dram(tmp_path: Path):
    path = Path("/dev/shm") / f"revisit-core-{uuid.uuid4().hex[:12]}"
    tier = DramTier(path, pin_host_memory=False)
    yield tier
    tier.close()
    shutil.rmtree(path, ignore_errors=True)


LAYERS, TOKENS, KV_HEADS, HEAD_DIM = 4, 12, 2, 8


def stored_image() -> StoredImage:
    generator = torch.Generator().manual_seed(1)
    k = torch.randn(LAYERS, TOKENS, KV_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
    v = torch.randn(LAYERS, TOKENS, KV_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
    positions = torch.stack([torch.full((TOKENS,), 4), 4 + torch.arange(TOKENS) // 4, 4 + torch.arange(TOKENS) % 4])
    return StoredImage(encoder=torch.randn(TOKENS, 16, generator=generator), positions=positions, k=k, v=v)


@pytest.mark.parametrize(("depth", "delta"), [(0, 0), (2, 0), (1, 9)])
def test_a_row_group_read_is_those_rows_layers_moved_to_the_new_positions(device: torch.device, dram, depth: int,
                                                                          delta: int) -> None:
    image, key = stored_image(), "c" * 64
    dram.put(key, to_entry("m", (3, 4), image, prefix_digest="p"))
    head = read_head(dram, key, model_id="m", layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, tokens=TOKENS)
    assert head is not None and torch.equal(head.positions, image.positions) and torch.equal(head.encoder,
                                                                                                image.encoder)
    with pytest.raises(FullPrefill, match="entry_foreign"):  # another model's entry is no entry
        read_head(dram, key, model_id="other", layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, tokens=TOKENS)
    with pytest.raises(FullPrefill, match="entry_missing"):
        read_head(dram, "d" * 64, model_id="m", layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, tokens=TOKENS)

    frequencies = inv_freq(10000.0, HEAD_DIM)
    rows = [1, 2, 7, 11]
    reader = KVFetch()
    try:
        group = reader.fetch(dram, key, tokens=rows, depth=depth, layers=LAYERS, kv_dtype=head.kv_dtype, delta=delta,
                             frequencies=frequencies, device=device).result(timeout=60)
        assert group is not None
        group.wait()  # on a GPU: the reader's stream made them
    finally:
        reader.close()
    assert group is not None and group.depth == depth and group.tokens == tuple(rows)
    assert group.k.device.type == device.type and group.k.shape == (LAYERS - depth, len(rows), KV_HEADS * HEAD_DIM)
    expected_k = reposition(image.k[depth:, rows], delta, frequencies)  # (layers - depth, rows, kv_heads, hd)
    torch.testing.assert_close(group.k.cpu(), expected_k.flatten(2), rtol=0, atol=0)
    torch.testing.assert_close(group.v.cpu(), image.v[depth:, rows].flatten(2), rtol=0, atol=0)


def test_a_damaged_block_makes_the_group_read_none(dram) -> None:
    image, key = stored_image(), "d" * 64
    entry = to_entry("m", (3, 4), image)
    dram.put(key, entry)
    offset = entry.header.token_layers_range(7, 2, 3).start + 5  # token 7, layer 2
    with open(dram.path / f"{key}.kv", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    reader = KVFetch()
    try:
        fetch = dict(depth=1, layers=LAYERS, kv_dtype="bfloat16", delta=0, frequencies=inv_freq(1e4, HEAD_DIM),
                     device=torch.device("cpu"))
        assert reader.fetch(dram, key, tokens=[6, 7], **fetch).result(timeout=60) is None
        assert reader.fetch(dram, key, tokens=[6, 8], **fetch).result(timeout=60) is not None  # intact rows read
    finally:
        reader.close()


def random_rows_batch(device: torch.device, *, heads: int, kv_heads: int, head_dim: int, seed: int):
    """A random extend batch for attend_rows: sequences of different prefix and extend lengths in scattered pool
    slots, some active rows per sequence (none in some), hidden keys in some; (q, keys, values, sequences, active,
    hidden)."""
    generator = torch.Generator().manual_seed(seed)
    prefix_lens, extend_lens = [0, 5, 17, 3, 0, 40, 9], [6, 1, 12, 4, 9, 30, 2]
    lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    order = torch.randperm(sum(lens) + 16, generator=generator).to(device)
    cuts = torch.tensor([0, *lens]).cumsum(0).tolist()
    slots = [order[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    sequences = Sequences.of(prefix_lens=prefix_lens, extend_lens=extend_lens, slots=slots, device=device)
    rows = sum(extend_lens)
    chosen = torch.rand(rows, generator=generator) < 0.6
    chosen[[0, 10, 25, 40, 63]] = True  # the first, third, fifth, sixth and last sequences ask (rows end at
    chosen[6] = False  # 6, 7, 19, 23, 32, 62, 64); the second (one extend row) asks nothing
    chosen[19:23] = False  # nor the fourth
    active = chosen.nonzero().flatten().to(device)
    pool = torch.randn(len(order), 2, kv_heads, head_dim, generator=generator).to(device)
    q = torch.randn(len(active), heads * head_dim, generator=generator).to(device)
    hidden: list[torch.Tensor | None] = [None] * len(lens)
    for index in (2, 5):  # some keys of two sequences no query may see
        hidden[index] = (torch.rand(lens[index], generator=generator) < 0.3).to(device)
    return q, pool[:, 0], pool[:, 1], sequences, active, hidden


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("with_hidden", [False, True])
def test_batched_rows_attention_equals_the_loop(device: torch.device, heads: int, kv_heads: int,
                                                with_hidden: bool) -> None:
    from engine_ext.executor.attention import attend_rows_batched

    q, keys, values, sequences, active, hidden = random_rows_batch(device, heads=heads, kv_heads=kv_heads,
                                                                   head_dim=16, seed=heads * 10 + kv_heads)
    kwargs = dict(scaling=0.25, heads=heads, kv_heads=kv_heads, hidden=hidden if with_hidden else None)
    loop = attend_rows(q, keys, values, sequences, active, **kwargs)
    batched = attend_rows_batched(q, keys, values, sequences, active, **kwargs)
    assert batched.device.type == device.type and batched.shape == loop.shape
    torch.testing.assert_close(batched, loop, rtol=1e-4, atol=1e-5)
    # the padding is never seen: NaN in every pool slot outside the batch's sequences changes nothing
    poisoned_keys, poisoned_values = keys.clone(), values.clone()
    outside = torch.ones(len(keys), dtype=torch.bool, device=device)
    outside[torch.cat(list(sequences.slots))] = False
    poisoned_keys[outside], poisoned_values[outside] = float("nan"), float("nan")
    torch.testing.assert_close(attend_rows_batched(q, poisoned_keys, poisoned_values, sequences, active, **kwargs),
                               loop, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("limit", [1, 5_000, 20_000])
def test_batched_rows_attention_splits_into_groups_under_its_limit(device: torch.device, monkeypatch,
                                                                   limit: int) -> None:
    from engine_ext.executor import attention

    heads, kv_heads, head_dim = 4, 2, 8
    q, keys, values, sequences, active, hidden = random_rows_batch(device, heads=heads, kv_heads=kv_heads,
                                                                   head_dim=head_dim, seed=7)
    calls: list[int] = []  # the sequences of each SDPA call
    group_call = attention._attend_group

    def counted(*args, **kwargs):
        calls.append(len(args[5]))
        return group_call(*args, **kwargs)

    monkeypatch.setattr(attention, "_attend_group", counted)
    kwargs = dict(scaling=0.3, heads=heads, kv_heads=kv_heads, hidden=hidden)
    out = attention.attend_rows_batched(q, keys, values, sequences, active, limit=limit, **kwargs)
    torch.testing.assert_close(out, attend_rows(q, keys, values, sequences, active, **kwargs), rtol=1e-4, atol=1e-5)
    assert sum(calls) == 5  # the seven sequences but the two that ask nothing, each in one group
    if limit == 1:
        assert calls == [1] * 5  # each sequence alone (above the limit alone, it still runs)
    else:
        assert 1 < len(calls) < 5  # split, yet batched


def test_pool_attention_picks_the_batched_version_on_cuda_unless_told(monkeypatch) -> None:
    from types import SimpleNamespace

    from engine_ext.executor import attention

    cpu = torch.zeros(1)
    cuda = SimpleNamespace(is_cuda=True)  # stands in for a CUDA tensor: only is_cuda is asked
    assert attention.rows_attention(cpu) is attention.attend_rows
    assert attention.rows_attention(cuda) is attention.attend_rows_batched
    monkeypatch.setattr(attention, "ROWS_ATTENTION", "loop")
    assert attention.rows_attention(cuda) is attention.attend_rows
    monkeypatch.setattr(attention, "ROWS_ATTENTION", "batched")
    assert attention.rows_attention(cpu) is attention.attend_rows_batched
    monkeypatch.setattr(attention, "ROWS_ATTENTION", "fast")
    with pytest.raises(ValueError, match="REVISIT_ROWS_ATTENTION"):
        attention.rows_attention(cpu)
