"""Request fields: the workers honour them, the gateway owns them, or the request is refused naming them."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequest
from gateway.protocol import (
    GATEWAY_OWNED,
    MESSAGE_FIELDS,
    REFUSED_FOR_SAFETY,
    WORKER_FIELDS,
    iter_media_parts,
    parse_body,
    parse_completion_body,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}


def refused(parse, body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as raised:
        parse(json.dumps(body).encode())
    return raised.value


def test_the_field_lists_are_sglangs():
    """Every field listed as honoured is one SGLang's request model reads, and every field SGLang reads is listed
    as honoured, as the gateway's own or as refused for safety: a new SGLang field shows up here, not as a silently
    ignored setting."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    for endpoint, model in (("chat", ChatCompletionRequest), ("text", CompletionRequest)):
        sglang = set(model.model_fields)
        assert WORKER_FIELDS[endpoint] <= sglang, WORKER_FIELDS[endpoint] - sglang
        classified = WORKER_FIELDS[endpoint] | GATEWAY_OWNED | REFUSED_FOR_SAFETY.keys()
        assert sglang <= classified, sglang - classified


def test_fields_the_workers_honour_pass():
    body, _ = parse_body(json.dumps({**CHAT, "top_k": 5, "repetition_penalty": 1.1, "user": "u"}).encode())
    assert body["top_k"] == 5
    body, _ = parse_completion_body(json.dumps({**TEXT, "echo": True, "suffix": "!"}).encode())
    assert body["echo"] is True


def test_vllms_extensions_are_refused_by_name():
    error = refused(parse_body, {**CHAT, "use_beam_search": True, "n": 2})
    assert error.param == "use_beam_search" and "beam search" in error.message
    assert refused(parse_completion_body, {**TEXT, "guided_json": {}}).param == "guided_json"
    assert refused(parse_body, {**CHAT, "nonsense_field": 1}).param == "nonsense_field"


def test_the_gateways_own_fields_are_refused():
    for name in ("rid", "extra_key", "input_ids", "mm_processor_kwargs", "bootstrap_host"):
        error = refused(parse_body, {**CHAT, name: "x"})
        assert error.param == name and "gateway" in error.message


def test_openai_fields_the_workers_lack_pass_only_when_they_ask_for_nothing():
    parse_body(json.dumps({**CHAT, "store": False, "service_tier": "auto", "modalities": ["text"]}).encode())
    assert refused(parse_body, {**CHAT, "store": True}).param == "store"
    assert refused(parse_body, {**CHAT, "modalities": ["text", "audio"]}).param == "modalities"


def test_image_options_that_change_the_token_grid_are_the_gateways():
    for name, value in (("max_long_side_pixel", 64), ("content_hash", "abc"), ("uuidx", "1")):
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", name: value}}
        body = {**CHAT, "messages": [{"role": "user", "content": [part]}]}
        body_parsed, _ = parse_body(json.dumps(body).encode())  # the top level is fine
        with pytest.raises(InvalidRequest) as raised:
            list(iter_media_parts(body_parsed["messages"]))
        assert raised.value.param == f"messages[0].content[0].image_url.{name}"


def test_a_parts_own_fields():
    image = {"url": "data:image/png;base64,AAAA"}
    with_uuid = [{"type": "image_url", "image_url": image, "uuid": "u-1"},
                 {"type": "image_url", "image_url": None, "uuid": "u-2"}, {"type": "text", "text": "hi"}]
    refs = list(iter_media_parts([{"role": "user", "content": with_uuid}]))
    assert [(r.url, r.uuid) for r in refs] == [(image["url"], "u-1"), ("", "u-2")]
    # SGLang's own vision tests mark images "multi-images": every value SGLang takes is taken (none changes a Qwen-VL
    # grid), anything else named.
    for modality in ("image", "multi-images", "video"):
        part = {"type": "image_url", "image_url": image, "modalities": modality}
        assert [r.url for r in iter_media_parts([{"role": "user", "content": [part]}])] == [image["url"]]
    for part, param in (({"type": "image_url", "image_url": None, "uuid": 7}, "messages[0].content[0].uuid"),
                        ({"type": "image_url", "image_url": image, "modalities": "audio"},
                         "messages[0].content[0].modalities"),
                        ({"type": "image_url", "image_url": image, "modalities": ["image"]},
                         "messages[0].content[0].modalities"),
                        ({"type": "text", "text": "hi", "cache_control": {}}, "messages[0].content[0].cache_control")):
        with pytest.raises(InvalidRequest) as raised:
            list(iter_media_parts([{"role": "user", "content": [part]}]))
        assert raised.value.param == param


