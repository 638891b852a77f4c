"""The OpenAI chat-completions request, as far as the gateway needs to understand it.

The body's JSON is bounded in how many objects and arrays it holds and how deep they nest before anything else
reads it (gateway/json_body.py). Top-level sampling parameters are validated with pydantic; the other fields the
workers honour pass through to them untouched (grammars up to a size), and any other field is refused by name
(:func:`check_fields`). Message contents are walked by hand (:func:`iter_media_parts`) because the gateway
rewrites every image part and wants error messages that name the exact offending part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import InvalidRequest
from gateway.json_body import decode_json

ROLES = ("system", "developer", "user", "assistant", "tool")
# A message's fields as SGLang reads them (ChatCompletionMessageUserParam for user messages, the generic one for the
# others; tests/gateway/test_protocol.py compares them with the installed SGLang's). Any other field, which SGLang
# would drop without a word (a user message's name), is refused by name.
MESSAGE_FIELDS = {
    "user": frozenset({"role", "content"}),
    "other": frozenset({"role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content", "phase",
                        "prefix", "tools"}),
}
P = TypeVar("P", "ChatCompletionParams", "CompletionParams")
# What refuses a body from its raw bytes once its JSON's counts pass, before it is parsed (gateway/json_body.py).
Unparsed = Callable[[bytes | bytearray], None] | None
SUPPORTED_PART_TYPES = ("text", "image_url", "video_url")
IMAGE_URL_FIELDS = ("url", "detail")  # detail passes to the worker, which reads it as OpenAI's "auto"
VIDEO_URL_FIELDS = ("url",)
# A part's own fields. vLLM's uuid names an image for its media cache: sent with the image's url, it names that
# image within the caller's namespace (the gateway still keys the image by its content); sent alone (image_url null
# or without a url), it stands for the image it named (gateway/image_memo.py). It passes to the worker, which ignores
# it.
# SGLang's own `modalities` of an image part (its vision tests send "multi-images") passes to the worker too: the
# Qwen-VL processors never read it (it picks LLaVA's anyres tiling), so no value of it changes the grid planned here.
PART_FIELDS = {"text": ("type", "text"), "image_url": ("type", "image_url", "uuid", "modalities"),
               "video_url": ("type", "video_url")}
IMAGE_MODALITIES = ("image", "multi-images", "video")
MAX_UUID_CHARS = 256

# --- top-level request fields: honoured by the workers, owned by the gateway, or refused ---

# What SGLang's request models read (sglang.srt.entrypoints.openai.protocol ChatCompletionRequest and
# CompletionRequest; tests/gateway/test_protocol.py compares these with the installed SGLang's). Forwarded as sent,
# except the ones below. SGLang ignores a field it does not know, so the gateway refuses every other field: a client
# never believes a setting of its took effect when none did.
_SGLANG_SAMPLING = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
    "seed", "logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "user",
    "min_tokens", "stop_token_ids", "stop_regex", "no_stop_trim", "ignore_eos", "skip_special_tokens", "regex",
    "ebnf", "response_format", "lora_path", "session_id", "session_params", "cache_salt", "watermark",
    "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "return_cached_tokens_details", "return_spec_tokens_details", "return_token_ids",
})
WORKER_FIELDS = {
    "chat": _SGLANG_SAMPLING | {
        "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
        "chat_template_kwargs", "continue_final_message", "reasoning_effort", "thinking", "task",
        "separate_reasoning", "stream_reasoning", "return_flat_raw_output_top_logprobs",
        "return_flat_raw_top_logprobs_b64", "return_input_ids_in_sglext", "return_meta_info",
        "return_output_ids_in_sglext", "return_prompt_token_ids", "return_sampling_mask", "sampling_logprobs_mode"},
    "text": _SGLANG_SAMPLING | {"prompt", "best_of", "echo", "suffix", "json_schema", "custom_labels"},
}
# Fields SGLang reads that a client may not set through the gateway: its request id and cache scope (they carry the
# reuse plan and the tenant's namespace), token ids in place of messages (the plan is made from the messages),
# image and video processing options (the gateway computed each image's token grid with the model's own), and
# routing across a disaggregated deployment (an operator's, not a client's).
GATEWAY_OWNED = frozenset({
    "rid", "extra_key", "input_ids", "images_config", "mm_processor_kwargs", "max_dynamic_patch",
    "min_dynamic_patch", "video_config", "use_audio_in_video", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",
})
# Fields SGLang reads that reach past the client's own request into the shared workers, refused with the reason.
REFUSED_FOR_SAFETY = {
    "custom_logit_processor": "it is code the worker would deserialise and run (code execution in a worker every "
                              "tenant shares)",
    "custom_params": "it is read only by a custom_logit_processor, which is not accepted either",
    "priority": "it would move the request ahead of other tenants' in the worker's queue; scheduling is the "
                "operator's",
}
# Fields SGLang compiles into a grammar (regex, EBNF, JSON schema, structural tag), whose time and memory in the
# worker grow with its size: each is limited to this many characters (its JSON encoding when not a string).
GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema", "stop_regex", "response_format")
MAX_GRAMMAR_CHARS = 16_384
# OpenAI fields the workers do not honour, accepted only with the value that asks for nothing.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "store": (False, None), "service_tier": ("auto", "default", None), "modalities": (["text"], None),
    "metadata": (None, {}), "prediction": (None,), "audio": (None,), "web_search_options": (None,),
    "functions": (None, []), "function_call": (None, "none", "auto"),
}
# Fields other servers read (vLLM's extensions) with what to use here instead, for the refusal's message.
INSTEAD = {
    "use_beam_search": "beam search is not served here; use n with sampling",
    "guided_json": "use response_format with a json_schema", "guided_regex": "use regex",
    "guided_grammar": "use ebnf", "guided_choice": "use regex", "structured_outputs": "use response_format or regex",
    "include_stop_str_in_output": "use no_stop_trim", "add_generation_prompt": "use continue_final_message",
    "request_id": "the gateway names each request itself",
}


def check_fields(body: dict[str, Any], endpoint: str) -> None:
    """Refuse, naming it, the first top-level field of body the workers would not honour (see WORKER_FIELDS), and
    any grammar longer than MAX_GRAMMAR_CHARS."""
    honoured = WORKER_FIELDS[endpoint]
    for name, value in body.items():
        if name in GATEWAY_OWNED:
            raise InvalidRequest(f"{name} is set by the gateway, not by clients", param=name,
                                 code="unsupported_parameter")
        if name in REFUSED_FOR_SAFETY:
            raise InvalidRequest(f"{name} is not accepted through the gateway: {REFUSED_FOR_SAFETY[name]}",
                                 param=name, code="unsupported_parameter")
        if name in GRAMMAR_FIELDS and name in honoured and value is not None:
            _check_grammar(name, value)
        if name in honoured:
            continue
        if name in NO_OP_VALUES and endpoint == "chat":
            if value in NO_OP_VALUES[name]:
                continue
            raise InvalidRequest(f"{name}={json_preview(value)} is not supported by this server; leave it out",
                                 param=name, code="unsupported_parameter")
        hint = f" ({INSTEAD[name]})" if name in INSTEAD else ""
        raise InvalidRequest(f"{name} is not a parameter this server honours{hint}", param=name,
                             code="unsupported_parameter")


def _check_grammar(name: str, value: Any) -> None:
    size = len(value) if isinstance(value, str) else len(orjson.dumps(value).decode())
    if size > MAX_GRAMMAR_CHARS:
        what = "characters" if isinstance(value, str) else "characters of JSON"
        raise InvalidRequest(f"{name} is {size} {what}; grammars are limited to {MAX_GRAMMAR_CHARS}", param=name,
                             code="grammar_too_large")


def json_preview(value: Any) -> str:
    text = orjson.dumps(value).decode() if value is not None else "null"
    return text if len(text) <= 40 else text[:37] + "..."


class StreamOptions(BaseModel):
    """What SGLang reads of stream_options (its StreamOptions); any other option is refused by name."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatCompletionParams(BaseModel):
    """Validated top-level fields; the raw body keeps everything else."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionParams(BaseModel):
    """/v1/completions (text only): validated top-level fields; the raw body keeps everything else."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    @property
    def prompts(self) -> int:
        """How many prompts the request holds (a list of strings or of token lists is a batch)."""
        prompt = self.prompt
        return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1


