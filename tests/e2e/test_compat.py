"""Drop-in compatibility: what clients of vLLM's and SGLang's OpenAI servers expect, through the gateway, with the
official openai client and real SGLang workers.

Responses are checked against OpenAI's published schema with no property it does not name (tests/openai_schema.py).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import gateway_config, run_gateway
from tests.images_lib import data_url, encode, small
from tests.openai_schema import assert_valid

pytestmark = pytest.mark.sglang

CARD_EXTRAS = ("root", "parent", "max_model_len")  # what vLLM and SGLang add to OpenAI's model object


def requests_served(gateway, endpoint: str, code: str = "200") -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "revisit_requests"
               for s in f.samples if s.name.endswith("_total") and s.labels == {"endpoint": endpoint, "code": code})


def test_model_cards_carry_what_clients_size_prompts_by(client, gateway, workers):
    worker_card = httpx.get(workers[0].url + "/v1/models", timeout=30).json()["data"][0]
    raw = client.models.with_raw_response.list()
    body = raw.http_response.json()
    card = body["data"][0]
    assert_valid({**body, "data": [{k: v for k, v in card.items() if k not in CARD_EXTRAS}]}, "ListModelsResponse")
    assert card["id"] == gateway.config.model and card["owned_by"] == "revisit" and card["created"] > 0
    assert card["max_model_len"] == worker_card["max_model_len"] > 0 and card["root"] == worker_card["root"]
    one = client.models.retrieve(gateway.config.model)
    assert one.model_dump()["max_model_len"] == card["max_model_len"]


def test_text_completions(client, gateway):
    before = requests_served(gateway, "/v1/completions")
    raw = client.completions.with_raw_response.create(model=gateway.config.model, prompt="The capital of",
                                                      max_tokens=4, temperature=0)
    body = raw.http_response.json()
    assert_valid(body, "CreateCompletionResponse")
    completion = raw.parse()
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert isinstance(completion.choices[0].text, str) and completion.choices[0].finish_reason in ("length", "stop")
    assert completion.usage.completion_tokens <= 4 and completion.usage.total_tokens == \
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    again = client.completions.create(model=gateway.config.model, prompt="The capital of", max_tokens=4,
                                      temperature=0)
    assert again.choices[0].text == completion.choices[0].text  # greedy: the same answer
    assert requests_served(gateway, "/v1/completions") == before + 2


def test_text_completions_streamed_and_batched(client, gateway):
    chunks = list(client.completions.create(model=gateway.config.model, prompt="One two three", max_tokens=5,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for chunk in chunks:
        body = chunk.model_dump(mode="json", exclude_unset=True)
        # OpenAI's document gives streamed text chunks the whole response's schema, whose finish_reason is not
        # nullable; its own streams (and SGLang's, and vLLM's) send null until the last chunk.
        for choice in body["choices"]:
            choice["finish_reason"] = choice["finish_reason"] or "length"
        assert_valid(body, "CreateCompletionResponse")
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 5
    whole = client.completions.create(model=gateway.config.model, prompt="One two three", max_tokens=5, temperature=0)
    assert text == whole.choices[0].text
    batch = client.completions.create(model=gateway.config.model, prompt=["One two three", "The capital of"],
                                      max_tokens=3, temperature=0)
    assert sorted(c.index for c in batch.choices) == [0, 1]


def test_text_completions_refuse_what_is_wrong(client, gateway):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=gateway.config.model, prompt="x", max_tokens=-1)
    assert raised.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=gateway.config.model, prompt="", max_tokens=2)
    response = httpx.post(gateway.url + "/v1/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400 and "error" in response.json()


def test_chat_responses_carry_openais_fields_only_unless_extras_are_on(client, gateway, workers, model_path):
    image = data_url(encode(small("astronaut.png", (56, 56))))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": "What is this?"}]}]
    strict = client.chat.completions.with_raw_response.create(model=gateway.config.model, messages=messages,
                                                             max_tokens=3, temperature=0).http_response.json()
    assert_valid(strict, "CreateChatCompletionResponse")
    assert "reasoning_tokens" not in strict["usage"] and "matched_stop" not in strict["choices"][0]
    lenient = run_gateway(gateway_config(model_path, [w.url for w in workers], response_extras=True))
    try:
        with openai.OpenAI(base_url=lenient.url + "/v1", api_key="sk-test", max_retries=0, timeout=300) as other:
            body = other.chat.completions.with_raw_response.create(
                model=gateway.config.model, messages=messages, max_tokens=3, temperature=0).http_response.json()
            with httpx.stream("POST", lenient.url + "/v1/chat/completions", timeout=120, json={
                    "model": gateway.config.model, "messages": messages, "max_tokens": 3, "stream": True}) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
    finally:
        lenient.stop()
    assert "reasoning_tokens" in body["usage"] and body["usage"]["prompt_tokens_details"]["image_tokens"] > 0
    assert "matched_stop" in body["choices"][0]
    assert body["choices"][0]["message"]["content"] == strict["choices"][0]["message"]["content"]
    assert any("matched_stop" in c["choices"][0] for c in chunks if c.get("choices"))


def test_an_image_sent_once_with_a_uuid_is_served_by_its_uuid_alone(client, gateway):
    """vLLM's cached-media form: the part names the image, and carries no data the second time."""
    image = data_url(encode(small("coffee.png", (84, 56))))

    def ask(part: dict, key: str = "sk-test"):
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=300) as caller:
            return caller.chat.completions.with_raw_response.create(
                model=gateway.config.model, max_tokens=3, temperature=0, messages=[{"role": "user", "content": [
                    part, {"type": "text", "text": "What is this?"}]}])

    first = ask({"type": "image_url", "image_url": {"url": image}, "uuid": "menu-42"})
    again = ask({"type": "image_url", "image_url": None, "uuid": "menu-42"})
    assert again.headers["x-revisit-image-keys"] == first.headers["x-revisit-image-keys"]
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content
    for key, uuid in (("sk-other-tenant", "menu-42"), ("sk-test", "never-sent")):
        with pytest.raises(openai.BadRequestError) as raised:
            ask({"type": "image_url", "image_url": None, "uuid": uuid}, key=key)
        assert raised.value.body["code"] == "unknown_image_uuid"


def test_a_token_id_past_the_vocabulary_is_refused_and_no_worker_falls(client, gateway):
    """SGLang's scheduler crashes on such an id (IndexError in the embedding), and a retry took the next worker down
    too: the fuzzer found it. The gateway now checks ids against the model's vocabulary first."""
    vocab = gateway.config.vocab_size
    assert vocab and vocab > 100
    for prompt in ([vocab + 5], [[1, 2], [vocab]], [-1]):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=gateway.config.model, prompt=prompt, max_tokens=1)
        assert raised.value.body["param"] == "prompt"
    assert httpx.get(gateway.url + "/health", timeout=30).json()["status"] == "ok"
    assert client.completions.create(model=gateway.config.model, prompt=[1, 2, vocab - 1], max_tokens=1).choices
