"""The harness for tests that run reuse plans on real SGLang CPU workers: a pair of workers sharing one store, plans
sent in the request id, and what the workers answered, stored and reported."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from PIL import Image

from engine_ext.executor import read
from launcher import WorkerProcess, WorkerSpec, start_worker
from offline.reference import EncoderOutput, ImageKV, ReferenceModel
from plan import PUBLIC_PLAN_KEY, ImagePlan, RequestPlan
from plan.outcome import Outcome, OutcomeBox
from store import StoreConfig, open_store
from tests.conftest import free_port
from tests.images_lib import data_url, encode
from tests.waiting import wait_until

QUESTION = "What is in the picture?"
VISION_LOG = "revisit: vision tower encoded"


@dataclass
class Pair:
    arch: str
    a: WorkerProcess
    b: WorkerProcess
    store_env: dict[str, str]
    model: ReferenceModel

    def store(self):
        return open_store(StoreConfig.from_env(self.store_env))


def worker_pair(arch: str, model_path: Path, root: Path, extra_args: tuple[tuple[str, ...], tuple[str, ...]] = ((), ()),
                timeout: float = 600) -> Iterator[Pair]:
    """Workers a and b on one model (each with its own SGLang arguments), sharing a store under root; stopped after."""
    env = {"REVISIT_STORE_DRAM_DIR": str(root / "dram"), "REVISIT_STORE_LMDB_DIR": str(root / "lmdb")}
    workers = [start_worker(WorkerSpec(model_path=model_path, port=free_port(), served_model_name="m",
                                       log_file=root / f"worker-{name}.log", env=env, extra_args=extra))
               for name, extra in zip("ab", extra_args, strict=True)]
    try:
        async def ready() -> None:
            await asyncio.gather(*(w.wait_ready_async(timeout) for w in workers))

        asyncio.run(ready())
        yield Pair(arch, *workers, env, ReferenceModel.load(model_path))
    finally:
        for worker in workers:
            worker.stop()


def key_for(label: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_URL, label).hex * 2


def grid_of(prompt) -> tuple[int, int]:
    _, h, w = prompt.images[0].grid
    return h, w


def rid(*images: ImagePlan) -> str:
    return RequestPlan(images=images).to_rid(uuid.uuid4().hex, key=PUBLIC_PLAN_KEY)


def ran(pair: Pair, plan_rid: str) -> dict[int, Outcome] | None:
    """What the worker reported it ran for the request (plan.outcome), as the gateway takes it."""
    request_id = RequestPlan.request_id(plan_rid)
    assert request_id is not None
    return OutcomeBox(StoreConfig.from_env(pair.store_env).outcomes_path).take(request_id)


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
    wait_until(lambda: store.contains(key), f"entry {key} to be stored", timeout)


def stored_as_reference(pair: Pair, key: str, prompt) -> ImageKV:
    m = pair.model
    stored = read(pair.store(), key, model_id=pair.a.spec.model_path.name, layers=m.num_layers,
                  kv_heads=m.kv_heads, head_dim=m.head_dim, tokens=len(prompt.images[0]))
    assert stored is not None
    return ImageKV(encoder=EncoderOutput.from_flat(stored.encoder, m.hidden), k=stored.k, v=stored.v,
                   positions=stored.positions, grid=prompt.images[0].grid)


APPROXIMATE_PREAMBLE = "Here is a new version. Look:"


def edited(picture: Image.Image, shade: int = 20) -> Image.Image:
    """The picture with a dark box over a few tokens in its top-left corner (inside one of Qwen2.5-VL's attention
    windows, so that a partial vision pass encodes a quarter of the image)."""
    from PIL import ImageDraw

    out = picture.copy()
    ImageDraw.Draw(out).rectangle((8, 8, 70, 60), fill=(shade, shade, shade))
    return out


def gateway_plan(pair: Pair, alias_key: str, alias_image: Image.Image, image: Image.Image, grid: tuple[int, int],
                 selector: str, alias_grid: tuple[int, int] | None = None) -> ImagePlan:
    """The plan the gateway makes for image against alias_image (its default pixel features and settings)."""
    from gateway.config import MatchSettings
    from gateway.matching.pixel import PixelExtractor
    from gateway.matching.plans import plan_against

    cell = 28 if pair.arch == "qwen2_5_vl" else 32
    extractor = PixelExtractor()
    new, old = extractor.extract(image, grid, cell), extractor.extract(alias_image, alias_grid or grid, cell)
    plan = plan_against(new, old, alias=alias_key, key=key_for(f"{pair.arch}-edited"), settings=MatchSettings(),
                        selector=selector, layers=pair.model.num_layers)
    assert plan is not None and plan.change_map.count("x") < plan.tokens // 4
    return plan
