"""Bounds on what one request's intake costs the gateway, and on how much one caller's intake delays another's.

Before them (a security review): 16 tiny images after 50 MB of text stalled the event loop 7.1 s, as each image's
prefix digest serialised the whole prompt before it again, on the loop; a 170 KB PNG of 6320 x 6320 pixels, under
the per-image cap, cost seconds of CPU and ~800 MB to decode, and a request could carry 16 of them; and every
image was decoded on asyncio's default executor, one FIFO queue shared by every caller, so one caller's many
expensive images delayed everybody else's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import string
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import blake3
import pytest
from PIL import Image, ImageDraw, ImageFile

import gateway.intake as intake_module
from gateway.config import AdmissionLimits, GatewayConfig, ImageLimits
from gateway.errors import PayloadTooLarge, UnprocessableImage
from gateway.image_fetch import ImageFetcher
from gateway.intake import DECODED_BYTES_PER_PIXEL, Intake, prefix_digests
from gateway.pools import FairPool
from gateway.protocol import ImagePartRef, iter_media_parts
from tests.images_lib import data_url, encode, noise_image
from tests.waiting import until

# --- helpers ---


def config(**image_limits: Any) -> GatewayConfig:
    return GatewayConfig(model="m", workers=("http://127.0.0.1:1",), images=ImageLimits(**image_limits))


def chat(*parts: dict[str, Any]) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": list(parts)}]}).encode()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


class LoopWatch:
    """A task that sleeps 10 ms again and again and records every gap between its wake-ups (start, end)."""

    def __init__(self) -> None:
        self.gaps: list[tuple[float, float]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopWatch:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        await asyncio.sleep(0.03)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _tick(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            self.gaps.append((last, now))
            last = now

    def worst(self, *, outside: Sequence[tuple[float, float]] = ()) -> float:
        """The longest gap, less the 10 ms asked for, among those that overlap none of ``outside``."""
        gaps = [end - start for start, end in self.gaps
                if not any(start < until and since < end for since, until in outside)]
        return max(gaps, default=0.0) - 0.01


def reference_prefix_digests(body: dict[str, Any], refs: list[Any], media: list[tuple[Any, Any]]) -> tuple[str, ...]:
    """The digests as gateway/intake.py computed them before (one json.dumps of the whole prefix per image): stores
    keep them, so the one-pass computation must give exactly these."""
    keys = {(ref.message_index, ref.part_index): item.key for ref, item in media}
    head = {name: body[name] for name in ("model", "tools", "tool_choice", "chat_template_kwargs") if name in body}
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


def digests_of(body: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(one-pass digests, reference digests) of a body whose media URLs are their keys."""
    parts = list(iter_media_parts(body["messages"]))
    media = [(ref, SimpleNamespace(key=hashlib.sha256(ref.url.encode()).hexdigest())) for ref in parts]
    refs = [ref for ref in parts if isinstance(ref, ImagePartRef)]
    images: list[Any] = [item for ref, item in media if isinstance(ref, ImagePartRef)]
    return prefix_digests(body, refs, images, media), reference_prefix_digests(body, refs, media)  # type: ignore[arg-type]


# --- 1. prefix digests: one pass, off the loop ---


def sample_bodies() -> list[dict[str, Any]]:
    rng = random.Random(7)
    words = "".join(rng.choice(string.ascii_letters + " \"\\\n\t/é中😀\u2028") for _ in range(3000))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "enum": list(range(300))},
                                         "x": {"type": "number", "default": 1.5e-7}, "ok": {"type": "boolean"}},
        "required": ["n"]}}}]
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    return [
        {"model": "m", "messages": [{"role": "user", "content": [image_part("a"), {"type": "text", "text": "hi"}]}]},
        {"model": "m", "tools": tools, "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": False},
         "temperature": 0.3, "messages": [
             {"role": "system", "content": words},
             {"role": "user", "content": [{"type": "text", "text": words[:50]}, image_part("a"), image_part("b")]},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"n\": 1}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "[1, 2]"},
             {"role": "user", "content": [video, {"type": "text", "text": words}, image_part("a"),
                                          {"type": "text", "text": "and?"}, image_part("c")]},
             {"role": "user", "content": "after the last image"},
         ]},
        {"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "x" * 5000}]},
                                    {"role": "user", "content": [image_part("a")]},
                                    {"role": "user", "content": [image_part("a"), image_part("a")]}]},
    ]


@pytest.mark.parametrize("small", [False, True])
def test_one_pass_prefix_digests_equal_the_digests_stores_already_hold(monkeypatch, small: bool) -> None:
    if small:  # slices, batches and flushes of a few characters, so that every seam is crossed
        monkeypatch.setattr(intake_module, "_SLICE", 7)
        monkeypatch.setattr(intake_module._HashedText, "FLUSH", 5)
    for body in sample_bodies():
        ours, reference = digests_of(body)
        assert ours == reference and len(ours) >= 1


