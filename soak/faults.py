"""The faults the soak injects while the load runs, each followed by its checks.

    worker_killed_mid_prefill      SIGKILL of a worker's process group while its forward clock shows a forward
                                   running (engine_ext ForwardClock), then a restart on the same port
    worker_killed_mid_store_write  SIGKILL of the worker whose put is in flight (its temporary file is in the
                                   shared-memory tier), then a restart; the half-written entry must never appear
    gateway_killed                 SIGKILL of the gateway under load, then a restart: the books come back from
                                   the store and an image stored before the kill is an exact hit again
    lmdb_disk_full                 the LMDB tier's file system filled to the last byte while new images push
                                   entries down to it; then freed
    entry_bytes_flipped            one byte of a stored entry's K/V flipped in place; that image asked again must
                                   give plain SGLang's answer (a full prefill), never one read from the damage
    worker_hung                    SIGSTOP of a worker's process group for a while, then SIGCONT

After each: the next request is served, the store opens (``soak.store_check``) with no torn entry, and the fault's
own checks. A fault's window (from injection to recovery) explains the errors of requests that overlapped it
where the fault can cause them (``Fault.explains``): a killed gateway drops its connections, a killed worker cuts
the streams it was sending. A full disk, a damaged entry or a hung worker explains no error: requests must
succeed through them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

from plan.outcome import FORWARD_ENDED, FORWARD_STARTED
from soak.created import Created
from store.dram import TEMP_PREFIX
from store.entry import parse_header

if TYPE_CHECKING:
    from soak.run import Soak

KILL_BLAME_S = 10.0  # a killed worker's cut streams end at once; its other requests are retried elsewhere
HANG_S = 30.0  # three unanswered checks of 2 s /health + 2 s /metrics each take a hung worker out


@dataclass
class FaultResult:
    name: str
    started: float
    ended: float = 0.0
    injected: bool = True
    detail: str = ""
    checks: dict[str, bool] = field(default_factory=dict)
    explains: bool = False  # whether errors of requests overlapping this window are this fault's
    blame_until: float | None = None  # where the errors it can cause end, if before ``ended`` (a restart's wait)

    @property
    def survived(self) -> bool:
        return self.injected and bool(self.checks) and all(self.checks.values())

    def as_dict(self) -> dict:
        return {"name": self.name, "injected": self.injected, "survived": self.survived, "detail": self.detail,
                "checks": self.checks, "seconds": round(self.ended - self.started, 1)}


Fault = Callable[["Soak", FaultResult], Awaitable[None]]


# --- the faults ---


async def worker_killed_mid_prefill(soak: Soak, result: FaultResult) -> None:
    result.explains = True
    index = await _busy_worker(soak, timeout=60)
    if index is None:
        result.injected, result.detail = False, "no worker was seen mid-forward in 60 s"
        return
    await asyncio.to_thread(soak.stack.kill_worker, index)
    result.blame_until = time.monotonic() + KILL_BLAME_S
    result.checks["the next request is served (by the other worker)"] = await soak.served()
    restarted = await asyncio.to_thread(soak.stack.restart_worker, index)
    result.detail = f"worker {index} killed mid-forward; back in {restarted:.0f} s"
    result.checks["the gateway sees the worker back"] = await soak.all_workers_healthy()


async def worker_killed_mid_store_write(soak: Soak, result: FaultResult) -> None:
    """Watch the shared-memory tier for a put's temporary file being made while new images arrive; kill its writer."""
    result.explains = True
    dram = soak.stack.store.dram_path
    stop = asyncio.Event()
    groups = {worker.pid for worker in soak.stack.workers}  # each worker leads its process group

    def watch() -> tuple[str, int, int] | None:
        deadline = time.monotonic() + 90
        with Created(dram) as created:
            while time.monotonic() < deadline and not stop.is_set():
                for name in created.names(timeout=0.2):
                    if not name.startswith(TEMP_PREFIX):
                        continue
                    pid = int(name[len(TEMP_PREFIX):].split(".", 1)[0])
                    try:  # a worker's (the gateway writes here too, promoting): frozen mid-write at once, killed
                        group = os.getpgid(pid)  # below (Stack.kill_worker) as a crash here would kill it
                        if group not in groups:
                            continue
                        os.killpg(group, signal.SIGSTOP)
                    except (ProcessLookupError, PermissionError):
                        continue
                    return name, pid, group
        return None

    async def feed() -> None:
        rng = random.Random("store-write")
        while not stop.is_set():
            await soak.load.send("new_image", 0, rng)

    feeder = asyncio.create_task(feed())
    try:
        seen = await asyncio.to_thread(watch)
        if seen is None:
            result.injected, result.detail = False, "no store write was caught in 90 s"
            return
        name, pid, group = seen
        key = name[len(TEMP_PREFIX):].split(".")[1]
        index = soak.stack.worker_of(pid)
        if index is None:  # it exited meanwhile: let the rest of its group run on
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGCONT)
            result.injected, result.detail = False, f"the writer {pid} was gone before it was stopped"
            return
        torn = (dram / name).exists()
        # At once: requests sent to the frozen worker meanwhile wait on it, the feeder's among them.
        await asyncio.to_thread(soak.stack.kill_worker, index)
        result.blame_until = time.monotonic() + KILL_BLAME_S
    finally:
        stop.set()
        await asyncio.gather(feeder, return_exceptions=True)
    result.checks["the next request is served (by the other worker)"] = await soak.served()
    restarted = await asyncio.to_thread(soak.stack.restart_worker, index)
    result.detail = (f"worker {index} killed {'with its put half-written' if torn else 'as its put ended'} "
                     f"({key[:12]}); back in {restarted:.0f} s")
    result.checks["the gateway sees the worker back"] = await soak.all_workers_healthy()
    store = await soak.store_check()
    # The gateway may have retried the request on the other worker, which stores the same key: then it must read.
    result.checks["no torn entry in the store (every entry reads verified)"] = store.get("damaged") == 0
    result.checks["no temporary file of a dead writer is left"] = not store.get("orphan_temp_files")


