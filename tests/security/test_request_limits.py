"""Limits on what one request may ask of the gateway and of the workers every tenant shares.

Before them: a body nested 300 deep (in tools, logit_bias, response_format, a message) parsed, then crashed the
encoder on its way to the worker (orjson.dumps stops at 255 levels): a 500. 16 MB of ``[{},{},...]`` took ~500 MB
and half a second of parsing with the GIL held. ``custom_logit_processor`` (code the worker deserialises and runs),
``custom_params`` and ``priority`` (ahead of every other tenant in the worker's queue) passed to the workers, and
grammars of any size went to the worker to compile.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig, TenantSettings
from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.json_body import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, MAX_JSON_VALUES, decode_json
from gateway.protocol import (
    GATEWAY_OWNED,
    MAX_GRAMMAR_CHARS,
    REFUSED_FOR_SAFETY,
    WORKER_FIELDS,
    parse_body,
    parse_completion_body,
)

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}
SIXTEEN_MB = 16 * 1024 * 1024


def nest(levels: int) -> Any:
    """A JSON value ``levels`` deep of its own ({} is 1), objects and arrays by turns."""
    value: Any = {}
    for i in range(levels - 1):
        value = {"a": value} if i % 2 else [value]
    return value


def body_with(field: str, value: Any, base: dict[str, Any] = CHAT) -> bytes:
    return json.dumps({**base, field: value}).encode()


def many_empty_objects(field: str, size: int = SIXTEEN_MB) -> bytes:
    """A chat body of about ``size`` bytes whose ``field`` is [{},{},...]."""
    head = json.dumps(CHAT)[:-1].encode() + f', "{field}": ['.encode()
    count = (size - len(head)) // 3
    return head + b"{}," * (count - 1) + b"{}]}"


def error_of(parse, raw: bytes, kind: type[Exception] = InvalidRequest):
    with pytest.raises(kind) as raised:
        parse(raw)
    return raised.value


@pytest.fixture(scope="module")
def client():
    """A real gateway app in process. No worker listens at its worker's address: a request intake lets through
    answers 503, so a 4xx with the expected code is the gateway refusing it."""
    app = create_app(GatewayConfig(model="m", workers=("http://127.0.0.1:9",), tenants=TenantSettings.open()))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def post(client: TestClient, raw: bytes, path: str = "/v1/chat/completions") -> tuple[int, dict[str, Any]]:
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    return response.status_code, response.json()["error"]


# --- nesting depth ---

DEEP_FIELDS = {
    "tools": lambda value: body_with("tools", [{"type": "function", "function": {"name": "f", "parameters": value}}]),
    "logit_bias": lambda value: body_with("logit_bias", value),
    "response_format": lambda value: body_with("response_format", {"type": "json_schema",
                                                                   "json_schema": {"name": "s", "schema": value}}),
    "message content": lambda value: body_with("messages", [{"role": "user", "content": [value]}]),
}


@pytest.mark.parametrize("field", DEEP_FIELDS)
def test_a_body_nested_300_deep_is_refused_by_the_parser(field):
    error = error_of(parse_body, DEEP_FIELDS[field](nest(300)))
    assert error.status_code == 400 and error.code == "json_too_deep" and str(MAX_JSON_DEPTH) in error.message


def test_a_completion_body_nested_300_deep_is_refused_by_the_parser():
    error = error_of(lambda raw: parse_completion_body(raw, None), body_with("logit_bias", nest(300), TEXT))
    assert error.code == "json_too_deep"


@pytest.mark.parametrize("parse", [parse_body, lambda raw: parse_completion_body(raw, None)])
def test_nesting_past_the_parsers_own_limit_is_the_same_clean_400(parse):
    """The parser gives up past ~1000 levels itself (a RecursionError): that is a depth error too, not a 'not valid
    JSON' nor a 500."""
    raw = b'{"model": "m", "logit_bias": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    error = error_of(parse, raw)
    assert error.status_code == 400 and error.code == "json_too_deep"


