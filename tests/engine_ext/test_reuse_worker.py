"""Reuse plans executed by real SGLang CPU workers, checked against full prefill and the reference.

Two workers per model family share one store (shared-memory files + LMDB in a temporary directory), as workers on
one host do: worker A makes an entry on a miss; worker B, which has never seen the image, reuses it, so its vision
tower provably does not run (SGLang's own encoder cache cannot have the image).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from bundled import ARCHS
from engine_ext.executor import read
from launcher import WorkerProcess, WorkerSpec, start_worker
from offline.reference import EncoderOutput, Fresh, ImageKV, ReferenceModel, Reuse, prefill, uniform
from plan import EXACT, MISS, RID_PREFIX, ImagePlan, RequestPlan
from store import StoreConfig, open_store
from store.entry import parse_header
from tests.conftest import free_port
from tests.images_lib import data_url, encode

pytestmark = pytest.mark.sglang

QUESTION = "What is in the picture?"
VISION_LOG = "revisit: vision tower encoded"
RATIOS = (0.0, 0.3, 1.0)


@dataclass
class Pair:
    arch: str
    a: WorkerProcess
    b: WorkerProcess
    store_env: dict[str, str]
    model: ReferenceModel

    def store(self):
        return open_store(StoreConfig.from_env(self.store_env))


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    arch = request.param
    root = tmp_path_factory.mktemp(f"reuse-{arch}")
    env = {"REVISIT_STORE_DRAM_DIR": str(root / "dram"), "REVISIT_STORE_LMDB_DIR": str(root / "lmdb")}
    workers = [start_worker(WorkerSpec(model_path=tiny_models[arch], port=free_port(), served_model_name="m",
                                       log_file=root / f"worker-{name}.log", env=env)) for name in "ab"]
    try:
        async def ready() -> None:
            await asyncio.gather(*(w.wait_ready_async(600) for w in workers))

        asyncio.run(ready())
        yield Pair(arch, *workers, env, ReferenceModel.load(tiny_models[arch]))
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture(scope="module")
def picture(astronaut: Image.Image) -> Image.Image:
    return astronaut.resize((224, 224))


def key_for(label: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_URL, label).hex * 2


def grid_of(prompt) -> tuple[int, int]:
    _, h, w = prompt.images[0].grid
    return h, w


def rid(*images: ImagePlan) -> str:
    return RequestPlan(images=images).to_rid(uuid.uuid4().hex)


def content(*parts: str | Image.Image) -> list[dict]:
    return [{"type": "text", "text": p} if isinstance(p, str) else
            {"type": "image_url", "image_url": {"url": data_url(encode(p))}} for p in parts]


def chat(worker: WorkerProcess, parts: list[dict], *, plan_rid: str | None = None, tokens: int = 16) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": tokens,
            "temperature": 0, "logprobs": True, "top_logprobs": 5}
    if plan_rid:
        body["rid"] = plan_rid
    response = httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()


def flush(worker: WorkerProcess) -> None:
    """Empty the radix cache, so the next request computes its whole prompt (no prefix reuse by SGLang)."""
    httpx.post(worker.url + "/flush_cache", timeout=30).raise_for_status()


def text_of(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def top5(response: dict) -> list[float]:
    return sorted((e["logprob"] for e in response["choices"][0]["logprobs"]["content"][0]["top_logprobs"]),
                  reverse=True)


def vision_runs(worker: WorkerProcess) -> int:
    return worker.log_file.read_text().count(VISION_LOG)


def wait_stored(pair: Pair, key: str, timeout: float = 60) -> None:
    store = pair.store()
    deadline = time.monotonic() + timeout
    while not store.contains(key):
        assert time.monotonic() < deadline, f"entry {key} never stored"
        time.sleep(0.2)


def stored_as_reference(pair: Pair, key: str, prompt) -> ImageKV:
    m = pair.model
    stored = read(pair.store(), key, model_id=pair.a.spec.model_path.name, layers=m.num_layers,
                  kv_heads=m.kv_heads, head_dim=m.head_dim, tokens=len(prompt.images[0]))
    assert stored is not None
    return ImageKV(encoder=EncoderOutput.from_flat(stored.encoder, m.hidden), k=stored.k, v=stored.v,
                   positions=stored.positions, grid=prompt.images[0].grid)


@pytest.fixture(scope="module")
def seen(pair: Pair, picture: Image.Image) -> dict:
    """Worker A answers a miss planned to store the image under a key; returns the key and A's answer."""
    key = key_for(f"{pair.arch}-astronaut")
    prompt = pair.model.prompt(["Look:", picture, QUESTION])
    grid = grid_of(prompt)
    answer = chat(pair.a, content("Look:", picture, QUESTION),
                  plan_rid=rid(ImagePlan(key=key, strategy=MISS, tokens=grid[0] * grid[1], grid=grid)))
    wait_stored(pair, key)
    return {"key": key, "answer": answer, "prompt": prompt, "grid": grid}


