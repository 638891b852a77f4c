"""Request intake: validate a chat request, resolve and canonicalise its images.

The result, :class:`IntakeResult`, carries the body to send upstream (every image
replaced by its canonical lossless pixels, so the worker computes KV for exactly the
pixels the key names) and the images in prompt order with their keys and token grids.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewayConfig
from gateway.errors import ClientError, InvalidRequest, ModelNotFound
from gateway.image_fetch import ImageFetcher
from gateway.image_memo import CanonicalMemo
from gateway.images import CanonicalImage, canonicalize
from gateway.matching.features import Extractor
from gateway.offload import off_loop
from gateway.protocol import ChatCompletionParams, ImagePartRef, iter_image_parts, parse_body


@dataclass(frozen=True, slots=True)
class IntakeResult:
    upstream_body: dict[str, Any]
    params: ChatCompletionParams
    images: tuple[CanonicalImage, ...]
    namespace: str
    # Per image: a digest of everything the prompt holds before it (see prefix_digests).
    prefix_digests: tuple[str, ...] = ()


class Intake:
    def __init__(self, config: GatewayConfig, fetcher: ImageFetcher, extractor: Extractor | None = None):
        self._config = config
        self._fetcher = fetcher
        self._extractor = extractor  # with one, every new image gets per-token features (approximate matching)
        self.memo = CanonicalMemo(config.image_memo_bytes)

    async def process(self, raw: bytes, *, namespace: str) -> IntakeResult:
        body, params = await off_loop(len(raw), parse_body, raw)
        if params.model != self._config.model:
            raise ModelNotFound(params.model)
        refs = list(iter_image_parts(body["messages"]))
        limit = self._config.images.max_images_per_request
        if len(refs) > limit:
            raise InvalidRequest(
                f"request has {len(refs)} images; at most {limit} are allowed per request",
                param="messages",
                code="too_many_images",
            )
        images = await asyncio.gather(*(self._resolve(ref, namespace) for ref in refs))
        payload_bytes = sum(len(image.payload) for ref, image in zip(refs, images, strict=True)
                            if _needs_rewrite(ref, image))
        return IntakeResult(
            upstream_body=await off_loop(payload_bytes, _rewrite_images, body, refs, images),
            params=params,
            images=tuple(images),
            namespace=namespace,
            prefix_digests=prefix_digests(body, refs, images),
        )

    async def _resolve(self, ref: ImagePartRef, namespace: str) -> CanonicalImage:
        if not ref.url:  # named by its uuid alone
            named = self.memo.named(namespace, ref.uuid or "")
            if named is None:
                raise InvalidRequest(f"{ref.param}: no image named {ref.uuid!r} is known here; send it with its url "
                                     "(images are remembered by name for as long as the gateway keeps them)",
                                     param=ref.param.removesuffix(".image_url") + ".uuid", code="unknown_image_uuid")
            return named
        data = await self._fetcher.fetch(ref.url, param=ref.param)
        digest = await off_loop(len(data), CanonicalMemo.digest, data)
        if ref.uuid is not None:
            self.memo.name(namespace, ref.uuid, digest)
        if (known := self.memo.get(namespace, digest)) is not None:
            return known
        try:
            image = await asyncio.to_thread(
                canonicalize,
                data,
                limits=self._config.images,
                processor=self._config.processor,
                model=self._config.model,
                namespace=namespace,
                extractor=self._extractor,
            )
        except ClientError as exc:
            exc.message = f"{ref.param}: {exc.message}"
            exc.param = exc.param or ref.param
            exc.args = (exc.message,)
            raise
        self.memo.put(namespace, digest, image)
        return image


# Top-level fields that the chat template renders before the messages (a tool list goes into the system turn).
_TEMPLATE_FIELDS = ("model", "tools", "tool_choice", "chat_template_kwargs")


def prefix_digests(body: dict[str, Any], refs: list[ImagePartRef], images: list[CanonicalImage]) -> tuple[str, ...]:
    """For each image, a digest of everything before it in the prompt: the template fields, the earlier messages
    and the parts of its own message before it, with earlier images named by their exact keys.

    Equal digests mean equal token prefixes (the chat template is deterministic), so the image sits at the same
    positions after the same context: its cached KV can be reused as is. Any difference, even one that would not
    change the tokens, only makes the planner choose the position-independent plan, which is also correct.
    """
    if not refs:
        return ()
    keys = {(ref.message_index, ref.part_index): image.key for ref, image in zip(refs, images, strict=True)}
    head = {name: body[name] for name in _TEMPLATE_FIELDS if name in body}
    digests = []
    for ref in refs:
        messages = []
        for i, message in enumerate(body["messages"][: ref.message_index + 1]):
            content = message.get("content")
            if isinstance(content, list):
                stop = ref.part_index if i == ref.message_index else len(content)
                content = [{"type": "image", "key": keys[(i, j)]} if (i, j) in keys else part
                           for j, part in enumerate(content[:stop])]
            messages.append({**message, "content": content})
        blob = json.dumps({"head": head, "messages": messages}, sort_keys=True, separators=(",", ":"))
        digests.append(hashlib.blake2b(blob.encode(), digest_size=16).hexdigest())
    return tuple(digests)


def _rewrite_images(
    body: dict[str, Any], refs: list[ImagePartRef], images: list[CanonicalImage]
) -> dict[str, Any]:
    if not refs:
        return body
    upstream = dict(body)
    upstream["messages"] = copy.deepcopy(body["messages"])
    for ref, image in zip(refs, images, strict=True):
        if _needs_rewrite(ref, image):
            part = upstream["messages"][ref.message_index]["content"][ref.part_index]
            part["image_url"] = {**(part.get("image_url") or {}), "url": image.data_url}
    return upstream


def _needs_rewrite(ref: ImagePartRef, image: CanonicalImage) -> bool:
    """Whether the worker must get other bytes than the client's URL holds: fetched images, and any image that is
    not forwarded as uploaded. A data: URL of bytes forwarded as they came stays as it is, sparing a base64 encode
    of megabytes (it holds the GIL, and so the event loop, for ~35 ms per 20 MB)."""
    if not (image.as_uploaded and ref.url.startswith("data:")):
        return True  # fetched, re-encoded, or named by its uuid alone
    encoded = ref.url.partition(",")[2]
    return encoded != encoded.strip()  # the gateway tolerates surrounding whitespace; SGLang's strict decode does not
