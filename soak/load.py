"""The soak's mixed load: what clients send, sent the way they send it, and what came back.

Kinds (``KINDS``, weights in ``WEIGHTS``):

    text            a chat without images
    new_image       a panel no one sent before, asked about one of its fields
    repeat          a panel this tenant sent before (recent ones more often), asked again: an exact hit when cached
    near_duplicate  a panel this tenant sent, one field redrawn: an approximate hit when its alias is cached
    other_tenant    a panel the other tenant sent, under this tenant's key: never an exact hit (isolation)
    video           a screen recording of a panel whose fields change (a recent one again now and then), asked
                    about: it runs as plain SGLang, so its answer must be plain SGLang's
    answered        a panel this tenant sent, asked its first field for the response cache (exact level): when
                    answered from it (a repeat of the same question), the answer must still be plain SGLang's
    stream          a field question, streamed
    cancel          a streamed request the client leaves after its first chunk, or one it stops waiting for
    bad_input       a malformed body, a damaged or oversized image, a private URL, a bad parameter: must be a 4xx
    admin           the admin API and /metrics, with the token (and once in a while without it: a 401)

Every request ends as one outcome: ``ok``, ``refused`` (the 4xx a bad input must get), ``cancelled`` (the
client left), ``error`` (a 5xx, a broken connection, a stream cut or ended by an error event: later explained
by a fault active at the time, or not), ``unexpected`` (the wrong status for what was sent, or a cross-tenant
hit) or ``lost`` (no answer within the client's timeout). A share of field questions is checked: the same
request sent straight to a worker (plain SGLang, no plan) must give the same answer.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random
import struct
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import httpx
import openai

from bundled.reader.panels import Panel, changed, random_panel
from bundled.reader.questions import field as field_question
from offline.reader_eval import data_url
from soak.stack import ADMIN, MODEL_ID, TENANTS

KINDS = ("text", "new_image", "repeat", "near_duplicate", "other_tenant", "video", "answered", "stream", "cancel",
         "bad_input", "admin")
WEIGHTS = (8, 14, 22, 10, 5, 4, 6, 10, 6, 12, 13)
RESPONSE_CACHE = "x-revisit-response-cache"
OUTCOMES = ("ok", "refused", "cancelled", "error", "unexpected", "lost")
CLIENT_TIMEOUT_S = 180.0
WORDS = "the a cache image screen page table cell value moves stays again near far quick slow".split()


@dataclass
class Record:
    kind: str
    tenant: int
    started: float
    ended: float = 0.0
    outcome: str = "ok"
    detail: str = ""
    reuse: str = ""  # the first image's reuse kind, as x-revisit-reuse said


@dataclass
class Check:
    """A field question's answer through the gateway beside plain SGLang's answer to the same request."""

    kind: str
    reuse: str
    answer: str
    reference: str
    truth: str  # the panel's field ("" for a video, whose frames differ in it)

    @property
    def wrong(self) -> bool:
        return self.answer != self.reference


@dataclass
class Seen:
    """Panels each tenant sent: the recent ones to pick from (bounded, most recent last), and all of them."""

    limit: int = 400
    panels: list[list[Panel]] = field(default_factory=lambda: [[] for _ in TENANTS])
    ever: list[set[str]] = field(default_factory=lambda: [set() for _ in TENANTS])  # repr of every panel sent

    def add(self, tenant: int, panel: Panel) -> None:
        mine = self.panels[tenant]
        mine.append(panel)
        del mine[: max(0, len(mine) - self.limit)]
        self.ever[tenant].add(repr(panel))

    def sent(self, tenant: int, panel: Panel) -> bool:
        return repr(panel) in self.ever[tenant]

    def pick(self, tenant: int, rng: random.Random) -> Panel | None:
        mine = self.panels[tenant]
        if not mine:
            return None
        return mine[-1 - min(int(rng.expovariate(1 / 12)), len(mine) - 1)]  # recent ones more often


class Load:
    """Clients sending the mixed load until told to stop; every request is recorded."""

    def __init__(self, url: str, worker_urls: list[str], *, seed: int = 0, check_share: float = 0.3,
                 worker_api_key: str | None = None) -> None:
        self.url = url
        self.worker_urls = worker_urls
        # The workers take requests only with the API key derived from the deployment secret (settings/secret.py).
        self._worker_headers = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}
        self.rng = random.Random(f"soak:{seed}")
        self.check_share = check_share
        self.seen = Seen()
        self.records: list[Record] = []
        self.checks: list[Check] = []
        self.checks_skipped = 0
        self.keys: dict[str, tuple[int, Panel]] = {}  # an image's cache key (x-revisit-image-keys) -> who sent what
        self.videos: list[list[bytes]] = [[] for _ in TENANTS]  # each tenant's recent recordings
        self.answered: list[list[Panel]] = [[] for _ in TENANTS]  # each tenant's recent "answered" panels
        self.stopping = asyncio.Event()
        self._clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0,
                                            timeout=CLIENT_TIMEOUT_S) for key in TENANTS]
        self._http = httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S)

    async def close(self) -> None:
        for client in self._clients:
            await client.close()
        await self._http.aclose()

    # --- running ---

    async def run(self, clients: int, deadline: float, max_requests: int) -> None:
        async def one_client(index: int) -> None:
            rng = random.Random(f"{self.rng.random()}:{index}")
            while not self.stopping.is_set() and time.monotonic() < deadline and len(self.records) < max_requests:
                kind = rng.choices(KINDS, WEIGHTS)[0]
                record = await self.send(kind, rng.randrange(len(TENANTS)), rng)
                if record.outcome == "error" and "connect" in record.detail:
                    await asyncio.sleep(0.5)  # the gateway is down (a fault): do not spin

        await asyncio.gather(*(one_client(i) for i in range(clients)))

    async def send(self, kind: str, tenant: int, rng: random.Random, body=None) -> Record:
        """One request of ``kind`` (``body``: a coroutine function of (record, rng) that sends it; default: the
        kind's own), recorded whatever happens to it."""
        record = Record(kind=kind, tenant=tenant, started=time.monotonic())
        self.records.append(record)
        try:
            await asyncio.wait_for((body or getattr(self, f"_{kind}"))(record, rng), CLIENT_TIMEOUT_S + 10)
        except (TimeoutError, openai.APITimeoutError, httpx.TimeoutException) as exc:
            record.outcome, record.detail = "lost", f"no answer in {CLIENT_TIMEOUT_S:.0f} s ({type(exc).__name__})"
        except openai.APIStatusError as exc:
            record.outcome = "unexpected" if exc.status_code < 500 else "error"
            record.detail = f"{exc.status_code}: {str(exc.message)[:200]}"
        except (openai.APIConnectionError, httpx.TransportError) as exc:
            cause = exc.__cause__  # the openai client's "Connection error." wraps what httpx saw
            seen = f" ({type(cause).__name__}: {str(cause)[:120]})" if cause is not None else ""
            record.outcome, record.detail = "error", f"connection: {type(exc).__name__}: {str(exc)[:160]}{seen}"
        except openai.APIError as exc:  # an error event in a stream
            record.outcome, record.detail = "error", f"stream error event: {str(exc)[:200]}"
        finally:
            record.ended = time.monotonic()
        return record

    async def ask_checked(self, kind: str, tenant: int, panel: Panel, *, lead: str | None = None) -> \
            tuple[Record, Check | None]:
        """A field question about ``panel`` whose answer is always checked (the faults' probes). ``lead``: text
        before the image, so that SGLang's prefix cache cannot serve the image and the store must."""
        checks = len(self.checks)
        rng = random.Random(f"{kind}:{len(self.records)}")
        record = await self.send(kind, tenant, rng,
                                 lambda record, rng: self._ask(record, panel, rng, check=True, lead=lead))
        return record, (self.checks[-1] if len(self.checks) > checks else None)

    # --- the kinds ---

    async def _text(self, record: Record, rng: random.Random) -> None:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
        reply = await self._clients[record.tenant].chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": words}], max_tokens=rng.randint(1, 8),
            temperature=0)
        if not reply.choices:
            record.outcome, record.detail = "unexpected", "no choices"

    async def _new_image(self, record: Record, rng: random.Random) -> None:
        panel = random_panel(rng)
        await self._ask(record, panel, rng)
        self.seen.add(record.tenant, panel)

    async def _repeat(self, record: Record, rng: random.Random) -> None:
        panel = self.seen.pick(record.tenant, rng)
        if panel is None:
            return await self._new_image(record, rng)
        await self._ask(record, panel, rng)

    async def _near_duplicate(self, record: Record, rng: random.Random) -> None:
        panel = self.seen.pick(record.tenant, rng)
        if panel is None or len(panel.keys) < 2:
            return await self._new_image(record, rng)
        near, _ = changed(panel, rng, 1)
        await self._ask(record, near, rng)
        self.seen.add(record.tenant, near)

    async def _other_tenant(self, record: Record, rng: random.Random) -> None:
        other = 1 - record.tenant
        # Only panels this tenant never sent, however long ago (the other tenant may have sent one of its panels).
        theirs = [p for p in self.seen.panels[other][-50:] if not self.seen.sent(record.tenant, p)]
        if not theirs:
            return await self._new_image(record, rng)
        panel = rng.choice(theirs)
        self.seen.add(record.tenant, panel)  # before it is sent: another of this tenant's clients must not pick it
        await self._ask(record, panel, rng)  # while it is in flight (it would be a hit in this tenant's own cache)
        reuse = record.reuse
        if record.outcome == "ok" and (reuse.startswith("exact") or "similarity=1.0000" in reuse):
            record.outcome, record.detail = "unexpected", f"another tenant's image was reused: {reuse}"

    async def _video(self, record: Record, rng: random.Random) -> None:
        mine = self.videos[record.tenant]
        if mine and rng.random() < 0.4:
            video = rng.choice(mine)
        else:
            panel = random_panel(rng)
            frames = [panel]
            for _ in range(rng.choice((3, 5, 7))):
                frames.append(changed(frames[-1], rng, 1)[0] if len(panel.keys) > 1 and rng.random() < 0.5
                              else frames[-1])
            video = await asyncio.to_thread(_recording, [f.render() for f in frames])
            mine.append(video)
            del mine[:-8]
        part = {"type": "video_url", "video_url": {"url": _b64(video, "video/mp4")}}
        messages: list = [{"role": "user", "content": [part, {"type": "text", "text": "What does the screen show?"}]}]
        raw = await self._clients[record.tenant].chat.completions.with_raw_response.create(
            model=MODEL_ID, messages=messages, max_tokens=1, temperature=0)
        answer = (raw.parse().choices[0].message.content or "").strip()
        record.reuse = "video"
        if not raw.headers.get("x-revisit-video-frames"):
            record.outcome, record.detail = "unexpected", "no x-revisit-video-frames header"
        if rng.random() < self.check_share:
            reference = await self._plain_sglang(messages, rng)
            if reference is None:
                self.checks_skipped += 1
            else:
                self.checks.append(Check(kind=record.kind, reuse="video", answer=answer, reference=reference,
                                         truth=""))

    async def _answered(self, record: Record, rng: random.Random) -> None:
        mine = self.answered[record.tenant]
        panel = rng.choice(mine) if mine and rng.random() < 0.6 else self.seen.pick(record.tenant, rng)
        if panel is None:
            return await self._new_image(record, rng)
        mine.append(panel)
        del mine[:-8]
        messages = _messages(panel, field_question(panel, panel.keys[0]).text)  # the same question each time
        raw = await self._clients[record.tenant].chat.completions.with_raw_response.create(
            model=MODEL_ID, messages=messages, max_tokens=1, temperature=0, extra_headers={RESPONSE_CACHE: "exact"})
        answer = (raw.parse().choices[0].message.content or "").strip()
        served = raw.headers.get(RESPONSE_CACHE, "")
        record.reuse = "response_cache" if served == "exact" else _first_reuse(raw.headers.get("x-revisit-reuse", ""))
        if served not in ("exact", "miss"):
            record.outcome, record.detail = "unexpected", f"{RESPONSE_CACHE}: {served!r}"
            return
        if served == "exact" or rng.random() < self.check_share:  # every cached answer is checked
            reference = await self._plain_sglang(messages, rng)
            if reference is None:
                self.checks_skipped += 1
            else:
                self.checks.append(Check(kind=record.kind, reuse=record.reuse, answer=answer, reference=reference,
                                         truth=field_question(panel, panel.keys[0]).answer))

    async def _stream(self, record: Record, rng: random.Random) -> None:
        panel = self.seen.pick(record.tenant, rng) if rng.random() < 0.6 else None
        panel = panel or random_panel(rng)
        question = field_question(panel, rng.choice(panel.keys))
        raw = await self._clients[record.tenant].chat.completions.with_raw_response.create(
            model=MODEL_ID, messages=_messages(panel, question.text), max_tokens=rng.randint(1, 6), temperature=0,
            stream=True)
        record.reuse = _first_reuse(raw.headers.get("x-revisit-reuse", ""))
        finished = False
        async for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].finish_reason:
                finished = True
        if not finished:
            record.outcome, record.detail = "error", "stream ended without a finish reason"
        self.seen.add(record.tenant, panel)

    async def _cancel(self, record: Record, rng: random.Random) -> None:
        panel = random_panel(rng)
        question = field_question(panel, panel.keys[0])
        client = self._clients[record.tenant]
        if rng.random() < 0.5:
            stream = await client.chat.completions.create(
                model=MODEL_ID, messages=_messages(panel, question.text), max_tokens=16, temperature=0, stream=True)
            async for _ in stream:
                break
            await stream.close()
        else:
            try:
                await asyncio.wait_for(client.chat.completions.create(
                    model=MODEL_ID, messages=_messages(panel, question.text), max_tokens=16, temperature=0),
                    timeout=rng.uniform(0.05, 1.0))
                return  # it finished before the client gave up
            except TimeoutError:
                pass
        record.outcome = "cancelled"

    async def _bad_input(self, record: Record, rng: random.Random) -> None:
        name, body = rng.choice(BAD_INPUTS)()
        headers = {"Authorization": f"Bearer {TENANTS[record.tenant]}", "Content-Type": "application/json"}
        content = body if isinstance(body, bytes) else None
        response = await self._http.post(self.url + "/v1/chat/completions", content=content,
                                         json=None if content is not None else body, headers=headers)
        record.detail = f"{name}: {response.status_code}"
        if 400 <= response.status_code < 500 and "error" in response.json():
            record.outcome = "refused"
        elif response.status_code >= 500:
            record.outcome = "error"
        else:
            record.outcome = "unexpected"

    async def _admin(self, record: Record, rng: random.Random) -> None:
        path, method, expect = rng.choice(ADMIN_CALLS)
        if path.startswith("/v1/"):  # an OpenAI route: a tenant's API key, not the admin token
            headers = {"Authorization": f"Bearer {TENANTS[record.tenant]}"}
        else:
            headers = ADMIN if expect != 401 else {}
        response = await self._http.request(method, self.url + path, headers=headers)
        record.detail = f"{method} {path}: {response.status_code}"
        if response.status_code != expect:
            record.outcome = "error" if response.status_code >= 500 else "unexpected"

    # --- a field question, and its check ---

    async def _ask(self, record: Record, panel: Panel, rng: random.Random, *, check: bool = False,
                   lead: str | None = None) -> None:
        question = field_question(panel, rng.choice(panel.keys))
        messages = _messages(panel, question.text, lead)
        raw = await self._clients[record.tenant].chat.completions.with_raw_response.create(
            model=MODEL_ID, messages=messages, max_tokens=1, temperature=0)
        answer = (raw.parse().choices[0].message.content or "").strip()
        record.reuse = _first_reuse(raw.headers.get("x-revisit-reuse", ""))
        if key := raw.headers.get("x-revisit-image-keys", ""):
            self.keys[key.split(",")[0]] = (record.tenant, panel)
        if check or rng.random() < self.check_share:
            reference = await self._plain_sglang(messages, rng)
            if reference is None:
                self.checks_skipped += 1
            else:
                self.checks.append(Check(kind=record.kind, reuse=record.reuse, answer=answer, reference=reference,
                                         truth=question.answer))

    async def _plain_sglang(self, messages: list, rng: random.Random) -> str | None:
        """The same request straight to a worker: no gateway, no plan, so SGLang's own full prefill."""
        url = rng.choice(self.worker_urls)
        try:
            response = await self._http.post(url + "/v1/chat/completions", json={
                "model": MODEL_ID, "messages": messages, "max_tokens": 1, "temperature": 0}, timeout=60,
                headers=self._worker_headers)
        except httpx.HTTPError:
            return None  # the worker is being killed or restarted: nothing to compare with
        if response.status_code in (401, 403):  # not a fault the soak made: no check could ever run
            raise RuntimeError(f"the worker at {url} refused the soak's API key ({response.status_code})")
        if response.status_code != 200:
            return None
        return (response.json()["choices"][0]["message"]["content"] or "").strip()

    # --- the tallies ---

    def reuse_kinds(self) -> dict[str, int]:
        return dict(Counter(r.reuse.split(";")[0] for r in self.records if r.reuse and r.outcome == "ok"))


