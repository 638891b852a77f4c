"""Request intake: validate a chat request, resolve and canonicalise its images and videos.

The result, :class:`IntakeResult`, carries the body to send upstream (every image
replaced by its canonical lossless pixels, so the worker computes KV for exactly the
pixels the key names; every video as a data: URL of its bytes, so the worker fetches nothing) and the images in
prompt order with their keys and token grids, and the videos with the keys of their sampled frames.

Every image is fetched and its header read before any is decoded: the request's pixels (width x height of each)
are held to ``ImageLimits.max_request_pixels`` first (a 413 ``request_too_many_pixels``). The CPU work of intake
(parsing a large body, base64, hashing, decoding, prefix digests of a large prompt) runs on the intake's
:class:`gateway.pools.FairPool` in the caller's turn, so one caller's many images delay only its own requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from json.encoder import encode_basestring_ascii
from typing import Any, TypeVar, cast

from gateway.config import GatewayConfig
from gateway.errors import ClientError, InvalidRequest, ModelNotFound, PayloadTooLarge
from gateway.image_fetch import ImageFetcher, url_length
from gateway.image_memo import CanonicalMemo
from gateway.images import CanonicalImage, canonicalize, image_size
from gateway.json_body import CutURL
from gateway.matching.features import Extractor
from gateway.memory import MemoryTrim
from gateway.offload import lane, off_loop, on_thread_costing
from gateway.pools import FairPool
from gateway.prompt_size import PromptSize, message_chars
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
A = TypeVar("A")
B = TypeVar("B")

# What decoding an image may hold at its peak, per pixel: the decoded image and its RGB copy (Pillow keeps RGB at 4
# bytes a pixel; a greyscale image resized to the model's size holds ~1): its cost on the media pool, and what
# gateway/memory.py is told once it is done.
DECODED_BYTES_PER_PIXEL = 4
# The media pool's threads run below the event loop (gateway/pools.py): a caller's decoding takes only the CPU
# that relaying every caller's requests leaves.
MEDIA_NICE = 10


@dataclass(frozen=True, slots=True)
class IntakeResult:
    upstream_body: dict[str, Any]
    params: ChatCompletionParams
    images: tuple[CanonicalImage, ...]
    namespace: str
    # Per image: a digest of everything the prompt holds before it (see prefix_digests).
    prefix_digests: tuple[str, ...] = ()
    videos: tuple[CanonicalVideo, ...] = ()
    body_bytes: int = 0  # the size of the request body as it came
    text_chars: int = 0  # the characters of its messages' text (what its text costs: gateway/calibration.py)
    # About the bytes the upstream body holds beside the client's: the media it carries in other bytes than came (a
    # decoded image's data URL, a fetched image's base64), which its JSON encoding copies.
    rewritten_bytes: int = 0


@dataclass(frozen=True, slots=True)
class _Fetched:
    """An image's bytes, fetched and not yet decoded, with its size from the header."""

    ref: ImagePartRef
    data: bytes
    digest: bytes
    width: int
    height: int