@dataclass(frozen=True, slots=True)
class ImagePartRef:
    """Where one image part sits in the body, and the URL it carries."""

    message_index: int
    part_index: int
    url: str  # "" for an image named by its uuid alone
    uuid: str | None = None  # vLLM's media uuid: the client's own name for the image, within its namespace

    @property
    def param(self) -> str:
        return f"messages[{self.message_index}].content[{self.part_index}].image_url"


@dataclass(frozen=True, slots=True)
class VideoPartRef:
    """Where one video part sits in the body, and the URL it carries."""

    message_index: int
    part_index: int
    url: str

    @property
    def param(self) -> str:
        return f"messages[{self.message_index}].content[{self.part_index}].video_url"


MediaPartRef = ImagePartRef | VideoPartRef


def parse_body(raw: bytes | bytearray, unparsed: Unparsed = None) -> tuple[dict[str, Any], ChatCompletionParams]:
    """Decode and validate a chat request body; raise :class:`InvalidRequest` with a precise message. ``unparsed``:
    what may refuse it from its bytes first (gateway/json_body.py decode_json)."""
    body, params = _parse(raw, ChatCompletionParams, unparsed)
    check_fields(body, "chat")
    return body, params


def parse_completion_body(raw: bytes | bytearray, vocab_size: int | None = None,
                          unparsed: Unparsed = None) -> tuple[dict[str, Any], CompletionParams]:
    """Decode and validate a /v1/completions body, as parse_body does a chat one. Token-id prompts must name ids
    of the model's vocabulary (``vocab_size``): SGLang takes any id, and one past the embedding crashes the
    worker's scheduler (and, retried, the next worker's)."""
    body, params = _parse(raw, CompletionParams, unparsed)
    check_fields(body, "text")
    if params.prompt == "" or params.prompt == []:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if isinstance(params.prompt, list) and any(isinstance(item, list) and not item for item in params.prompt):
        raise InvalidRequest("prompt holds an empty list of token ids", param="prompt")
    ids = _token_ids(params.prompt)
    if ids:
        if vocab_size is None:
            raise InvalidRequest("prompts of token ids are accepted only where the gateway knows the model's "
                                 "vocabulary (REVISIT_MODEL_DIR); send text", param="prompt",
                                 code="unsupported_parameter")
        if (bad := next((i for i in ids if not 0 <= i < vocab_size), None)) is not None:
            raise InvalidRequest(f"prompt holds token id {bad}; ids must be in [0, {vocab_size})", param="prompt",
                                 code="invalid_token_id")
    return body, params


