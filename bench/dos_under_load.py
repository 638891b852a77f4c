"""Denial of service under load: the soak's mixed load with and without an attacker, side by side.

Starts the soak's stack (SGLang CPU workers on the oracle reader, a `revisit gateway` in keys mode) with a third
listed API key, the attacker's, and runs the soak's mixed load (soak/load.py: two tenants' text, new, repeated and
near-duplicate images, streams, videos, cached answers, cancels, bad input, admin calls) in alternating phases:
quiet, attacked, quiet, attacked, ... In the attacked phases the attacker, on its own key, keeps sending the bodies
that once stalled or swelled the gateway:

    big_text_images  50 MB of text then 16 tiny images, each request's images new
    json_values      16 MB of ``[{},{},...]``, ``[0.1,0.1,...]`` or ``["ab","ab",...]`` by turns
    pixel_bomb       a PNG of 170 KB declaring 6320 x 6320 pixels
    deep_json        JSON nested 300 deep
    flood            100 small requests at once
    slow_body        a body that drips a byte a second (held until the gateway's body deadline)
    drip_url         an image URL whose server drips a byte every 1.5 s (held until the fetch deadline)

It prints the tenants' latency (p50, p95, per kind and overall, over the requests answered) and the gateway's peak
RSS per phase, and the attacked/quiet ratios. The machine's CPUs are split between the gateway and the workers
(the load generator runs beside the gateway), as a GPU host's would be: on a shared CPU, an attacker's decoding
would otherwise slow the model's own forward, which is no property of the gateway.

The attacker is a process of its own, beside the gateway, at a low CPU priority (``--attacker-nice``, 19): a real
attacker makes its requests on its own machine, so what the tenants lose should be what the gateway spends on the
attack, not what the attacker's client spends making, sending and reading it (in the tenants' own event loop, as it
once ran, its 100-request bursts alone delayed the tenants' clients). At nice 19 it still sends whenever the
gateway's CPU has a moment idle; the counts of what it sent are printed, and ``--attacker-nice 0`` shows the
attack with the attacker's client competing for the gateway's CPU as an equal.

    .venv/bin/python bench/dos_under_load.py [--phase-s 90] [--rounds 2] [--workers 1] [--attacker-nice 19]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launcher import live_group_members  # noqa: E402
from soak.load import Load, Record  # noqa: E402
from soak.stack import ATTACKER, MODEL_ID, Stack, StackSettings  # noqa: E402

ATTACKS = ("big_text_images", "json_values", "pixel_bomb", "deep_json", "flood", "slow_body", "drip_url")
SERVED = ("text", "new_image", "repeat", "near_duplicate", "other_tenant", "video", "answered", "stream")
AUTH = {"Authorization": f"Bearer {ATTACKER}", "Content-Type": "application/json"}


# --- the attacker's bodies ---

def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class Bodies:
    """The attack bodies, made once (the 50 MB one is spliced around fresh images per request)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        text = "lorem ipsum " * (50_000_000 // 12)
        self.big_head = (b'{"model":"' + MODEL_ID.encode() + b'","max_tokens":1,"messages":[{"role":"user",'
                         b'"content":[{"type":"text","text":"' + text.encode() + b'"}')
        self.tiny = Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8))
        self.values = [(b'{"model":"' + MODEL_ID.encode() + b'","messages":[{"role":"user","content":"hi"}],'
                        b'"stop_token_ids":[' + b",".join([item] * (16_000_000 // (len(item) + 1))) + b"]}")
                       for item in (b"{}", b"0.1", b'"ab"')]
        # A PNG that declares 6320 x 6320 pixels and compresses to ~170 KB; a few variants, so the gateway's memo
        # of decoded images does not answer the repeats.
        self.bombs = []
        for i in range(4):
            image = Image.new("L", (6320, 6320))
            image.putpixel((i, i), 255)
            self.bombs.append(_png(image))
        self.deep = (b'{"model":"' + MODEL_ID.encode() + b'","messages":[{"role":"user","content":"hi"}],'
                     b'"metadata":' + b"[" * 300 + b"]" * 300 + b"}")

    def big_text_images(self, serial: int) -> bytes:
        parts = []
        for i in range(16):
            image = self.tiny.copy()
            image.putpixel((i, 0), (serial % 256, serial // 256 % 256, i))
            parts.append(b',{"type":"image_url","image_url":{"url":"' + _data_url(_png(image)).encode() + b'"}}')
        return self.big_head + b"".join(parts) + b"]}]}"

    def pixel_bomb(self, serial: int) -> bytes:
        url = _data_url(self.bombs[serial % len(self.bombs)])
        return (b'{"model":"' + MODEL_ID.encode() + b'","max_tokens":1,"messages":[{"role":"user","content":['
                b'{"type":"image_url","image_url":{"url":"' + url.encode() + b'"}}]}]}')

    @staticmethod
    def with_url(url: str) -> bytes:
        return (b'{"model":"' + MODEL_ID.encode() + b'","max_tokens":1,"messages":[{"role":"user","content":['
                b'{"type":"image_url","image_url":{"url":"' + url.encode() + b'"}}]}]}')


class DripServer:
    """An HTTP server on loopback that answers every request with an image header, then a byte every 1.5 s."""

    def __init__(self) -> None:
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 1000000\r\n\r\n")
            while True:
                writer.write(b"\x89")
                await writer.drain()
                await asyncio.sleep(1.5)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


@dataclass
class Attack:
    url: str
    bodies: Bodies
    drip: DripServer
    statuses: Counter = field(default_factory=Counter)  # (kind, status) -> count
    serial: int = 0

    kinds: frozenset[str] = frozenset(ATTACKS)

    async def run(self, until: float) -> None:
        loops = [[k for k in kinds if k in self.kinds] for kinds in (
            ("big_text_images", "json_values"), ("pixel_bomb", "deep_json"), ("big_text_images", "pixel_bomb"),
            ("flood",), ("drip_url",), ("drip_url",))]
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256)) as client:
            await asyncio.gather(
                *(self._loop(client, until, tuple(kinds)) for kinds in loops if kinds),
                *(self._slow_body(until) for _ in range(2 if "slow_body" in self.kinds else 0)))

    async def _loop(self, client: httpx.AsyncClient, until: float, kinds: tuple[str, ...]) -> None:
        rng = random.Random(kinds[0])
        while time.monotonic() < until:
            kind = rng.choice(kinds)
            self.serial += 1
            try:
                if kind == "flood":
                    small = (b'{"model":"' + MODEL_ID.encode() + b'","max_tokens":1,"messages":[{"role":"user",'
                             b'"content":"flood ' + str(self.serial).encode() + b'"}]}')
                    answers = await asyncio.gather(*(self._post(client, small) for _ in range(100)),
                                                   return_exceptions=True)
                    for answer in answers:
                        self.statuses[(kind, answer if isinstance(answer, int) else type(answer).__name__)] += 1
                    continue
                if kind == "big_text_images":
                    body = await asyncio.to_thread(self.bodies.big_text_images, self.serial)
                elif kind == "json_values":
                    body = self.bodies.values[self.serial % len(self.bodies.values)]
                elif kind == "pixel_bomb":
                    body = self.bodies.pixel_bomb(self.serial)
                elif kind == "deep_json":
                    body = self.bodies.deep
                else:
                    body = self.bodies.with_url(f"http://127.0.0.1:{self.drip.port}/{self.serial}.png")
                self.statuses[(kind, await self._post(client, body))] += 1
            except httpx.HTTPError as exc:
                self.statuses[(kind, type(exc).__name__)] += 1
                await asyncio.sleep(0.2)

    async def _post(self, client: httpx.AsyncClient, body: bytes) -> int:
        response = await client.post(self.url + "/v1/chat/completions", content=body, headers=AUTH)
        return response.status_code

    async def _slow_body(self, until: float) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        while time.monotonic() < until:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {ATTACKER}"
                         "\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{".encode())
            status = "held"
            try:
                while time.monotonic() < until:
                    writer.write(b" ")
                    await writer.drain()
                    try:
                        line = await asyncio.wait_for(reader.readline(), 1.0)
                    except TimeoutError:
                        continue
                    status = line.split()[1].decode() if line.startswith(b"HTTP/") else "closed"
                    break
            except ConnectionError:
                status = "closed"
            finally:
                writer.close()
            self.statuses[("slow_body", status)] += 1


class Attacker:
    """The attacker's process: makes its bodies once, then runs an attack phase each time it is asked."""

    def __init__(self, url: str, kinds: frozenset[str], nice: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self.process = context.Process(target=_attacker_main, args=(child, url, kinds, nice), daemon=True)
        self.process.start()
        if self._pipe.recv() != "ready":
            raise RuntimeError("the attacker's process did not start")

    async def phase(self, until: float) -> Counter:
        """Attack until ``until`` (time.monotonic(), one clock for every process); what it sent, by status."""
        self._pipe.send(until)
        return Counter(await asyncio.to_thread(self._pipe.recv))

    def close(self) -> None:
        self._pipe.send(None)
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


def _attacker_main(pipe: Any, url: str, kinds: frozenset[str], nice: int) -> None:
    os.nice(nice)  # before any thread starts: threads inherit it

    async def serve() -> None:
        bodies = await asyncio.to_thread(Bodies)
        drip = DripServer()
        await drip.start()
        pipe.send("ready")
        try:
            while (until := await asyncio.to_thread(pipe.recv)) is not None:
                attack = Attack(url, bodies, drip, kinds=kinds)
                await attack.run(until)
                pipe.send(dict(attack.statuses))
        finally:
            await drip.close()

    asyncio.run(serve())


# --- measuring ---

class RssPeak(threading.Thread):
    """The gateway's peak RSS since the last reset: its process's own high-water mark as the kernel keeps it (VmHWM,
    reset per phase through /proc/PID/clear_refs), plus what any other process of its group holds (sampled every
    0.2 s). Sampling the RSS alone missed peaks shorter than its period: a 50 MB body's parse is ~0.1 s at 2x."""

    def __init__(self, stack: Stack) -> None:
        super().__init__(daemon=True)
        self.stack, self.peak, self.stopping = stack, 0, threading.Event()
        self.exact = True  # False where the kernel's mark could not be read or reset: sampled RSS alone

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            self.peak = max(self.peak, self.sample())

    def gateway_rss(self) -> int:
        return self.stack.rss_by_process().get("gateway", (0, 0))[1]

    def sample(self) -> int:
        """The group's RSS now, or, where the kernel's mark can be read, the gateway process's VmHWM plus the
        current RSS of the rest of its group."""
        pid, group = self.stack.rss_by_process().get("gateway", (0, 0))
        if not pid or not self.exact:
            return group
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            own, hwm = (int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "VmHWM"))
        except (OSError, KeyError, ValueError):
            return group
        return max(group, hwm + group - own)

    def reset(self) -> None:
        pid = self.stack.rss_by_process().get("gateway", (0, 0))[0]
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            self.exact = False
        self.peak = self.gateway_rss()


def split_cpus(stack: Stack, attacker: Attacker) -> str:
    """Pin the gateway (and this process, and the attacker's) to the first CPU and the workers to the others: every
    thread of every process of each part."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return f"not split ({len(cpus)} CPU)"
    half = max(1, len(cpus) // 4) if len(cpus) >= 8 else 1
    front, back = set(cpus[:half]), set(cpus[half:])
    assert stack.gateway is not None
    assert attacker.process.pid is not None
    parts = [(live_group_members(stack.gateway.pid), front), ([os.getpid(), attacker.process.pid], front)]
    parts += [(live_group_members(w.pid), back) for w in stack.workers]
    for pids, chosen in parts:
        for pid in pids:
            for task in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.sched_setaffinity(int(task), chosen)
                except OSError:
                    pass
    return f"gateway and load on CPU {sorted(front)}, workers on CPU {sorted(back)}"


def latencies(records: list[Record]) -> dict[str, list[float]]:
    by_kind: dict[str, list[float]] = {}
    for record in records:
        if record.outcome == "ok" and record.kind in SERVED and record.ended:
            by_kind.setdefault(record.kind, []).append(record.ended - record.started)
    by_kind["all"] = [t for kind in SERVED for t in by_kind.get(kind, [])]
    return by_kind


def p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def run(args: argparse.Namespace, stack: Stack, attacker: Attacker) -> None:
    rss = RssPeak(stack)
    rss.start()
    load = Load(stack.url, stack.worker_urls, seed=args.seed, check_share=0.0, worker_api_key=stack.worker_api_key)
    phases: list[dict] = []
    sent: Counter = Counter()  # the attacker's requests, (kind, status) -> count
    try:
        print("warming up (the mixed load alone)")
        await load.run(args.clients, time.monotonic() + args.warmup_s, 10**9)
        for index in range(2 * args.rounds):
            attacked = index % 2 == 1
            first = len(load.records)
            rss.reset()
            until = time.monotonic() + args.phase_s
            if attacked:
                _, statuses = await asyncio.gather(load.run(args.clients, until, 10**9), attacker.phase(until))
                sent.update(statuses)
            else:
                await load.run(args.clients, until, 10**9)
            records = load.records[first:]
            phase: dict[str, Any] = {"attacked": attacked, "latency": latencies(records), "rss": rss.peak,
                     "outcomes": Counter(r.outcome for r in records)}
            phases.append(phase)
            print(f"phase {index + 1} ({'attacked' if attacked else 'quiet'}): {len(records)} requests "
                  f"{dict(phase['outcomes'])}, p50 {p(phase['latency']['all'], 50) * 1e3:.0f} ms, "
                  f"gateway RSS peak {rss.peak / 2**20:.0f} MiB")
    finally:
        rss.stopping.set()
        await load.close()
    report(phases, sent, rss.exact)


def report(phases: list[dict], statuses: Counter, exact: bool) -> None:
    quiet = [ph for ph in phases if not ph["attacked"]]
    attacked = [ph for ph in phases if ph["attacked"]]

    def pooled(group: list[dict], kind: str) -> list[float]:
        return [t for ph in group for t in ph["latency"].get(kind, [])]

    print("\nthe tenants' latency (answered requests), quiet vs attacked phases pooled:")
    print(f"{'kind':16} {'n quiet':>8} {'n attacked':>11} {'p50 quiet':>10} {'p50 attacked':>13} {'ratio':>7}"
          f" {'p95 quiet':>10} {'p95 attacked':>13}")
    for kind in (*SERVED, "all"):
        q, a = pooled(quiet, kind), pooled(attacked, kind)
        if not q or not a:
            continue
        print(f"{kind:16} {len(q):8d} {len(a):11d} {p(q, 50) * 1e3:8.0f}ms {p(a, 50) * 1e3:11.0f}ms "
              f"{p(a, 50) / p(q, 50):6.2f}x {p(q, 95) * 1e3:8.0f}ms {p(a, 95) * 1e3:11.0f}ms")
    # The no-attack figure is the first quiet phase's: later ones include what the gateway kept from the attack.
    q_rss, a_rss = quiet[0]["rss"], max(ph["rss"] for ph in attacked)
    how = "the kernel's high-water mark" if exact else "sampled every 0.2 s"
    print(f"\ngateway RSS peak ({how}): before any attack {q_rss / 2**20:.0f} MiB, attacked {a_rss / 2**20:.0f} MiB "
          f"({a_rss / q_rss:.2f}x); per phase, in order: "
          + ", ".join(f"{'A' if ph['attacked'] else 'Q'} {ph['rss'] / 2**20:.0f}" for ph in phases))
    per_phase = [f"{'A' if ph['attacked'] else 'Q'} {statistics.median(ph['latency']['all']) * 1e3:.0f} ms"
                 for ph in phases if ph["latency"]["all"]]
    print("p50 per phase, in order: " + ", ".join(per_phase))
    print("\nthe attacker's requests (kind, status: count):")
    for (kind, status), count in sorted(statuses.items(), key=lambda item: (item[0][0], str(item[0][1]))):
        print(f"  {kind:16} {status!s:24} {count}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-s", type=float, default=90.0)
    parser.add_argument("--rounds", type=int, default=2, help="quiet-then-attacked pairs")
    parser.add_argument("--warmup-s", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=3, help="the mixed load's concurrent clients")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="which of the attacks to send (comma-separated)")
    parser.add_argument("--gateway-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the gateway (repeatable), e.g. REVISIT_ADMISSION_WORKER_REQUESTS_PER_KEY=4")
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="an argument for SGLang (repeatable), e.g. --worker-arg=--prefill-decode-interval "
                             "--worker-arg=4")
    parser.add_argument("--attacker-nice", type=int, default=19,
                        help="the attacker's process's nice value (19: it takes only what the gateway leaves idle)")
    args = parser.parse_args()
    if unknown := set(args.attacks.split(",")) - set(ATTACKS):
        parser.error(f"unknown attacks: {', '.join(sorted(unknown))}; known: {', '.join(ATTACKS)}")
    # Private image URLs allowed: the drip server is on loopback. The store sized as the soak's.
    if bad := [item for item in args.gateway_env if "=" not in item]:
        parser.error(f"--gateway-env takes NAME=VALUE, got {bad[0]!r}")
    extra = tuple(tuple(item.split("=", 1)) for item in args.gateway_env)
    settings = StackSettings(workers=args.workers, gateway_env=(("REVISIT_ALLOW_PRIVATE_IMAGE_URLS", "1"), *extra),
                             worker_args=tuple(args.worker_arg))
    stack = Stack.create(settings)
    attacker = None
    try:
        stack.start()
        attacker = Attacker(stack.url, frozenset(args.attacks.split(",")), args.attacker_nice)
        print(f"stack ready: gateway {stack.url}, workers {stack.worker_urls}; {split_cpus(stack, attacker)}; "
              f"the attacker at nice {args.attacker_nice}")
        asyncio.run(run(args, stack, attacker))
    finally:
        if attacker is not None:
            attacker.close()
        stack.close()


if __name__ == "__main__":
    main()
