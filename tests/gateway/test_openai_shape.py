import json

from gateway.openai_shape import CHAT, TEXT, Shape, StreamShaper
from tests.openai_schema import assert_valid

# Shapes as SGLang 0.5.23 sends them (captured from a real worker).
SGLANG_COMPLETION = {
    "id": "f914", "object": "chat.completion", "created": 1795947895, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "abc", "reasoning_content": None},
                 "logprobs": None, "finish_reason": "length", "matched_stop": None}],
    "usage": {"prompt_tokens": 32, "total_tokens": 35, "completion_tokens": 3,
              "prompt_tokens_details": {"cached_tokens": 6, "image_tokens": 16}, "reasoning_tokens": 0,
              "completion_tokens_details": None},
    "metadata": {"weight_version": "default"},
}
SGLANG_TEXT_COMPLETION = {
    "id": "a1", "object": "text_completion", "created": 1795947895, "model": "m",
    "choices": [{"index": 0, "text": " the", "logprobs": None, "finish_reason": "length", "matched_stop": None}],
    "usage": {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": None,
              "reasoning_tokens": 0},
    "metadata": {"weight_version": "default"},
}


def fresh(body: dict) -> dict:
    return json.loads(json.dumps(body))


def chunk(chunk_id: str, index: int, **delta) -> str:
    return "data: " + json.dumps({"id": chunk_id, "object": "chat.completion.chunk", "created": 1, "model": "m",
                                  "choices": [{"index": index, "delta": delta, "finish_reason": None,
                                               "matched_stop": None}]})


def test_a_completion_has_exactly_the_fields_of_openais_schema():
    mended = Shape().completion(fresh(SGLANG_COMPLETION))
    assert_valid(mended, "CreateChatCompletionResponse")  # exact: no property the schema does not name
    assert mended["choices"][0]["message"] == {"role": "assistant", "content": "abc", "refusal": None}
    assert mended["usage"] == {"prompt_tokens": 32, "total_tokens": 35, "completion_tokens": 3,
                               "prompt_tokens_details": {"cached_tokens": 6}}
    assert "metadata" not in mended and "matched_stop" not in mended["choices"][0]


def test_reasoning_tokens_move_to_openais_place():
    body = fresh(SGLANG_COMPLETION)
    body["usage"]["reasoning_tokens"] = 7
    mended = Shape().completion(body)
    assert mended["usage"]["completion_tokens_details"] == {"reasoning_tokens": 7}
    assert_valid(mended, "CreateChatCompletionResponse")


def test_extras_let_sglangs_fields_through_with_the_strict_clients_mends():
    mended = Shape(CHAT, extras=True).completion(fresh(SGLANG_COMPLETION))
    assert mended["usage"]["prompt_tokens_details"]["image_tokens"] == 16 and mended["usage"]["reasoning_tokens"] == 0
    assert "matched_stop" in mended["choices"][0] and mended["metadata"] == {"weight_version": "default"}
    assert mended["choices"][0]["message"]["refusal"] is None and "completion_tokens_details" not in mended["usage"]
    assert_valid(mended, "CreateChatCompletionResponse", exact=False)


def test_a_text_completion_has_exactly_the_fields_of_openais_schema():
    mended = Shape(TEXT).completion(fresh(SGLANG_TEXT_COMPLETION), public_id="cmpl-1")
    assert_valid(mended, "CreateCompletionResponse")
    assert mended["id"] == "cmpl-1" and mended["choices"][0]["text"] == " the"


def test_stream_ids_are_unified_and_chunks_mended():
    shaper = StreamShaper()
    first = json.loads(shaper.line(chunk("aaa", 0, role="assistant", content="", reasoning_content=None))[6:])
    assert first["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    assert_valid(first, "CreateChatCompletionStreamResponse")
    other = json.loads(shaper.line(chunk("bbb", 1, content="x"))[6:])
    assert other["id"] == "aaa" and other["choices"][0]["index"] == 1
    usage = 'data: {"id":"bbb","object":"chat.completion.chunk","created":1,"model":"m","choices":[],' \
            '"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3,"completion_tokens_details":null,' \
            '"reasoning_tokens":0}}'
    mended = json.loads(shaper.line(usage)[6:])
    assert mended["id"] == "aaa" and mended["usage"] == {"prompt_tokens": 1, "completion_tokens": 2,
                                                         "total_tokens": 3}
    assert_valid(mended, "CreateChatCompletionStreamResponse")
    assert shaper.line("data: [DONE]") == "data: [DONE]"
    error = 'data: {"error":{"message":"x","type":"t","param":null,"code":null}}'
    assert shaper.line(error) == error


def test_with_extras_a_chunk_with_nothing_to_mend_passes_byte_for_byte():
    shaper = Shape(CHAT, extras=True).stream(public_id="chatcmpl-1", upstream_id="up")
    line = 'data: {"id":"up","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,' \
           '"delta":{"content":"x"},"finish_reason":null,"matched_stop":null}]}'
    assert shaper.line(line) == line.replace('"id":"up"', '"id":"chatcmpl-1"')