async def gateway_killed(soak: Soak, result: FaultResult) -> None:
    result.explains = True
    before = await soak.store_check()
    stored = [key for key in soak.load.keys if key in set(before.get("keys", ()))]
    await soak.read_loop_lag()  # what this gateway measured, before it goes
    await asyncio.to_thread(soak.stack.kill_gateway)
    await asyncio.sleep(1.0)  # the load meets a closed port meanwhile
    restarted = await asyncio.to_thread(soak.stack.start_gateway)
    result.blame_until = time.monotonic() + 1.0
    result.detail = f"gateway killed with {len(before.get('keys', ()))} entries stored; back in {restarted:.1f} s"
    result.checks["the next request is served"] = await soak.served()
    books = await soak.books_entries()
    result.checks["the restarted gateway's books hold the stored entries"] = books >= len(stored) > 0
    if stored:
        tenant, panel = soak.load.keys[stored[-1]]
        record, check = await soak.load.ask_checked("probe", tenant, panel)
        result.checks["an image stored before the kill is an exact hit"] = record.reuse.startswith("exact")
        result.detail += f"; the stored image asked again: {record.reuse or record.outcome}"
        result.checks["with plain SGLang's answer"] = check is not None and not check.wrong


async def lmdb_disk_full(soak: Soak, result: FaultResult) -> None:
    stack = soak.stack
    if not stack.disk_mounted:
        result.injected, result.detail = False, "the LMDB tier needs a tmpfs of its own (mount: root only)"
        return
    filler = stack.root / "disk" / "filler"
    filled = await asyncio.to_thread(_fill, filler)
    before = await soak.demotions()
    rng = random.Random("disk-full")
    records = [await soak.load.send("new_image", 0, rng) for _ in range(soak.plan.disk_full_images)]
    after = await soak.demotions()
    result.detail = (f"{filled >> 20} MiB written to fill the disk ({stack.disk_free_bytes()} bytes left); "
                     f"{len(records)} new images sent, demotions tried {after - before}")
    result.checks["every request served on a full disk"] = all(r.outcome == "ok" for r in records)
    result.checks["the gateway stays healthy"] = await soak.all_workers_healthy()
    filler.unlink()
    result.checks["the next request is served once freed"] = await soak.served()
    # Entries that could not go down were dropped, not left in DRAM outside the books' capacities. The load goes on
    # meanwhile, so the books are compared with what the store held both before and after a books pass: an entry
    # stored throughout that the books do not hold is bytes outside every capacity.
    held = await soak.store_check()
    booked = await soak.booked_keys()
    store = await soak.store_check()
    result.checks["the store opens with no damaged entry"] = store.get("opened", False) and store["damaged"] == 0
    stray = (set(held.get("keys", ())) & set(store.get("keys", ()))) - booked
    result.detail += (f"; books {len(booked)}, store {len(store.get('keys', ()))} entries, {len(stray)} stored "
                      "throughout and not booked")
    result.checks["the books hold what the store holds"] = not stray and bool(booked)