def test_prefix_digests_are_equal_for_equal_prefixes_and_differ_when_anything_before_differs() -> None:
    base = sample_bodies()[1]
    ours, _ = digests_of(base)
    assert len(ours) == 4 and len(set(ours)) == 4
    # What follows an image changes nothing before it.
    after = json.loads(json.dumps(base))
    after["messages"][4]["content"].append({"type": "text", "text": "something else"})
    after["messages"][5]["content"] = "something else"
    after["messages"].append({"role": "user", "content": [{"type": "text", "text": "more"}]})
    assert digests_of(after)[0] == ours
    # Any earlier part changed: the digests of every image after it change, and only those.
    changes = [
        (lambda b: b["messages"][0].update(content="other system"), 0),
        (lambda b: b["messages"][1]["content"][0].update(text="other"), 0),
        (lambda b: b.update(tool_choice="none"), 0),
        (lambda b: b["messages"][3].update(content="[1, 3]"), 2),
        (lambda b: b["messages"][4]["content"][0]["video_url"].update(url="data:video/mp4;base64,BBBB"), 2),  # a key
        (lambda b: b["messages"][1]["content"].__setitem__(1, image_part("z")), 1),  # an earlier image's key
        (lambda b: b["messages"][4]["content"][1].update(text="x"), 2),
        (lambda b: b["messages"][4]["content"].__setitem__(2, image_part("z")), 3),
    ]
    for change, first_changed in changes:
        body = json.loads(json.dumps(base))
        change(body)
        changed, reference = digests_of(body)
        assert changed == reference
        assert changed[:first_changed] == ours[:first_changed]
        assert all(a != b for a, b in zip(changed[first_changed:], ours[first_changed:], strict=True))