def test_a_miss_stores_what_full_prefill_computes(pair: Pair, seen: dict) -> None:
    prompt, model = seen["prompt"], pair.model
    span = prompt.images[0]
    full = prefill(model, prompt, [Fresh(model.encode(prompt)[0])])
    entry = stored_as_reference(pair, seen["key"], prompt)
    assert torch.equal(entry.positions, prompt.positions[:, span.start : span.stop])
    for layer in range(model.num_layers):
        assert (entry.k[layer] - full.state.k[layer][span.start : span.stop]).abs().max() < 1e-4
        assert (entry.v[layer] - full.state.v[layer][span.start : span.stop]).abs().max() < 1e-4
    assert (entry.encoder.flat() - model.encode(prompt)[0].flat()).abs().max() < 1e-4
    assert f"revisit: stored {seen['key'][:16]}" in pair.a.log_file.read_text()


def test_exact_hit_same_prefix_is_token_identical_and_skips_the_vision_tower(
    pair: Pair, seen: dict, picture: Image.Image
) -> None:
    before = vision_runs(pair.b)
    hits_before = pair.b.log_file.read_text().count(f"revisit: exact hit {seen['key'][:16]}")
    plan = ImagePlan(key=seen["key"], strategy=EXACT, tokens=seen["grid"][0] * seen["grid"][1], grid=seen["grid"])
    flush(pair.b)
    hit = chat(pair.b, content("Look:", picture, QUESTION), plan_rid=rid(plan))
    assert text_of(hit) == text_of(seen["answer"]) and text_of(hit)
    assert top5(hit) == pytest.approx(top5(seen["answer"]), abs=1e-5)
    assert vision_runs(pair.b) == before  # worker B never ran its vision tower on this image
    assert pair.b.log_file.read_text().count(f"revisit: exact hit {seen['key'][:16]}") == hits_before + 1


@pytest.mark.parametrize("ratio", RATIOS)
def test_position_independent_reuse_matches_the_reference(
    pair: Pair, seen: dict, picture: Image.Image, ratio: float
) -> None:
    preamble = "Something else came first, and it was long. Look:"
    model = pair.model
    moved = model.prompt([preamble, picture, QUESTION])
    ratios = uniform(ratio, model.num_layers)
    plan = ImagePlan(key=seen["key"], strategy=EXACT, tokens=seen["grid"][0] * seen["grid"][1], grid=seen["grid"],
                     ratios=ratios)
    flush(pair.b)
    served = chat(pair.b, content(preamble, picture, QUESTION), plan_rid=rid(plan), tokens=1)
    reference = prefill(model, moved, [Reuse(stored_as_reference(pair, seen["key"], moved), ratios)])
    expected = sorted(reference.logits.log_softmax(-1).topk(5).values.tolist(), reverse=True)
    assert top5(served) == pytest.approx(expected, abs=2e-4)
    if ratio == 1.0:  # everything recomputed: a full prefill
        flush(pair.b)
        full = chat(pair.b, content(preamble, picture, QUESTION), tokens=1)
        assert top5(served) == pytest.approx(top5(full), abs=2e-4)