class Intake:
    """``pool``: the threads that decode media and do the other CPU work of a request's intake, fair between
    callers (default: one of gateway.pools.default_workers() threads); :meth:`aclose` shuts it down.

    A job's cost on the default pool is the memory it holds while it runs, in bytes: an image's decoding
    (DECODED_BYTES_PER_PIXEL a pixel), a large body's parse (about the body again). Its budget is
    ``images.max_decoding_pixels`` pixels' worth for everyone together, and one caller's (an API key's) the body
    bytes its requests may hold (``admission.max_body_bytes_per_key``), shared with the bodies the key's requests
    hold (gateway/admission.py, ``Admission.share_budget_with``): one key's 50 MB body is not parsed while the same
    key's 40 Mpx image is decoded, whichever came first, nor its next body read meanwhile, so what one key holds at
    once is about its budget, or one job past it, not all of them."""

    def __init__(self, config: GatewayConfig, fetcher: ImageFetcher, extractor: Extractor | None = None, *,
                 pool: FairPool | None = None, prompt_size: PromptSize | None = None,
                 memory: MemoryTrim | None = None):
        self._config = config
        self._memory = memory  # told how much each decoding held, to give a large one's memory back
        # What refuses a prompt too long for the workers' context (gateway/prompt_size.py); None: nothing is.
        self.prompt_size = prompt_size
        self._fetcher = fetcher
        self._extractor = extractor  # with one, every new image gets per-token features (approximate matching)
        self.pool = pool if pool is not None else FairPool(
            name="revisit-media", nice=MEDIA_NICE,
            cost_budget=config.images.max_decoding_pixels * DECODED_BYTES_PER_PIXEL,
            caller_cost_budget=config.admission.max_body_bytes_per_key)
        self.memo: CanonicalMemo[CanonicalImage] = CanonicalMemo(config.image_memo_bytes)
        # Videos are remembered for their frame keys (decoding is what costs), within a quarter of that budget.
        self.video_memo: CanonicalMemo[CanonicalVideo] = CanonicalMemo(config.image_memo_bytes // 4)

    async def aclose(self) -> None:
        """Shut the pool down (jobs not started fail; started ones finish)."""
        await self.pool.aclose()

    async def process(self, raw: bytes | bytearray, *, namespace: str, caller: str | None = None) -> IntakeResult:
        """Intake of one request body. ``caller`` (the id of the caller's API key; default: the namespace) is whose
        turn its CPU work waits for on the pool: parsing, base64, hashing, decoding. Hand the body over (keep no
        reference to it): it is let go once parsed, so a large body is not held beside its parse while the
        request's images are fetched and decoded."""
        with lane(self.pool, namespace if caller is None else caller):
            body_bytes = len(raw)
            # Its parse holds ~its size; a prompt its bytes alone make too long is refused first, unparsed.
            unparsed = None if self.prompt_size is None else partial(self.prompt_size.check_body, param="messages")
            body, params = await off_loop(body_bytes, parse_body, raw, unparsed, cost=body_bytes)
            del raw
            return await self._process(body, params, body_bytes, namespace)

    async def _process(self, body: dict[str, Any], params: ChatCompletionParams, body_bytes: int,
                       namespace: str) -> IntakeResult:
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
        size = self.prompt_size
        text_chars = message_chars(body["messages"])
        text_tokens = size.text_tokens(text_chars) if size is not None else 0
        if size is not None:  # before any image is fetched: a prompt its text alone makes too long
            size.check(text_tokens, param="messages")
        if video_refs:
            images, videos = await _both(self._resolve_images(refs, namespace),
                                         _all(*(self._resolve_video(ref, namespace) for ref in video_refs)))
        else:
            images, videos = await self._resolve_images(refs, namespace), []
        if size is not None:
            size.check(text_tokens + sum(image.grid.tokens for image in images), param="messages")
        media: list[tuple[MediaPartRef, CanonicalImage | CanonicalVideo]] = [
            *zip(refs, images, strict=True), *zip(video_refs, videos, strict=True)]
        payload_bytes = sum(item.forwarded_bytes for ref, item in media if _needs_rewrite(ref, item))
        upstream_body = await off_loop(payload_bytes, _rewrite_media, body, media)
        # What prefix_digests reads: the body less its media URLs, which it names by key instead.
        text_bytes = body_bytes - sum(url_length(ref.url) for ref in parts)
        digests = await off_loop(text_bytes if refs else 0, prefix_digests, body, refs, images, media)
        return IntakeResult(
            upstream_body=upstream_body,
            params=params,
            images=tuple(images),
            namespace=namespace,
            prefix_digests=digests,
            videos=tuple(videos),
            body_bytes=body_bytes,
            text_chars=text_chars,
            rewritten_bytes=payload_bytes,
        )

    async def _resolve_video(self, ref: VideoPartRef, namespace: str) -> CanonicalVideo:
        settings = self._config.videos
        data = await self._fetcher.fetch(ref.url, param=ref.param, media="video", limit=settings.max_bytes)
        digest = await off_loop(len(data), CanonicalMemo.digest, data)
        if (known := self.video_memo.get(namespace, digest)) is not None:
            return known
        video = await _in_part(ref, open_video, data, settings=settings, processor=self._config.processor,
                               model=self._config.model, namespace=namespace, images=self._config.images,
                               extractor=self._extractor if settings.match_patches else None)
        self.video_memo.put(namespace, digest, video)
        return video

    async def _resolve_images(self, refs: list[ImagePartRef], namespace: str) -> list[CanonicalImage]:
        """Every image of the request: all fetched and their headers read first, and the request's pixels (every
        image's width x height, a repeat and a remembered image too) held to max_request_pixels before any is
        decoded. The same bytes twice in one request are decoded once."""
        found = await _all(*(self._fetch_image(ref, namespace) for ref in refs))
        limit = self._config.images.max_request_pixels
        pixels = sum(item.width * item.height for item in found)
        if pixels > limit:
            raise PayloadTooLarge(f"request has {len(found)} images of {pixels} pixels in all (width x height of "
                                  f"each); the limit is {limit} pixels per request", param="messages",
                                  code="request_too_many_pixels")
        pending: dict[bytes, _Fetched] = {}
        for item in found:
            if isinstance(item, _Fetched) and item.digest not in pending:
                pending[item.digest] = item
        decoded = dict(zip(pending, await _all(*(self._decode(item, namespace) for item in pending.values())),
                           strict=True))
        return [decoded[item.digest] if isinstance(item, _Fetched) else item for item in found]

    async def _fetch_image(self, ref: ImagePartRef, namespace: str) -> CanonicalImage | _Fetched:
        """The image remembered by its name or its bytes, else its bytes with their size from the header."""
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
        with _naming(ref):
            width, height = await off_loop(len(data), image_size, data, self._config.images)
        return _Fetched(ref, data, digest, width, height)

    async def _decode(self, item: _Fetched, namespace: str) -> CanonicalImage:
        held = DECODED_BYTES_PER_PIXEL * item.width * item.height  # what decoding it holds at its peak
        try:
            image = await _in_part(item.ref, canonicalize, item.data, cost=held,
                                   limits=self._config.images,
                                   processor=self._config.processor, model=self._config.model, namespace=namespace,
                                   extractor=self._extractor)
        finally:
            if self._memory is not None:  # what decoding held (the decoded image and its RGB copy) is free now
                self._memory.after(held)
        self.memo.put(namespace, item.digest, image)
        return image


async def _all(*aws: Awaitable[T]) -> list[T]:
    """asyncio.gather, but the first failure cancels the rest (their work not yet started on the pool is dropped).
    One awaitable is awaited as it is (no task of its own)."""
    if len(aws) <= 1:
        return [await aw for aw in aws]
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def _both(first: Awaitable[A], second: Awaitable[B]) -> tuple[A, B]:
    """:func:`_all` of two of different types."""
    a, b = await _all(first, second)  # one T for both: typed again below
    return cast(A, a), cast(B, b)


@contextlib.contextmanager
def _naming(ref: MediaPartRef) -> Iterator[None]:
    """A client error raised within names the part (its message and param)."""
    try:
        yield
    except ClientError as exc:
        exc.message = f"{ref.param}: {exc.message}"
        exc.param = exc.param or ref.param
        exc.args = (exc.message,)
        raise


async def _in_part(ref: MediaPartRef, work: Callable[..., T], /, *args: Any, cost: int = 0, **kwargs: Any) -> T:
    """Run ``work`` on a thread (the request's lane of the pool, gateway/offload.py; ``cost``: the bytes its decoding
    holds, held to the pool's budgets); a client error it raises names the part."""
    with _naming(ref):
        return await on_thread_costing(cost, work, *args, **kwargs)


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

    Each digest is the BLAKE2b-128 of ``json.dumps({"head": template fields, "messages": [the messages up to the
    image's, its own cut before the image]}, sort_keys=True, separators=(",", ":"))``, media parts as
    ``{"type": "image", "key": ...}``; stores keep them (an entry's prefix_digest), so this text must not change.
    It is computed in one pass, O(prompt) rather than O(images x prompt): one running hash over that text written
    in prompt order, copied at each image and finished with what closes the text there. The text is written in
    pieces (a long string in slices), so that on a thread no single call holds the GIL, and the event loop, for
    long; run it off the loop for a large body (gateway.offload.off_loop).
    """
    if not refs:
        return ()
    named = media if media is not None else list(zip(refs, images, strict=True))
    keys = {(ref.message_index, ref.part_index): item.key for ref, item in named}
    wanted = {(ref.message_index, ref.part_index) for ref in refs}
    head = {name: body[name] for name in _TEMPLATE_FIELDS if name in body}
    text = _HashedText()
    text.write('{"head":')
    _write_json(head, text.write)
    text.write(',"messages":[')
    found: dict[tuple[int, int], str] = {}
    last = max(ref.message_index for ref in refs)
    for i, message in enumerate(body["messages"][: last + 1]):
        if i:
            text.write(",")
        content = message.get("content")
        if not isinstance(content, list):
            _write_json({**message, "content": content}, text.write)
            continue
        parts = [{"type": "image", "key": keys[(i, j)]} if (i, j) in keys else part for j, part in enumerate(content)]
        if not any((i, j) in wanted for j in range(len(parts))):
            _write_json({**message, "content": parts}, text.write)
            continue
        # The message as sort_keys writes it: the fields before "content", the parts, then the fields after.
        fields = sorted({**message, "content": None})
        text.write("{")
        for name in fields[: fields.index("content")]:
            text.write(encode_basestring_ascii(name) + ":")
            _write_json(message[name], text.write)
            text.write(",")
        text.write('"content":[')
        after: list[str] = []
        for name in fields[fields.index("content") + 1:]:
            after.append("," + encode_basestring_ascii(name) + ":")
            _write_json(message[name], after.append)
        closing = "]" + "".join(after) + "}"
        for j, part in enumerate(parts):
            if (i, j) in wanted:
                found[(i, j)] = text.digest_with(closing + "]}")
                if len(found) == len(wanted):  # what follows the last image is in no prefix
                    return tuple(found[(ref.message_index, ref.part_index)] for ref in refs)
            if j:
                text.write(",")
            _write_json(part, text.write)
        text.write(closing)
    raise AssertionError("an image part is not where its reference says")  # refs come from these messages


class _HashedText:
    """A running BLAKE2b-128 of ASCII text written piece by piece (buffered: one update per ~64 KB)."""

    FLUSH = 1 << 16

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)
        self._buffer: list[str] = []
        self._buffered = 0

    def write(self, piece: str) -> None:
        self._buffer.append(piece)
        self._buffered += len(piece)
        if self._buffered >= self.FLUSH:
            self._flush()

    def digest_with(self, ending: str) -> str:
        """The hex digest of the text so far followed by ``ending``; the text goes on as if it had not been added."""
        self._flush()
        final = self._hash.copy()
        final.update(ending.encode())
        return final.hexdigest()

    def _flush(self) -> None:
        if self._buffer:
            self._hash.update("".join(self._buffer).encode())
            self._buffer.clear()
            self._buffered = 0


_ENCODE = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode
_SLICE = 1 << 18  # characters of a long string escaped per call (~1 ms)


def _write_json(value: Any, write: Callable[[str], None]) -> None:
    """Write exactly ``json.dumps(value, sort_keys=True, separators=(",", ":"))``, in pieces: long strings in
    slices of _SLICE characters, containers item by item, runs of short scalars through the C encoder about
    _SLICE characters at a time; so that no call holds the GIL for long, however large the value (its depth is
    bounded by json_body.MAX_JSON_DEPTH)."""
    if isinstance(value, str):
        if len(value) <= _SLICE:
            write(encode_basestring_ascii(value))
            return
        write('"')
        for start in range(0, len(value), _SLICE):  # escaping is per code point: the slices escape as the whole
            write(encode_basestring_ascii(value[start:start + _SLICE])[1:-1])
        write('"')
    elif isinstance(value, dict):
        write("{")
        _write_items(sorted(value.items()), write, keyed=True)  # the order json.dumps's sort_keys writes
        write("}")
    elif isinstance(value, list):
        write("[")
        _write_items(value, write, keyed=False)
        write("]")
    else:
        write(_ENCODE(value))


def _write_items(items: list[Any], write: Callable[[str], None], *, keyed: bool) -> None:
    """A list's items, or (``keyed``) a dict's sorted (key, value) items, comma-separated as json.dumps writes
    them."""
    batch: list[Any] = []
    batched = 0
    first = True

    def flush() -> None:
        nonlocal batched, first
        if batch:
            if not first:
                write(",")
            write(_ENCODE(dict(batch) if keyed else batch)[1:-1])
            first = False
            batch.clear()
            batched = 0

    for entry in items:
        item = entry[1] if keyed else entry
        size = _short_size(item)
        if keyed and size is not None:
            size = size + len(entry[0]) if isinstance(entry[0], str) and len(entry[0]) <= _SLICE else None
        if size is not None:
            batch.append(entry)
            batched += size
            if batched >= _SLICE:
                flush()
            continue
        flush()
        if not first:
            write(",")
        first = False
        if keyed:
            _write_json(entry[0], write)
            write(":")
        _write_json(item, write)
    flush()


def _short_size(value: Any) -> int | None:
    """About how many characters a scalar encodes to; None for a container or a long string."""
    if isinstance(value, str):
        return len(value) + 2 if len(value) <= _SLICE else None
    if isinstance(value, dict | list):
        return None
    return 24


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
    as_uploaded = item.as_uploaded
    url = ref.url
    if not (as_uploaded and url.startswith("data:")):
        return True  # fetched, re-encoded, or named by its uuid alone
    # The gateway tolerates whitespace around the base64; SGLang's strict decode does not.
    if isinstance(url, CutURL):
        return url.padded
    encoded = url.partition(",")[2]
    return encoded != encoded.strip()