def _token_ids(prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
    if isinstance(prompt, str):
        return []
    return [i for item in prompt for i in (item if isinstance(item, list) else [item] if isinstance(item, int)
                                           else [])]


def _parse(raw: bytes | bytearray, model: type[P], unparsed: Unparsed) -> tuple[dict[str, Any], P]:
    body = decode_json(raw, unparsed)
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        params = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise InvalidRequest(f"{param}: {first['msg']}" if param else first["msg"], param=param) from exc
    if params.stream_options is not None and not params.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    if isinstance(params.stop, list) and len(params.stop) > 4:
        raise InvalidRequest("stop accepts at most 4 sequences", param="stop")
    return body, params


def iter_media_parts(messages: list[dict[str, Any]]) -> Iterator[MediaPartRef]:
    """Validate every message and yield its image and video parts in order."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}",
                param=f"messages[{i}].role",
            )
        for name in message:
            if name not in MESSAGE_FIELDS["user" if role == "user" else "other"]:
                raise InvalidRequest(f"messages[{i}].{name} is not a field this server honours in a {role} message",
                                     param=f"messages[{i}].{name}", code="unsupported_parameter")
        content = message.get("content")
        if content is None:
            if role == "assistant":
                continue
            raise InvalidRequest(f"messages[{i}].content is required", param=f"messages[{i}].content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or an array of content parts",
                param=f"messages[{i}].content",
            )
        for j, part in enumerate(content):
            yield from _check_part(i, j, role, part)


def _check_part(i: int, j: int, role: str, part: Any) -> Iterator[MediaPartRef]:
    where = f"messages[{i}].content[{j}]"
    if not isinstance(part, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = part.get("type")
    if kind not in SUPPORTED_PART_TYPES:
        raise InvalidRequest(
            f"{where}.type {kind!r} is not supported; use one of {', '.join(SUPPORTED_PART_TYPES)}",
            param=f"{where}.type",
        )
    for name in part:
        if name not in PART_FIELDS[kind]:
            raise InvalidRequest(f"{where}.{name} is not a field this server honours in a {kind} part",
                                 param=f"{where}.{name}", code="unsupported_parameter")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.text must be a string", param=f"{where}.text")
        return
    if role != "user":
        raise InvalidRequest(f"{where}: images and videos are only allowed in user messages", param=where)
    if kind == "video_url":
        yield _video_part(i, j, part)
        return
    modalities = part.get("modalities")
    if modalities is not None and modalities not in IMAGE_MODALITIES:
        raise InvalidRequest(f"{where}.modalities must be one of {', '.join(IMAGE_MODALITIES)}",
                             param=f"{where}.modalities")
    image_url = part.get("image_url")
    uuid = part.get("uuid")
    if uuid is not None and (not isinstance(uuid, str) or not 0 < len(uuid) <= MAX_UUID_CHARS):
        raise InvalidRequest(f"{where}.uuid must be a string of 1 to {MAX_UUID_CHARS} characters",
                             param=f"{where}.uuid")
    if uuid is not None and (image_url is None or (isinstance(image_url, dict) and not image_url.get("url"))):
        yield ImagePartRef(message_index=i, part_index=j, url="", uuid=uuid)  # served from the namespace's cache
        return
    if not isinstance(image_url, dict):
        raise InvalidRequest(
            f"{where}.image_url must be an object like {{\"url\": \"data:image/png;base64,...\"}}, "
            f"not a {type(image_url).__name__}",
            param=f"{where}.image_url",
        )
    url = image_url.get("url")
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}.image_url.url must be a non-empty string", param=f"{where}.image_url.url")
    for name in image_url:
        if name not in IMAGE_URL_FIELDS:
            owned = name in ("max_dynamic_patch", "min_dynamic_patch", "max_long_side_pixel", "content_hash")
            raise InvalidRequest(
                f"{where}.image_url.{name} " + ("is set by the gateway, which sizes and keys every image itself"
                                                if owned else "is not a field this server honours"),
                param=f"{where}.image_url.{name}", code="unsupported_parameter")
    detail = image_url.get("detail")
    if detail is not None and detail not in ("auto", "low", "high"):
        raise InvalidRequest(f"{where}.image_url.detail must be auto, low or high", param=f"{where}.image_url.detail")
    yield ImagePartRef(message_index=i, part_index=j, url=url, uuid=uuid)



def _video_part(i: int, j: int, part: dict[str, Any]) -> VideoPartRef:
    where = f"messages[{i}].content[{j}]"
    video_url = part.get("video_url")
    if not isinstance(video_url, dict):
        raise InvalidRequest(f"{where}.video_url must be an object like {{\"url\": \"data:video/mp4;base64,...\"}}, "
                             f"not a {type(video_url).__name__}", param=f"{where}.video_url")
    url = video_url.get("url")
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}.video_url.url must be a non-empty string", param=f"{where}.video_url.url")
    for name in video_url:
        if name not in VIDEO_URL_FIELDS:
            raise InvalidRequest(f"{where}.video_url.{name} is not a field this server honours (the gateway samples "
                                 "frames as the model's processor does)", param=f"{where}.video_url.{name}",
                                 code="unsupported_parameter")
    return VideoPartRef(message_index=i, part_index=j, url=url)