def test_two_images_only_the_seen_one_is_reused(
    pair: Pair, seen: dict, picture: Image.Image, coffee: Image.Image
) -> None:
    other = coffee.resize((224, 224))
    parts = content("Look:", picture, "and then:", other, "Which is brighter?")
    grid = seen["grid"]
    new_key = key_for(f"{pair.arch}-coffee")
    plans = (ImagePlan(key=seen["key"], strategy=EXACT, tokens=grid[0] * grid[1], grid=grid),
             ImagePlan(key=new_key, strategy=MISS, tokens=grid[0] * grid[1], grid=grid))
    before, log_before = vision_runs(pair.b), pair.b.log_file.read_text().count("revisit: exact hit")
    flush(pair.b)
    planned = chat(pair.b, parts, plan_rid=rid(*plans))
    assert vision_runs(pair.b) == before + 1  # only the new image was encoded
    assert pair.b.log_file.read_text().count("revisit: exact hit") == log_before + 1
    wait_stored(pair, new_key)
    flush(pair.b)
    assert text_of(planned) == text_of(chat(pair.b, parts))  # the first image sits after the same text


# Damage to the header or the encoder output is found before the forward: the plan becomes a full prefill. Damage
# to K/V blocks is found when their rows' read comes in: those rows are computed from then on, as a full prefill
# computes them.
DAMAGE = {"kv": "stored K/V of", "encoder": "found no usable entry; full prefill"}


@pytest.mark.parametrize("where", DAMAGE)
def test_a_damaged_entry_falls_back_to_full_prefill(pair: Pair, picture: Image.Image, where: str) -> None:
    key = key_for(f"{pair.arch}-astronaut-damaged-{where}")
    prompt = pair.model.prompt(["Look:", picture, QUESTION])
    grid = grid_of(prompt)
    plan = ImagePlan(key=key, strategy=MISS, tokens=grid[0] * grid[1], grid=grid)
    chat(pair.a, content("Look:", picture, QUESTION), plan_rid=rid(plan), tokens=1)
    wait_stored(pair, key)
    store = pair.store()
    entry_file = Path(pair.store_env["REVISIT_STORE_DRAM_DIR"]) / f"{key}.kv"
    data = bytearray(entry_file.read_bytes())
    offset = -10 if where == "kv" else parse_header(memoryview(data)).header.encoder_range.start + 5
    data[offset] ^= 0xFF  # inside the KV of the last token, or the encoder output of the first
    entry_file.write_bytes(bytes(data))
    assert store.get(key) is None
    exact = ImagePlan(key=key, strategy=EXACT, tokens=grid[0] * grid[1], grid=grid)
    flush(pair.b)
    seen_before = pair.b.log_file.read_text().count(DAMAGE[where])
    answer = chat(pair.b, content("Other words. Look:", picture, QUESTION), plan_rid=rid(exact), tokens=8)
    flush(pair.b)
    assert text_of(answer) == text_of(chat(pair.b, content("Other words. Look:", picture, QUESTION), tokens=8))
    assert pair.b.log_file.read_text().count(DAMAGE[where]) == seen_before + 1


def test_a_plan_that_does_not_fit_is_ignored(pair: Pair, seen: dict, picture: Image.Image) -> None:
    wrong = ImagePlan(key=seen["key"], strategy=EXACT, tokens=6, grid=(2, 3))
    flush(pair.b)
    mismatches = pair.b.log_file.read_text().count("does not match its image")
    answer = chat(pair.b, content("Look:", picture, QUESTION), plan_rid=rid(wrong))
    assert text_of(answer) == text_of(seen["answer"])
    assert pair.b.log_file.read_text().count("does not match its image") == mismatches + 1
    bad = chat(pair.b, content("Look:", picture, QUESTION), plan_rid=f"{RID_PREFIX}x.not-a-plan.", tokens=2)
    assert bad["choices"][0]["message"]["content"]