def test_the_depth_limit_is_exact():
    """The body itself is level 1: a field's value of 31 levels makes 32, accepted; 32 levels makes 33."""
    for field in ("logit_bias", "tools", "chat_template_kwargs"):
        parse_body(body_with(field, nest(MAX_JSON_DEPTH - 1)))
        assert error_of(parse_body, body_with(field, nest(MAX_JSON_DEPTH))).code == "json_too_deep"
    parse_completion_body(body_with("logit_bias", nest(MAX_JSON_DEPTH - 1), TEXT))
    assert decode_json(json.dumps(nest(MAX_JSON_DEPTH)).encode()) == nest(MAX_JSON_DEPTH)
    assert error_of(decode_json, json.dumps(nest(MAX_JSON_DEPTH + 1)).encode()).code == "json_too_deep"


def test_a_real_request_with_a_deep_tool_schema_passes():
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(8):  # objects of arrays of objects, 8 times over: 25 levels of JSON, 29 in the body
        schema = {"type": "object", "properties": {"items": {"type": "array", "items": schema}}}
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": schema}}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "auto"}}
    parse_body(body_with("messages", [{"role": "user", "content": [{"type": "text", "text": "{[" * 1000}, image]}],
                         {**CHAT, "tools": [tool], "tool_choice": "auto"}))


@pytest.mark.parametrize("field", ["tools", "logit_bias"])
def test_a_body_nested_300_deep_is_a_400_from_the_app_not_a_500(client, field):
    status, error = post(client, DEEP_FIELDS[field](nest(300)))
    assert (status, error["code"]) == (400, "json_too_deep"), error
    status, error = post(client, body_with(field, nest(300), TEXT), "/v1/completions")
    assert (status, error["code"]) == (400, "json_too_deep"), error


def test_nesting_past_the_parsers_limit_is_a_400_from_the_app(client):
    status, error = post(client, b'{"model": "m", "tools": ' + b"[" * 2000 + b"]" * 2000 + b"}")
    assert (status, error["code"]) == (400, "json_too_deep"), error


# --- what the values may be: as orjson, which encodes the body for the worker, reads them ---

@pytest.mark.parametrize("raw", [b'{"model": "m", "temperature": NaN}', b'{"model": "m", "temperature": Infinity}',
                                 b'{"model": "m", "temperature": -Infinity}', b'{"model": "m", "logit_bias": [1e400]}',
                                 b'{"model": "m", "user": "\\ud800"}', b'{"model": "m", "logit_bias": {"\\udc00": 1}}',
                                 b'{"model": "m", "user": "\xff"}'])
def test_values_orjson_refuses_are_refused_by_the_parser_too(raw):
    """NaN, Infinity, a number past a double's range, a lone surrogate (orjson.dumps cannot encode one for the
    worker: that was a 500 waiting) and bytes that are not UTF-8: a 400 that says what, not a 500 later."""
    error = error_of(decode_json, raw)
    assert error.status_code == 400 and "not valid" in error.message, error.message


def test_values_are_read_as_orjson_reads_them():
    body = decode_json(b'{"a": [18446744073709551615, 18446744073709551616, -9223372036854775809, true, null], '
                       b'"b": 99999999999999999999, "c": "\\ud83d\\ude00", "d": [0.5, null, 1e308], "d": 1}')
    assert body == orjson.loads(b'{"a": [18446744073709551615, 18446744073709551616, -9223372036854775809, true, '
                                b'null], "b": 99999999999999999999, "c": "\\ud83d\\ude00", "d": 1}')
    assert type(body["a"][1]) is float and type(body["a"][0]) is int and body["c"] == "\N{GRINNING FACE}"


