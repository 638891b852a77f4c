"""The OpenAI chat-completions request, as far as the gateway needs to understand it.

Top-level sampling parameters are validated with pydantic; every other field passes
through to the worker untouched. Message contents are walked by hand
(:func:`iter_content_parts`) because the gateway rewrites every image part and wants
error messages that name the exact offending part.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import InvalidRequest

ROLES = ("system", "developer", "user", "assistant", "tool")
SUPPORTED_PART_TYPES = ("text", "image_url")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


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


@dataclass(frozen=True, slots=True)
class ImagePartRef:
    """Where one image part sits in the body, and the URL it carries."""

    message_index: int
    part_index: int
    url: str

    @property
    def param(self) -> str:
        return f"messages[{self.message_index}].content[{self.part_index}].image_url"


def parse_body(raw: bytes) -> tuple[dict[str, Any], ChatCompletionParams]:
    """Decode and validate a request body; raise :class:`InvalidRequest` with a precise message."""
    try:
        body = orjson.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        params = ChatCompletionParams.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise InvalidRequest(f"{param}: {first['msg']}" if param else first["msg"], param=param) from exc
    if params.stream_options is not None and not params.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    if isinstance(params.stop, list) and len(params.stop) > 4:
        raise InvalidRequest("stop accepts at most 4 sequences", param="stop")
    return body, params


def iter_image_parts(messages: list[dict[str, Any]]) -> Iterator[ImagePartRef]:
    """Validate every message and yield its image parts in order."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}",
                param=f"messages[{i}].role",
            )
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


def _check_part(i: int, j: int, role: str, part: Any) -> Iterator[ImagePartRef]:
    where = f"messages[{i}].content[{j}]"
    if not isinstance(part, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = part.get("type")
    if kind not in SUPPORTED_PART_TYPES:
        raise InvalidRequest(
            f"{where}.type {kind!r} is not supported; use one of {', '.join(SUPPORTED_PART_TYPES)}",
            param=f"{where}.type",
        )
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.text must be a string", param=f"{where}.text")
        return
    if role != "user":
        raise InvalidRequest(f"{where}: images are only allowed in user messages", param=where)
    image_url = part.get("image_url")
    if not isinstance(image_url, dict):
        raise InvalidRequest(
            f"{where}.image_url must be an object like {{\"url\": \"data:image/png;base64,...\"}}, "
            f"not a {type(image_url).__name__}",
            param=f"{where}.image_url",
        )
    url = image_url.get("url")
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}.image_url.url must be a non-empty string", param=f"{where}.image_url.url")
    detail = image_url.get("detail")
    if detail is not None and detail not in ("auto", "low", "high"):
        raise InvalidRequest(f"{where}.image_url.detail must be auto, low or high", param=f"{where}.image_url.detail")
    yield ImagePartRef(message_index=i, part_index=j, url=url)

