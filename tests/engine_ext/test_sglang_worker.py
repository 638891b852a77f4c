"""A real SGLang CPU worker on a tiny bundled model: start, serve images, agree with HF, stop.

Runs on the default architecture; ``REVISIT_TEST_ARCHS=qwen2_5_vl,qwen3_vl`` runs every listed one
(each costs one more worker start).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from bundled import ARCHS, DEFAULT_ARCH, QWEN2_5_VL, QWEN3_VL, get_recipe
from engine_ext.models import ACTIVE_LOG_PREFIX
from launcher import WorkerProcess, WorkerSpec, start_worker
from tests.conftest import free_port
from tests.images_lib import image_message

pytestmark = pytest.mark.sglang

READY_TIMEOUT_S = 600
MODEL_NAME = "revisit-tiny"
QUESTION = "What is in the picture?"
TEST_ARCHS = [a for a in os.environ.get("REVISIT_TEST_ARCHS", DEFAULT_ARCH).split(",") if a]
assert set(TEST_ARCHS) <= set(ARCHS), TEST_ARCHS
MODEL_CLASSES = {
    QWEN2_5_VL: "engine_ext.models.qwen2_5_vl.Qwen2_5_VLForConditionalGeneration",
    QWEN3_VL: "engine_ext.models.qwen3_vl.Qwen3VLForConditionalGeneration",
}
# image tokens of the 512x512 astronaut: 504x504 / 28**2 for Qwen2.5-VL, 512x512 / 32**2 for Qwen3-VL
ASTRONAUT_IMAGE_TOKENS = {QWEN2_5_VL: 324, QWEN3_VL: 256}


@pytest.fixture(scope="module", params=TEST_ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def worker(
    arch: str, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    spec = WorkerSpec(
        model_path=tiny_models[arch],
        port=free_port(),
        served_model_name=MODEL_NAME,
        log_file=tmp_path_factory.mktemp("sglang") / "worker.log",
    )
    started = start_worker(spec)
    try:
        started.wait_ready(READY_TIMEOUT_S)
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def client(worker: WorkerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=worker.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def test_sglang_serves_our_model_class(arch: str, worker: WorkerProcess) -> None:
    log = worker.log_file.read_text()
    assert f"{ACTIVE_LOG_PREFIX} {MODEL_CLASSES[arch]}" in log
    assert "Using default HuggingFace chat template" in log  # the bundled template, not a built-in one


def test_chat_completion_with_a_png_image(arch: str, client: openai.OpenAI, astronaut: Image.Image) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=image_message(astronaut, QUESTION), max_tokens=8, temperature=0
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content and choice.message.content.isascii()
    assert response.usage.completion_tokens == 8
    assert response.usage.prompt_tokens_details.model_extra["image_tokens"] == ASTRONAUT_IMAGE_TOKENS[arch]
    again = client.chat.completions.create(
        model=MODEL_NAME, messages=image_message(astronaut, QUESTION), max_tokens=8, temperature=0
    )
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens_details.cached_tokens == response.usage.prompt_tokens - 1


def test_streaming_with_usage(client: openai.OpenAI, astronaut: Image.Image) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=image_message(astronaut, QUESTION),
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_logprobs_agree_with_transformers(
    arch: str, client: openai.OpenAI, tiny_models: dict[str, Path], astronaut: Image.Image
) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=image_message(astronaut, QUESTION),
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    served = {entry.token: entry.logprob for entry in response.choices[0].logprobs.content[0].top_logprobs}

    path = tiny_models[arch]
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=[astronaut], return_tensors="pt")
    with torch.no_grad():
        logprobs = model(**inputs).logits[0, -1].log_softmax(-1)  # (vocab,)
    top = logprobs.topk(5)
    reference = {processor.tokenizer.decode([int(i)]): float(v) for v, i in zip(top.values, top.indices, strict=True)}
    assert response.usage.prompt_tokens == inputs["input_ids"].shape[1]
    assert served.keys() == reference.keys()
    for token, value in reference.items():
        # float32 on both sides: SGLang loaded every weight and runs the same computation.
        assert served[token] == pytest.approx(value, abs=1e-4), token


def test_errors_come_back_as_sglang_error_objects(worker: WorkerProcess, astronaut: Image.Image) -> None:
    broken = image_message(astronaut, QUESTION)
    broken[0]["content"][0]["image_url"]["url"] = "data:image/png;base64,AAAA"
    response = httpx.post(
        worker.url + "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": broken, "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 400
    body = response.json()
    assert body["object"] == "error" and body["code"] == 400 and "image" in body["message"].lower()


def test_stop_leaves_no_processes(arch: str, worker: WorkerProcess) -> None:
    assert len(worker.live_processes()) >= 3  # server, scheduler, detokenizer
    worker.stop()
    assert worker.live_processes() == []
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", worker.spec.port)) != 0
    recipe = get_recipe(arch, "tiny")
    assert json.loads((worker.spec.model_path / "revisit-recipe.json").read_text())["name"] == recipe.name