def test_a_parse_error_keeps_nothing_of_the_body():
    """The parser's exception holds the whole document: 50 MB that is not JSON held 50 MB more for as long as the
    400 was being answered."""
    error = error_of(decode_json, b"x" * 1000)
    assert error.__cause__ is None and error.__context__ is None


# --- how many objects and arrays ---

def test_sixteen_mb_of_empty_objects_is_refused_before_parsing():
    for field in ("tools", "logit_bias", "messages"):
        raw = many_empty_objects(field)
        started = time.perf_counter()
        error = error_of(parse_body, raw, PayloadTooLarge)
        assert time.perf_counter() - started < 1.0  # two counts of bytes at C speed, no parse (~20 ms here)
        assert error.status_code == 413 and error.code == "too_many_json_values"
        assert f"{MAX_JSON_CONTAINERS}" in error.message
    raw = b'{"model": "m", "prompt": [' + b"[]," * 200_000 + b"[]]}"
    assert error_of(lambda raw: parse_completion_body(raw, 10), raw, PayloadTooLarge).code == "too_many_json_values"


def test_the_container_limit_is_exact():
    at_limit = b"[" + b"{}," * (MAX_JSON_CONTAINERS - 2) + b"{}]"
    assert len(decode_json(at_limit)) == MAX_JSON_CONTAINERS - 1
    over = b"[" + b"{}," * (MAX_JSON_CONTAINERS - 1) + b"{}]"
    assert error_of(decode_json, over, PayloadTooLarge).code == "too_many_json_values"


# --- how many values ---