async def entry_bytes_flipped(soak: Soak, result: FaultResult) -> None:
    dram = soak.stack.store.dram_path
    candidates = [key for key in reversed(soak.load.keys) if (dram / f"{key}.kv").exists()]
    if not candidates:
        result.injected, result.detail = False, "no entry of a known image in the shared-memory tier"
        return
    key = candidates[0]
    path = dram / f"{key}.kv"
    offset = await asyncio.to_thread(_flip_kv_byte, path)
    tenant, panel = soak.load.keys[key]
    # Text before the image: SGLang's prefix cache cannot hold these image tokens, so only the store can give them.
    record, check = await soak.load.ask_checked("probe", tenant, panel, lead=f"Again ({time.time():.3f}):")
    result.detail = f"byte {offset} of {key[:12]}'s K/V flipped; asked again: {record.reuse or record.outcome}"
    result.checks["the image is answered"] = record.outcome == "ok"
    result.checks["with plain SGLang's answer"] = check is not None and not check.wrong
    # Reads verify each block they take: the damaged one is caught, and what it held is computed (a fallback to a
    # full prefill, or the rows computed from the damaged layer on: "degraded").
    result.checks["the damage was caught, not used"] = any(
        mark in record.reuse for mark in ("fallback=entry_damaged", "degraded=kv_read_failed", "fallback=kv_read"))
    path.unlink(missing_ok=True)  # an operator's repair: the books drop it at their next pass
    store = await soak.store_check()
    result.checks["the store opens"] = store.get("opened", False)


async def worker_hung(soak: Soak, result: FaultResult) -> None:
    index = soak.rng.randrange(len(soak.stack.workers))
    await asyncio.to_thread(soak.stack.signal_worker, index, signal.SIGSTOP)
    try:
        down = await soak.worker_marked_down(soak.stack.worker_urls[index], timeout=HANG_S - 2)
        result.checks["the gateway marks the hung worker down"] = down
        result.checks["the next request is served (by the other worker)"] = await soak.served()
        await asyncio.sleep(max(0.0, HANG_S - (time.monotonic() - result.started)))
    finally:
        await asyncio.to_thread(soak.stack.signal_worker, index, signal.SIGCONT)
    result.detail = f"worker {index} stopped for {time.monotonic() - result.started:.0f} s"
    result.checks["the gateway sees the worker back"] = await soak.all_workers_healthy()


FAULTS: dict[str, Fault] = {f.__name__: f for f in (
    worker_killed_mid_prefill, worker_killed_mid_store_write, gateway_killed, lmdb_disk_full, entry_bytes_flipped,
    worker_hung)}


# --- helpers ---


async def _busy_worker(soak: Soak, timeout: float) -> int | None:
    """The first worker seen mid-forward (its forward clock's start after its end), polled every 20 ms."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            for index, url in enumerate(soak.stack.worker_urls):
                try:
                    text = (await http.get(url + "/metrics")).text
                except httpx.HTTPError:
                    continue
                clock = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                         if s.name in (FORWARD_STARTED, FORWARD_ENDED)}
                if clock.get(FORWARD_STARTED, 0) > clock.get(FORWARD_ENDED, 0):
                    return index
            await asyncio.sleep(0.02)
    return None


def _fill(path) -> int:
    """Write zeros to ``path`` until its file system is full; bytes written."""
    written = 0
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    return written
                chunk = chunk[: len(chunk) // 2]


def _flip_kv_byte(path) -> int:
    """Flip one byte in the middle of the entry's K/V, in place (readers that mapped it see it too)."""
    with open(path, "r+b") as f:
        data = f.read()
        kv = parse_header(memoryview(data)).header.kv_range
        offset = (kv.start + kv.stop) // 2
        f.seek(offset)
        f.write(bytes([data[offset] ^ 0xFF]))
        return offset