async def test_fifty_megabytes_of_text_before_sixteen_images_neither_stall_the_loop_nor_take_long(monkeypatch):
    rng = random.Random(0)
    text = "".join(rng.choice(string.ascii_letters + " ") for _ in range(1 << 16)) * 800  # 52 MB
    urls = [data_url(encode(noise_image(32, 32, seed))) for seed in range(16)]
    raw = chat({"type": "text", "text": text}, *(image_part(url) for url in urls))
    del text
    intake = Intake(config(), ImageFetcher(config().images))
    # The body's JSON is parsed (gateway/protocol.py) by the stdlib's C scanner in one call that holds the GIL
    # however it is threaded (~0.1-0.2 s for 52 MB here); the review's stall, and all that intake does besides, must
    # not.
    parsing: list[tuple[float, float]] = []
    parse = intake_module.parse_body

    def timed_parse(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return parse(*args)
        finally:
            parsing.append((started, time.perf_counter()))

    monkeypatch.setattr(intake_module, "parse_body", timed_parse)
    try:
        async with LoopWatch() as watch:
            started = time.perf_counter()
            result = await intake.process(raw, namespace="n", caller="k")
            took = time.perf_counter() - started
    finally:
        await intake.aclose()
    assert len(result.prefix_digests) == 16 and len(set(result.prefix_digests)) == 16
    assert took < 2.0, f"intake took {took:.2f} s"
    assert watch.worst(outside=parsing) < 0.1, f"the loop stalled {watch.worst(outside=parsing):.3f} s"
    assert watch.worst() < 0.5, f"the loop stalled {watch.worst():.3f} s, parsing included"


# --- 2. a request's pixels, counted from the headers before anything is decoded ---


@pytest.fixture(scope="module")
def huge_png() -> bytes:
    """A few-colour RGB PNG of 5600 x 5600 = 31.4 Mpx (under the per-image cap of 40 Mpx; two of them under the
    default 64 Mpx a request may hold, three over it) that compresses to ~100 KB."""
    image = Image.new("RGB", (5600, 5600), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    rng = random.Random(1)
    for _ in range(200):
        x, y = rng.randrange(5600), rng.randrange(5600)
        draw.rectangle((x, y, x + rng.randrange(20, 900), y + rng.randrange(20, 900)),
                       fill=rng.choice([(200, 30, 30), (30, 160, 40), (20, 40, 200), (0, 0, 0)]))
    data = encode(image, compress_level=6)
    assert len(data) < 400_000
    return data


@pytest.fixture()
def decoding(monkeypatch) -> list[str]:
    """What was decoded: a record per canonicalize call and per Pillow pixel load, from any thread."""
    calls: list[str] = []
    canonicalize, image_load, file_load = intake_module.canonicalize, Image.Image.load, ImageFile.ImageFile.load

    def spy_canonicalize(*args: Any, **kwargs: Any) -> Any:
        calls.append("canonicalize")
        return canonicalize(*args, **kwargs)

    def spy_image_load(self: Image.Image) -> Any:
        calls.append("Image.load")
        return image_load(self)

    def spy_file_load(self: ImageFile.ImageFile) -> Any:
        calls.append("ImageFile.load")
        return file_load(self)

    monkeypatch.setattr(intake_module, "canonicalize", spy_canonicalize)
    monkeypatch.setattr(Image.Image, "load", spy_image_load)
    monkeypatch.setattr(ImageFile.ImageFile, "load", spy_file_load)
    return calls


async def test_sixteen_huge_images_are_refused_from_their_headers_before_any_is_decoded(huge_png, decoding):
    intake = Intake(config(), ImageFetcher(config().images))
    raw = chat(*(image_part(data_url(huge_png)) for _ in range(16)), {"type": "text", "text": "describe"})
    started = time.perf_counter()
    try:
        with pytest.raises(PayloadTooLarge) as refused:
            await intake.process(raw, namespace="n", caller="k")
    finally:
        await intake.aclose()
    took = time.perf_counter() - started
    assert refused.value.status_code == 413 and refused.value.code == "request_too_many_pixels"
    assert refused.value.param == "messages"
    assert f"{16 * 5600 * 5600} pixels" in refused.value.message and "the limit is 64000000" in refused.value.message
    assert decoding == [] and took < 0.5, (decoding, took)


async def test_two_huge_images_within_the_budget_are_accepted_and_the_same_bytes_decoded_once(huge_png, decoding):
    intake = Intake(config(), ImageFetcher(config().images))
    raw = chat(image_part(data_url(huge_png)), {"type": "text", "text": "and"}, image_part(data_url(huge_png)))
    try:
        result = await intake.process(raw, namespace="n", caller="k")
    finally:
        await intake.aclose()
    assert [(image.width, image.height) for image in result.images] == [(5600, 5600)] * 2
    assert result.images[0] is result.images[1]  # one decoding, one canonical image (resized to the model's size)
    assert decoding.count("canonicalize") == 1


async def test_the_budget_counts_every_image_remembered_or_not_and_names_its_limit() -> None:
    a, b = (data_url(encode(noise_image(40, 50, seed))) for seed in (1, 2))  # 2000 pixels each
    raw = chat(image_part(a), image_part(b), image_part(a))
    exact = Intake(config(max_request_pixels=6000), ImageFetcher(ImageLimits()))
    tight = Intake(config(max_request_pixels=5999), ImageFetcher(ImageLimits()))
    try:
        assert len((await exact.process(raw, namespace="n")).images) == 3
        assert len((await exact.process(raw, namespace="n")).images) == 3  # remembered now: the same count
        assert len((await tight.process(chat(image_part(a), image_part(b)), namespace="n")).images) == 2
        assert len(tight.memo) == 2  # both remembered: nothing left to decode, and still counted
        with pytest.raises(PayloadTooLarge, match="3 images of 6000 pixels in all .* the limit is 5999 pixels"):
            await tight.process(raw, namespace="n")
    finally:
        await exact.aclose()
        await tight.aclose()


async def test_a_bad_header_is_named_by_its_part_before_anything_is_decoded(decoding) -> None:
    intake = Intake(config(), ImageFetcher(ImageLimits()))
    good = data_url(encode(noise_image(8, 8)))
    bad = data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    try:
        with pytest.raises(UnprocessableImage) as refused:
            await intake.process(chat(image_part(good), image_part(bad)), namespace="n")
    finally:
        await intake.aclose()
    assert refused.value.param == "messages[0].content[1].image_url"
    assert refused.value.message.startswith("messages[0].content[1].image_url: ")
    assert "canonicalize" not in decoding


@pytest.mark.parametrize("strip_bytes", [1, 1000, 2 << 20])
def test_keys_hashed_in_strips_are_the_keys_of_the_whole_image(monkeypatch, strip_bytes: int) -> None:
    import gateway.images as images

    monkeypatch.setattr(images, "_KEY_STRIP_BYTES", strip_bytes)
    monkeypatch.setattr(images, "_KEY_WHOLE_BYTES", 0 if strip_bytes < 2 << 20 else images._KEY_WHOLE_BYTES)
    rgb = noise_image(61, 37, seed=3)
    processor = config().processor
    whole = blake3.blake3(images.KEY_VERSION + b"\0" + (  # the key as defined: one hash of the whole image
        f"m\0n\0{processor.patch_size},{processor.merge_size},{processor.temporal_patch_size},"
        f"{processor.min_pixels},{processor.max_pixels}\0{rgb.width}x{rgb.height}\0").encode() + rgb.tobytes())
    assert images.content_key(rgb, model="m", namespace="n", processor=processor) == whole.hexdigest()


def test_an_opaque_alpha_channel_is_not_composited_and_keys_as_before() -> None:
    from gateway.images import canonicalize

    def canon(image: Image.Image) -> Any:
        return canonicalize(encode(image), limits=ImageLimits(), processor=config().processor, model="m",
                            namespace="n")

    rgb = noise_image(64, 48, seed=4)
    for opaque in (rgb.convert("RGBA"), rgb.convert("L").convert("LA")):
        composited = Image.new("RGBA", opaque.size, (255, 255, 255, 255))
        composited.alpha_composite(opaque.convert("RGBA"))
        assert canon(opaque).key == canon(composited.convert("RGB")).key  # what compositing gave
    translucent = rgb.convert("RGBA")
    translucent.putpixel((0, 0), (10, 20, 30, 128))
    assert canon(translucent).key != canon(rgb).key  # a pixel that is not opaque is still composited


def test_max_request_pixels_is_read_from_the_environment() -> None:
    env = {"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://a:1", "REVISIT_AUTH": "open"}
    assert GatewayConfig.from_env(env).images.max_request_pixels == 64_000_000
    assert GatewayConfig.from_env({**env, "REVISIT_MAX_REQUEST_PIXELS": "1000"}).images.max_request_pixels == 1000


# --- 3. decoding on a bounded pool, fair between callers (the pool itself: tests/gateway/test_pools.py) ---


async def test_intake_decodes_in_its_callers_turn() -> None:
    """A caller whose images wait behind another's full queue on the default executor is served next here."""
    intake = Intake(config(), ImageFetcher(ImageLimits()), pool=FairPool(2))
    hog = [asyncio.ensure_future(intake.pool.run("A", time.sleep, 0.2)) for _ in range(20)]
    await asyncio.sleep(0)
    started = time.perf_counter()
    try:
        result = await intake.process(chat(image_part(data_url(encode(noise_image(64, 64))))), namespace="shared",
                                      caller="B")
        took = time.perf_counter() - started
        assert intake.pool.queued("A") >= 14  # A's queue is still there
        await asyncio.gather(*hog)
    finally:
        await intake.aclose()
    assert len(result.images) == 1
    assert took < 0.8, f"B's one image took {took:.2f} s behind A's 20 jobs"


async def test_one_keys_parsing_and_decoding_hold_at_most_its_body_budget_at_once_while_another_keys_go_on() -> None:
    """A key's large body is not parsed, nor its image decoded, while the same key's other intake jobs hold its
    body budget (REVISIT_ADMISSION_MAX_BODY_BYTES_PER_KEY): a 50 MB body's parse (~50 MB more) and a 40 Mpx
    image's decoding (~40-160 MB) of one key are not in memory at once. Another key's are not held back by it."""
    budget = 4 << 20
    settings = GatewayConfig(model="m", workers=("http://127.0.0.1:1",),
                             admission=AdmissionLimits(max_body_bytes_per_key=budget))
    intake = Intake(settings, ImageFetcher(settings.images))
    text = chat({"type": "text", "text": "x" * (1 << 20)})  # past OFF_LOOP_BYTES: parsed on the pool, costing 1 MiB
    picture = chat(image_part(data_url(encode(noise_image(64, 64)))))  # decoding costs 64 x 64 x 4 bytes
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()

    def hold() -> None:  # one of A's jobs, holding all but a little of its budget
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(5)

    held = asyncio.ensure_future(intake.pool.run_costing("A", budget - 1000, hold))
    try:
        await until(lambda: intake.pool.stats()["cost_running"] == budget - 1000)
        a_text = asyncio.ensure_future(intake.process(text, namespace="a", caller="A"))
        b_text = await intake.process(text, namespace="b", caller="B")  # B's own budget: parsed at once
        assert len(b_text.upstream_body["messages"][0]["content"][0]["text"]) == 1 << 20
        await until(lambda: intake.pool.queued("A") == 1)
        assert not a_text.done() and intake.pool.queued("A") == 1  # A's parse waits for A's room
        gate.set()
        await asyncio.wait_for(asyncio.gather(held, a_text), 5)

        gate.clear()
        held = asyncio.ensure_future(intake.pool.run_costing("A", budget - 1000, hold))
        await until(lambda: intake.pool.stats()["cost_running"] == budget - 1000)
        assert 1000 < DECODED_BYTES_PER_PIXEL * 64 * 64
        a_picture = asyncio.ensure_future(intake.process(picture, namespace="a", caller="A"))
        assert len((await intake.process(picture, namespace="b", caller="B")).images) == 1
        await until(lambda: intake.pool.queued("A") == 1)  # A's decoding waits for A's room
        assert not a_picture.done()
        gate.set()
        assert len((await asyncio.wait_for(a_picture, 5)).images) == 1
    finally:
        gate.set()
        await intake.aclose()