def many_small_values(item: bytes, size: int = SIXTEEN_MB) -> bytes:
    """A chat body of about ``size`` bytes whose ``stop_token_ids`` is [item,item,...]."""
    head = json.dumps(CHAT)[:-1].encode() + b', "stop_token_ids": ['
    return head + b",".join([item] * ((size - len(head)) // (len(item) + 1))) + b"]}"


@pytest.mark.parametrize("item", [b"0.1", b'"ab"', b"1234567", b"null"])
def test_sixteen_mb_of_small_values_is_refused_before_parsing(item):
    """No containers past the limit, but each small value parsed costs 8-15x the bytes it was sent in: 16 MB of
    [0.1,...] took 124 MiB and ["ab",...] 181 MiB (a 64 MiB body four times that), and seconds of parsing."""
    raw = many_small_values(item)
    started = time.perf_counter()
    error = error_of(parse_body, raw, PayloadTooLarge)
    assert time.perf_counter() - started < 1.0  # three counts of bytes at C speed (~30 ms here), no parse
    assert error.status_code == 413 and error.code == "too_many_json_values"
    assert f"{MAX_JSON_VALUES}" in error.message and "commas" in error.message


def test_the_value_limit_is_exact_and_leaves_room_for_token_ids():
    at_limit = b"[" + b"0," * (MAX_JSON_VALUES - 1) + b"0]"  # one container, MAX_JSON_VALUES - 1 commas
    assert len(decode_json(at_limit)) == MAX_JSON_VALUES
    over = b"[" + b"0," * MAX_JSON_VALUES + b"0]"
    assert error_of(decode_json, over, PayloadTooLarge).code == "too_many_json_values"
    # A /v1/completions prompt of 128K token ids (a long context's worth) is read.
    body = json.dumps({"model": "m", "prompt": [11] * (128 * 1024)}).encode()
    assert len(parse_completion_body(body, 1000)[0]["prompt"]) == 128 * 1024


_SIXTEEN_MB_THROUGH_THE_APP = """
import json, resource, sys, time
from fastapi.testclient import TestClient
from gateway.app import create_app
from gateway.config import GatewayConfig, TenantSettings
from tests.security.test_request_limits import many_empty_objects

app = create_app(GatewayConfig(model="m", workers=("http://127.0.0.1:9",), tenants=TenantSettings.open()))
with TestClient(app, raise_server_exceptions=False) as client:
    client.post("/v1/chat/completions", content=b"{}")  # warm up: imports, first request
    raw = many_empty_objects("tools")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    seconds = time.perf_counter() - started
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"status": response.status_code, "error": response.json()["error"], "seconds": seconds,
                  "grown_mib": grown_kib / 1024}))
"""


def test_sixteen_mb_of_empty_objects_is_a_quick_413_from_the_app_in_little_memory():
    """Through a real app, in a process of its own so that the peak memory it reports is this request's alone
    (ru_maxrss is the process's peak so far: in this one, any earlier test's peak could hide it). Before the limit
    the peak grew by ~490 MB (parsing 5.6 million dicts), and the request reached the (absent) worker."""
    done = subprocess.run([sys.executable, "-c", _SIXTEEN_MB_THROUGH_THE_APP], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["status"], result["error"]["code"]) == (413, "too_many_json_values"), result
    assert result["grown_mib"] < 100, result
    assert result["seconds"] < 5, result  # ~0.1 s here: reading 16 MB and counting brackets


# --- fields refused for the other tenants' and the workers' sake ---

@pytest.mark.parametrize("name, value", [("custom_logit_processor", '{"callable": "gASV..."}'),
                                         ("custom_params", {"x": 1}), ("priority", 100)])
def test_fields_that_reach_into_the_shared_workers_are_refused(name, value):
    for parse, base in ((parse_body, CHAT), (lambda raw: parse_completion_body(raw, None), TEXT)):
        error = error_of(parse, body_with(name, value, base))
        assert error.status_code == 400 and error.param == name and error.message.startswith(name)
        assert "not accepted through the gateway" in error.message


def test_refused_fields_are_sglangs_and_nowhere_else():
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    for endpoint, model in (("chat", ChatCompletionRequest), ("text", CompletionRequest)):
        assert REFUSED_FOR_SAFETY.keys() <= set(model.model_fields)
        assert not REFUSED_FOR_SAFETY.keys() & (WORKER_FIELDS[endpoint] | GATEWAY_OWNED)


def test_priority_is_refused_by_the_app(client):
    status, error = post(client, body_with("priority", -1000))
    assert (status, error["param"], error["code"]) == (400, "priority", "unsupported_parameter"), error


# --- grammar sizes ---

def test_a_long_regex_is_refused_and_a_short_one_passes():
    error = error_of(parse_body, body_with("regex", "a" * 20_000))
    assert error.status_code == 400 and error.code == "grammar_too_large" and error.param == "regex"
    assert "regex" in error.message and str(MAX_GRAMMAR_CHARS) in error.message
    body, _ = parse_body(body_with("regex", "[a-z]{1,9}" * 10))
    assert body["regex"] == "[a-z]{1,9}" * 10


def test_the_grammar_limit_is_exact():
    parse_body(body_with("ebnf", "x" * MAX_GRAMMAR_CHARS))
    assert error_of(parse_body, body_with("ebnf", "x" * (MAX_GRAMMAR_CHARS + 1))).code == "grammar_too_large"


def test_every_grammar_field_is_bounded():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    text = lambda raw: parse_completion_body(raw, None)  # noqa: E731
    for parse, name, value in (
        (parse_body, "ebnf", 'root ::= "' + "a" * 20_000 + '"'),
        (parse_body, "stop_regex", ["b" * 9000, "c" * 9000]),  # together: each is compiled
        (parse_body, "response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}),
        (text, "json_schema", json.dumps(schema)),
        (text, "regex", "d" * 20_000),
        (text, "response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}),
    ):
        base = CHAT if parse is parse_body else TEXT
        error = error_of(parse, body_with(name, value, base))
        assert (error.code, error.param) == ("grammar_too_large", name), error.message
    small = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
    parse_body(body_with("response_format", small))
    parse_body(body_with("stop_regex", ["b+", "c+"]))
    text(body_with("json_schema", json.dumps({"type": "object"}), TEXT))
