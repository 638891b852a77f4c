import json

from gateway.openai_shape import StreamShaper, completion
from tests.openai_schema import assert_valid

# Shapes as SGLang 0.5.23 sends them (captured from a real worker).
SGLANG_COMPLETION = {
    "id": "f914", "object": "chat.completion", "created": 1795947895, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "abc", "reasoning_content": None},
                 "logprobs": None, "finish_reason": "length", "matched_stop": None}],
    "usage": {"prompt_tokens": 32, "total_tokens": 35, "completion_tokens": 3,
              "prompt_tokens_details": {"cached_tokens": 6, "image_tokens": 16}, "reasoning_tokens": 0,
              "completion_tokens_details": None},
}


def chunk(chunk_id: str, index: int, **delta) -> str:
    return "data: " + json.dumps({"id": chunk_id, "object": "chat.completion.chunk", "created": 1, "model": "m",
                                  "choices": [{"index": index, "delta": delta, "finish_reason": None}]})


def test_completion_is_mended_to_the_schema():
    mended = completion(json.loads(json.dumps(SGLANG_COMPLETION)))
    assert_valid(mended, "CreateChatCompletionResponse")
    assert mended["choices"][0]["message"]["refusal"] is None
    assert "completion_tokens_details" not in mended["usage"]


def test_stream_ids_are_unified_and_usage_mended():
    shaper = StreamShaper()
    first = chunk("aaa", 0, role="assistant", content="")
    assert shaper.line(first) == first  # untouched, byte for byte
    other = json.loads(shaper.line(chunk("bbb", 1, content="x"))[6:])
    assert other["id"] == "aaa" and other["choices"][0]["index"] == 1
    usage = 'data: {"id":"bbb","object":"chat.completion.chunk","created":1,"model":"m","choices":[],' \
            '"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3,"completion_tokens_details":null}}'
    mended = json.loads(shaper.line(usage)[6:])
    assert mended["id"] == "aaa" and "completion_tokens_details" not in mended["usage"]
    assert_valid(mended, "CreateChatCompletionStreamResponse")
    assert shaper.line("data: [DONE]") == "data: [DONE]"
    error = 'data: {"error":{"message":"x","type":"t","param":null,"code":null}}'
    assert shaper.line(error) == error