def _messages(panel: Panel, text: str, lead: str | None = None) -> list:
    image = {"type": "image_url", "image_url": {"url": data_url(panel.render())}}
    parts = [{"type": "text", "text": lead}] if lead else []
    return [{"role": "user", "content": [*parts, image, {"type": "text", "text": text}]}]


def _first_reuse(header: str) -> str:
    return header.split(",")[0]


# --- bad inputs: (name, body) makers; every one must get a 4xx with an error body ---


def _chat(url: str, **extra) -> dict:
    return {"model": MODEL_ID, "max_tokens": 2, **extra, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "a?"}]}]}


def _png(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height (the gateway must refuse it before decoding)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    idat = zlib.compress(b"\0" * 64)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
            + struct.pack(">I", len(idat)) + b"IDAT" + idat + struct.pack(">I", zlib.crc32(b"IDAT" + idat))
            + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND")))


def _b64(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _recording(frames: list, fps: int = 2) -> bytes:
    """Frames (PIL images) as an H.264 MP4 at ``fps``, as a screen recorder writes one."""
    import av
    import numpy as np

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = (side - side % 2 for side in frames[0].size)
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            pixels = np.asarray(frame.convert("RGB"))[: stream.height, : stream.width]
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def _panel_png() -> bytes:
    buffer = io.BytesIO()
    random_panel(random.Random(7)).render().save(buffer, format="PNG")
    return buffer.getvalue()


def _truncated_recording() -> bytes:
    rng = random.Random(5)
    panel = random_panel(rng)
    data = _recording([panel.render(), changed(panel, rng, 1)[0].render()] * 2)
    return data[: len(data) // 3]


def _truncated_panel() -> bytes:
    data = _panel_png()
    return data[: len(data) // 2]


BAD_INPUTS = (
    lambda: ("not json", b"{\"model\": \"revisit-oracle\", \"messages\": ["),
    lambda: ("no messages", {"model": MODEL_ID}),
    lambda: ("unknown model", {**_chat(_b64(_panel_png())), "model": "no-such-model"}),
    lambda: ("random bytes as an image", _chat(_b64(random.randbytes(600)))),
    lambda: ("a truncated PNG", _chat(_b64(_truncated_panel()))),
    lambda: ("a 30000x30000 PNG", _chat(_b64(_png(30000, 30000)))),
    lambda: ("a private URL", _chat("http://127.0.0.1:9/image.png")),
    lambda: ("not base64", _chat("data:image/png;base64,@@@@")),
    lambda: ("negative max_tokens", {**_chat(_b64(_panel_png())), "max_tokens": -3}),
    lambda: ("a string for messages", {"model": MODEL_ID, "messages": "hello"}),
    lambda: ("a truncated video", {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": _b64(_truncated_recording(), "video/mp4")}}]}]}),
)

ADMIN_CALLS = (
    ("/admin/stats", "GET", 200),
    ("/admin/entries?limit=5", "GET", 200),
    ("/admin/presets", "GET", 200),
    ("/health", "GET", 200),
    ("/metrics", "GET", 200),
    ("/v1/models", "GET", 200),
    ("/admin/stats", "GET", 401),
)
