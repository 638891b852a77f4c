"""Request intake: validate a chat request, resolve and canonicalise its images and videos.

The result, :class:`IntakeResult`, carries the body to send upstream (every image
replaced by its canonical lossless pixels, so the worker computes KV for exactly the
pixels the key names; every video as a data: URL of its bytes, so the worker fetches nothing) and the images in
prompt order with their keys and token grids, and the videos with the keys of their sampled frames.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.config import GatewayConfig
from gateway.errors import ClientError, InvalidRequest, ModelNotFound
from gateway.image_fetch import ImageFetcher
from gateway.image_memo import CanonicalMemo
from gateway.images import CanonicalImage, canonicalize
from gateway.matching.features import Extractor
from gateway.offload import off_loop
from gateway.protocol import (
    ChatCompletionParams,
    ImagePartRef,
    MediaPartRef,
    VideoPartRef,
    iter_media_parts,
    parse_body,
)
from gateway.videos import CanonicalVideo, open_video

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class IntakeResult:
    upstream_body: dict[str, Any]
    params: ChatCompletionParams
    images: tuple[CanonicalImage, ...]
    namespace: str
    # Per image: a digest of everything the prompt holds before it (see prefix_digests).
    prefix_digests: tuple[str, ...] = ()
    videos: tuple[CanonicalVideo, ...] = ()


class Intake:
    def __init__(self, config: GatewayConfig, fetcher: ImageFetcher, extractor: Extractor | None = None):
        self._config = config
        self._fetcher = fetcher
        self._extractor = extractor  # with one, every new image gets per-token features (approximate matching)
        self.memo: CanonicalMemo[CanonicalImage] = CanonicalMemo(config.image_memo_bytes)
        # Videos are remembered for their frame keys (decoding is what costs), within a quarter of that budget.
        self.video_memo: CanonicalMemo[CanonicalVideo] = CanonicalMemo(config.image_memo_bytes // 4)

    async def process(self, raw: bytes, *, namespace: str) -> IntakeResult:
        body, params = await off_loop(len(raw), parse_body, raw)
        if params.model != self._config.model:
            raise ModelNotFound(params.model)
        parts = list(iter_media_parts(body["messages"]))
        refs = [ref for ref in parts if isinstance(ref, ImagePartRef)]
        video_refs = [ref for ref in parts if isinstance(ref, VideoPartRef)]
        for count, limit, what in ((len(refs), self._config.images.max_images_per_request, "images"),
                                   (len(video_refs), self._config.videos.max_per_request, "videos")):
            if count > limit:
                raise InvalidRequest(f"request has {count} {what}; at most {limit} are allowed per request",
                                     param="messages", code=f"too_many_{what}")
        images, videos = await asyncio.gather(
            asyncio.gather(*(self._resolve(ref, namespace) for ref in refs)),
            asyncio.gather(*(self._resolve_video(ref, namespace) for ref in video_refs)))
        media: list[tuple[MediaPartRef, CanonicalImage | CanonicalVideo]] = [
            *zip(refs, images, strict=True), *zip(video_refs, videos, strict=True)]
        payload_bytes = sum(len(item.payload) for ref, item in media if _needs_rewrite(ref, item))
        return IntakeResult(
            upstream_body=await off_loop(payload_bytes, _rewrite_media, body, media),
            params=params,
            images=tuple(images),
            namespace=namespace,
            prefix_digests=prefix_digests(body, refs, images, media),
            videos=tuple(videos),
        )

    async def _resolve_video(self, ref: VideoPartRef, namespace: str) -> CanonicalVideo:
        settings = self._config.videos
        data = await self._fetcher.fetch(ref.url, param=ref.param, media="video", limit=settings.max_bytes)
        digest = await off_loop(len(data), CanonicalMemo.digest, data)
        if (known := self.video_memo.get(namespace, digest)) is not None:
            return known
        video = await _in_part(ref, open_video, data, settings=settings, processor=self._config.processor,
                               model=self._config.model, namespace=namespace)
        self.video_memo.put(namespace, digest, video)
        return video

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
        image = await _in_part(ref, canonicalize, data, limits=self._config.images, processor=self._config.processor,
                               model=self._config.model, namespace=namespace, extractor=self._extractor)
        self.memo.put(namespace, digest, image)
        return image


async def _in_part(ref: MediaPartRef, work: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``work`` on a thread; a client error it raises names the part (its message and param)."""
    try:
        return await asyncio.to_thread(work, *args, **kwargs)
    except ClientError as exc:
        exc.message = f"{ref.param}: {exc.message}"
        exc.param = exc.param or ref.param
        exc.args = (exc.message,)
        raise


# Top-level fields that the chat template renders before the messages (a tool list goes into the system turn).
_TEMPLATE_FIELDS = ("model", "tools", "tool_choice", "chat_template_kwargs")


def prefix_digests(body: dict[str, Any], refs: list[ImagePartRef], images: list[CanonicalImage],
                   media: list[tuple[MediaPartRef, CanonicalImage | CanonicalVideo]] | None = None) -> tuple[str, ...]:
    """For each image, a digest of everything before it in the prompt: the template fields, the earlier messages
    and the parts of its own message before it, with earlier images and videos named by their keys (``media``:
    every image and video part with what it resolved to; by default the images).

    Equal digests mean equal token prefixes (the chat template is deterministic), so the image sits at the same
    positions after the same context: its cached KV can be reused as is. Any difference, even one that would not
    change the tokens, only makes the planner choose the position-independent plan, which is also correct.
    """
    if not refs:
        return ()
    named = media if media is not None else list(zip(refs, images, strict=True))
    keys = {(ref.message_index, ref.part_index): item.key for ref, item in named}
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


def _rewrite_media(
    body: dict[str, Any], media: list[tuple[MediaPartRef, CanonicalImage | CanonicalVideo]]
) -> dict[str, Any]:
    if not media:
        return body
    upstream = dict(body)
    upstream["messages"] = copy.deepcopy(body["messages"])
    for ref, item in media:
        if _needs_rewrite(ref, item):
            part = upstream["messages"][ref.message_index]["content"][ref.part_index]
            field = "image_url" if isinstance(ref, ImagePartRef) else "video_url"
            part[field] = {**(part.get(field) or {}), "url": item.data_url}
    return upstream


def _needs_rewrite(ref: MediaPartRef, item: CanonicalImage | CanonicalVideo) -> bool:
    """Whether the worker must get other bytes than the client's URL holds: fetched images and videos, and any
    image that is not forwarded as uploaded. A data: URL of bytes forwarded as they came stays as it is, sparing a
    base64 encode of megabytes (it holds the GIL, and so the event loop, for ~35 ms per 20 MB)."""
    as_uploaded = isinstance(item, CanonicalVideo) or item.as_uploaded
    if not (as_uploaded and ref.url.startswith("data:")):
        return True  # fetched, re-encoded, or named by its uuid alone
    encoded = ref.url.partition(",")[2]
    return encoded != encoded.strip()  # the gateway tolerates surrounding whitespace; SGLang's strict decode does not
