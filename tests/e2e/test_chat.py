"""The OpenAI chat API through the gateway, with the official openai client and real SGLang workers.

Ports the portable checks of vLLM's entrypoints/openai test_vision.py and SGLang's
test_vision_openai_server_common.py, using bundled local images instead of internet ones.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from gateway.images import token_grid
from tests.images_lib import data_url, encode, small
from tests.openai_schema import assert_valid

pytestmark = pytest.mark.sglang

QUESTION = "What is in this image?"


@pytest.fixture(scope="module")
def image_a() -> str:
    return data_url(encode(small("astronaut.png", (112, 112))))


@pytest.fixture(scope="module")
def image_b() -> str:
    return data_url(encode(small("coffee.png", (140, 84))))


def user(*parts) -> dict:
    content = [{"type": "image_url", "image_url": {"url": p}} if p.startswith("data:") else {"type": "text", "text": p}
               for p in parts]
    return {"role": "user", "content": content}


def raw_stream(gateway, body: dict) -> list[str]:
    """The ``data:`` payloads of a streamed response, exactly as they came over the wire."""
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def image_tokens(gateway, size: tuple[int, int]) -> int:
    width, height = size
    # +2: <|vision_start|> and <|vision_end|> around the image pads
    return token_grid(height, width, gateway.config.processor).tokens + 2


def test_models_lists_the_served_model(client, gateway):
    models = client.models.list()
    assert [m.id for m in models.data] == [gateway.config.model]
    assert_valid(models.model_dump(mode="json"), "ListModelsResponse", exact=False)  # cards add vLLM's fields
    assert client.models.retrieve(gateway.config.model).id == gateway.config.model


def test_single_image(client, gateway, image_a):
    text_only = client.chat.completions.create(
        model=gateway.config.model, messages=[user(QUESTION)], max_completion_tokens=8, temperature=0
    )
    raw = client.chat.completions.with_raw_response.create(
        model=gateway.config.model, messages=[user(image_a, QUESTION)], max_completion_tokens=8, temperature=0
    )
    assert_valid(raw.http_response.json(), "CreateChatCompletionResponse")
    response = raw.parse()
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert response.usage.completion_tokens <= 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    # The gateway's token grid is the worker's: the image adds exactly grid + 2 prompt tokens.
    added = response.usage.prompt_tokens - text_only.usage.prompt_tokens
    assert added == image_tokens(gateway, (112, 112))


def test_finish_reason_length_under_a_small_budget(client, gateway, image_a):
    for budget in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        response = client.chat.completions.create(
            model=gateway.config.model, messages=[user(image_a, QUESTION)], temperature=0, **budget
        )
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == 3


def test_two_images(client, gateway, image_a, image_b):
    one = client.chat.completions.create(
        model=gateway.config.model, messages=[user(image_a, "Compare.")], max_completion_tokens=4, temperature=0
    )
    both = client.chat.completions.create(
        model=gateway.config.model, messages=[user(image_a, image_b, "Compare.")],
        max_completion_tokens=4, temperature=0,
    )
    assert both.choices[0].message.content
    assert both.usage.prompt_tokens - one.usage.prompt_tokens == image_tokens(gateway, (140, 84))
    # As SGLang's own vision tests send them: each image part marked "multi-images", which changes nothing here.
    marked = user(image_a, image_b, "Compare.")
    for part in marked["content"][:2]:
        part["modalities"] = "multi-images"
    again = client.chat.completions.create(model=gateway.config.model, messages=[marked], max_completion_tokens=4,
                                           temperature=0)
    assert again.usage.prompt_tokens == both.usage.prompt_tokens
    assert again.choices[0].message.content == both.choices[0].message.content


def test_multi_turn_repeating_an_image(client, gateway, image_a):
    first = client.chat.completions.with_raw_response.create(
        model=gateway.config.model, messages=[user(image_a, QUESTION)], max_completion_tokens=6, temperature=0
    )
    answer = first.parse().choices[0].message.content
    messages = [
        user(image_a, QUESTION),
        {"role": "assistant", "content": answer},
        user(image_a, "And what colour is it?"),
    ]
    second = client.chat.completions.with_raw_response.create(
        model=gateway.config.model, messages=messages, max_completion_tokens=6, temperature=0
    )
    assert second.parse().choices[0].message.content
    first_key = first.headers["x-revisit-image-keys"]
    assert second.headers["x-revisit-image-keys"] == f"{first_key},{first_key}"


def test_stream_matches_non_stream_at_temperature_zero(client, gateway, image_a):
    kwargs = dict(model=gateway.config.model, messages=[user(image_a, QUESTION)],
                  max_completion_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    wire = raw_stream(gateway, {**kwargs, "stream": True, "stream_options": {"include_usage": True}})
    assert wire[-1] == "[DONE]"
    for chunk in wire[:-1]:
        assert_valid(json.loads(chunk), "CreateChatCompletionStreamResponse")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    # include_usage: one last chunk with usage and no choices
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_sequence_truncates(client, gateway, image_a):
    kwargs = dict(model=gateway.config.model, messages=[user(image_a, QUESTION)], temperature=0)
    full = client.chat.completions.create(**kwargs, max_completion_tokens=16).choices[0].message.content
    assert len(full) > 4
    stop = full[len(full) // 2:][:3]
    cut = client.chat.completions.create(**kwargs, max_completion_tokens=16, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert full.startswith(cut.choices[0].message.content)
    assert stop not in cut.choices[0].message.content


def test_seed_is_validated_and_passed_through(client, gateway, image_a):
    # SGLang honours seed only with --enable-deterministic-inference (not available on CPU):
    # the gateway checks its type and forwards it.
    response = client.chat.completions.create(
        model=gateway.config.model, messages=[user(image_a, QUESTION)], max_completion_tokens=2, seed=1234)
    assert response.choices[0].message.content
    bad = httpx.post(gateway.url + "/v1/chat/completions", json={
        "model": gateway.config.model, "messages": [user(QUESTION)], "seed": "lucky"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"


def test_n_choices(client, gateway, image_a):
    response = client.chat.completions.create(
        model=gateway.config.model, messages=[user(image_a, QUESTION)], max_completion_tokens=4,
        temperature=1.0, n=2,
    )
    assert sorted(c.index for c in response.choices) == [0, 1]


def test_n_choices_streamed_under_one_id(gateway, image_a):
    wire = raw_stream(gateway, {"model": gateway.config.model, "messages": [user(image_a, QUESTION)],
                                "max_completion_tokens": 4, "temperature": 1.0, "n": 2, "stream": True})
    chunks = [json.loads(c) for c in wire[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    finished = sorted(ch["index"] for c in chunks for ch in c["choices"] if ch.get("finish_reason"))
    assert finished == [0, 1]


def test_logprobs(client, gateway, image_a):
    response = client.chat.completions.create(
        model=gateway.config.model, messages=[user(image_a, QUESTION)], max_completion_tokens=5,
        temperature=0, logprobs=True, top_logprobs=3,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-4)


async def test_twelve_concurrent_mixed_requests(async_client, gateway, image_a, image_b):
    kinds = [[user(image_a, QUESTION)], [user(image_b, QUESTION)], [user(QUESTION)]]

    async def one(i: int):
        messages = kinds[i % 3]
        if i % 2:
            stream = await async_client.chat.completions.create(
                model=gateway.config.model, messages=messages, max_completion_tokens=6, temperature=0,
                stream=True, stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            return i, chunks[-1].usage.prompt_tokens, "".join(
                c.choices[0].delta.content or "" for c in chunks if c.choices)
        response = await async_client.chat.completions.create(
            model=gateway.config.model, messages=messages, max_completion_tokens=6, temperature=0
        )
        return i, response.usage.prompt_tokens, response.choices[0].message.content

    results = await asyncio.gather(*(one(i) for i in range(12)))
    assert len(results) == 12
    prompt_tokens = {}
    for i, tokens, text in results:
        assert text
        prompt_tokens.setdefault(i % 3, set()).add(tokens)
    assert all(len(v) == 1 for v in prompt_tokens.values())
    assert prompt_tokens[0] != prompt_tokens[2] and prompt_tokens[1] != prompt_tokens[2]
    # both workers took a share of the load
    served = [w.served for w in gateway.app.state.services.pool.workers]
    assert all(s > 0 for s in served), served


def test_health_lists_the_workers(gateway):
    import httpx

    response = httpx.get(gateway.url + "/health")
    assert response.status_code == 200
    assert [w["healthy"] for w in response.json()["workers"]] == [True, True]


def test_jpeg_and_rotated_jpeg(client, gateway):
    photo = small("coffee.png", (140, 84))
    exif = Image.Exif()
    # Stored sideways: forwarded as an upright PNG. The token count cannot tell orientation apart;
    # tests/gateway/test_images.py checks the pixels. Here: the worker accepts both forms.
    exif[0x0112] = 6
    for data, size in ((encode(photo, "JPEG"), (140, 84)),
                       (encode(photo.transpose(Image.Transpose.ROTATE_90), "JPEG", exif=exif), (140, 84))):
        text_only = client.chat.completions.create(
            model=gateway.config.model, messages=[user("Compare.")], max_completion_tokens=2)
        response = client.chat.completions.create(
            model=gateway.config.model, messages=[user(data_url(data, "image/jpeg"), "Compare.")],
            max_completion_tokens=2)
        assert response.usage.prompt_tokens - text_only.usage.prompt_tokens == image_tokens(gateway, size)


def test_metrics_count_requests_and_time_them_by_reuse(client, gateway):
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[tuple, float]:
        text = httpx.get(gateway.url + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    chat = ("endpoint", "/v1/chat/completions")
    fresh = Image.new("RGB", (84, 84), (17, 201, 99))
    fresh.putpixel((3, 5), tuple(os.urandom(3)))  # an image no test sent before
    before = samples()
    client.chat.completions.create(model=gateway.config.model, messages=[user("hello")], max_completion_tokens=2)
    streamed = client.chat.completions.create(model=gateway.config.model, messages=[user(data_url(encode(fresh)), "?")],
                                              max_completion_tokens=2, stream=True)
    assert [c for c in streamed]
    refused = httpx.post(gateway.url + "/v1/chat/completions", json={"model": gateway.config.model, "messages": 3})
    assert refused.status_code == 400
    after = samples()

    def grew(name: str, *labels: tuple[str, str]) -> float:
        key = (name, tuple(sorted(labels)))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # A request is recorded once its response has ended on the server's side, which for a stream may come just
    # after the client read its last chunk.
    deadline = time.monotonic() + 30
    while grew("revisit_requests_total", chat, ("code", "200")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        after = samples()

    assert grew("revisit_requests_total", chat, ("code", "200")) == 2
    assert grew("revisit_requests_total", chat, ("code", "400")) == 1
    assert grew("revisit_request_duration_seconds_count", chat, ("reuse", "none")) == 2  # the text and the refused
    assert grew("revisit_request_duration_seconds_count", chat, ("reuse", "miss")) == 1
    assert grew("revisit_time_to_first_token_seconds_count", ("reuse", "miss")) == 1
    first = grew("revisit_time_to_first_token_seconds_sum", ("reuse", "miss"))
    assert 0 < first <= grew("revisit_request_duration_seconds_sum", chat, ("reuse", "miss"))
    assert grew("revisit_time_to_first_token_seconds_count", ("reuse", "none")) == 0  # not streamed


def test_a_large_image_body_reaches_the_worker_as_the_client_wrote_it(gateway, workers):
    """A body past 1 MiB has its data URLs left in its bytes while it is parsed, and spliced back into the JSON the
    worker gets (gateway/json_body.py's CutURL, gateway/dispatch.py's UpstreamRequest): the worker sees the very
    image, so the first token's log-probability is plain SGLang's for the same body, and not for another image."""
    rng = np.random.default_rng(7)
    bodies = []
    for _ in range(2):
        pixels = rng.integers(0, 255, (896, 896, 3), dtype=np.uint8)  # the most pixels the model keeps: as sent
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "PNG", compress_level=0)
        bodies.append({"model": gateway.config.model, "max_tokens": 1, "temperature": 0, "logprobs": True,
                       "messages": [user(data_url(out.getvalue()), "What is in the picture?")]})
    assert len(json.dumps(bodies[0])) > 3 << 20

    def first_logprob(url: str, body: dict) -> float:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["logprobs"]["content"][0]["logprob"]

    through, direct, other = (first_logprob(gateway.url, bodies[0]), first_logprob(workers[0].url, bodies[0]),
                              first_logprob(workers[0].url, bodies[1]))
    assert through == pytest.approx(direct, abs=1e-4) and direct != pytest.approx(other, abs=1e-4)