def test_message_fields_are_sglangs():
    """A message's fields, as SGLang's message models read them: a user message's ``name``, which SGLang drops, is
    refused like any other field it would not honour."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionMessageGenericParam, ChatCompletionMessageUserParam

    assert MESSAGE_FIELDS["user"] == set(ChatCompletionMessageUserParam.model_fields)
    assert MESSAGE_FIELDS["other"] == set(ChatCompletionMessageGenericParam.model_fields)
    tool_call = {"role": "assistant", "content": None, "reasoning_content": "r",
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert list(iter_media_parts([{"role": "user", "content": "hi"}, tool_call,
                                  {"role": "tool", "content": "1", "tool_call_id": "c"}])) == []
    for message, param in (({"role": "user", "content": "hi", "name": "ann"}, "messages[0].name"),
                           ({"role": "system", "content": "s", "cache_control": {}}, "messages[0].cache_control")):
        with pytest.raises(InvalidRequest) as raised:
            list(iter_media_parts([message]))
        assert raised.value.param == param and raised.value.code == "unsupported_parameter"


def test_stream_options_are_sglangs():
    parse_body(json.dumps({**CHAT, "stream": True,
                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode())
    error = refused(parse_body, {**CHAT, "stream": True, "stream_options": {"include_obfuscation": False}})
    assert error.param == "stream_options.include_obfuscation"


def test_video_parts():
    video = {"url": "data:video/mp4;base64,AAAA"}
    refs = list(iter_media_parts([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "video_url",
                                                                                     "video_url": video}]}]))
    assert [type(r).__name__ for r in refs] == ["ImagePartRef", "VideoPartRef"]
    assert refs[1].url == video["url"] and refs[1].param == "messages[0].content[1].video_url"
    for part, param in (({"type": "video_url", "video_url": {**video, "fps": 1}}, "video_url.fps"),
                        ({"type": "video_url", "video_url": {**video, "max_frames": 4}}, "video_url.max_frames"),
                        ({"type": "video_url", "video_url": {"url": ""}}, "video_url.url"),
                        ({"type": "video_url", "video_url": video, "uuid": "v"}, "uuid")):
        with pytest.raises(InvalidRequest) as raised:
            list(iter_media_parts([{"role": "user", "content": [part]}]))
        assert raised.value.param == f"messages[0].content[0].{param}"


def test_token_id_prompts_stay_inside_the_vocabulary():
    """SGLang takes any id, and one past the embedding crashes its scheduler (found by tests/fuzz)."""
    for prompt in ([1, 2, 3], [[5, 6], [7]]):
        body, _ = parse_completion_body(json.dumps({**TEXT, "prompt": prompt}).encode(), 100)
        assert body["prompt"] == prompt
    for prompt, code in (([1, 100], "invalid_token_id"), ([[5], [-1]], "invalid_token_id"),
                         ([[5], []], None), ([199_999], "invalid_token_id")):
        with pytest.raises(InvalidRequest) as raised:
            parse_completion_body(json.dumps({**TEXT, "prompt": prompt}).encode(), 100)
        assert raised.value.param == "prompt" and raised.value.code == code
    with pytest.raises(InvalidRequest, match="REVISIT_MODEL_DIR"):
        parse_completion_body(json.dumps({**TEXT, "prompt": [1, 2]}).encode(), None)
    parse_completion_body(json.dumps(TEXT).encode(), None)  # text needs no vocabulary
