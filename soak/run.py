"""One soak: the stack started, the load sent, the faults injected in turn, every request accounted for.

:class:`SoakPlan` says how long and how hard; :func:`run_soak` runs it and returns a :class:`SoakReport`, which
says whether it passed: no unexplained error (see soak.load for outcomes, soak.faults for what a fault explains),
no lost request, no wrong answer among the checked ones, every fault injected and survived, and nothing left in
/dev/shm once the stack is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from soak.faults import FAULTS, FaultResult
from soak.load import Load, Record
from soak.stack import ADMIN, Stack, StackSettings, shm_files

MiB = 1 << 20


@dataclass(frozen=True)
class SoakPlan:
    minutes: float = 30.0  # the load's length; faults repeat, in turn, until it is over
    max_requests: int = 100_000
    clients: int = 3  # concurrent clients (this machine has 2 cores)
    faults: tuple[str, ...] = tuple(FAULTS)
    once: bool = False  # each fault once, then stop (the short form CI runs)
    warmup_s: float = 30.0  # load before the first fault, so the cache holds entries to hit and to damage
    gap_s: float = 20.0  # load between faults
    check_share: float = 0.3
    disk_full_images: int = 6
    seed: int = 0


@dataclass
class SoakReport:
    plan: dict
    stack: dict
    seconds: float = 0.0
    requests: dict[str, dict[str, int]] = field(default_factory=dict)
    reuse: dict[str, int] = field(default_factory=dict)
    explained: dict[str, int] = field(default_factory=dict)  # errors per fault that explains them
    unexplained: list[str] = field(default_factory=list)
    checked: int = 0
    checks_skipped: int = 0
    wrong: list[dict] = field(default_factory=list)
    right_vs_truth: float = 0.0
    faults: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    loop_lag: dict = field(default_factory=dict)
    store: dict = field(default_factory=dict)
    # The gateway's log lines on worker health (up, down, requests sent elsewhere), stamped: what explains an error
    # that no fault does.
    worker_changes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (not self.unexplained and not self.wrong and bool(self.faults)
                and all(f["survived"] for f in self.faults) and not self.memory.get("shm_left_after_stop")
                and self.store.get("books_entries") == self.store.get("stored_entries"))

    def as_dict(self) -> dict:
        return {"passed": self.passed, **self.__dict__}

    def markdown(self) -> str:
        total = sum(sum(by.values()) for by in self.requests.values())
        lines = [f"# Soak: {'passed' if self.passed else 'FAILED'}", "",
                 f"{total} requests in {self.seconds / 60:.1f} min; {self.checked} answers checked against plain "
                 f"SGLang, {len(self.wrong)} wrong; {len(self.unexplained)} unexplained errors.", "",
                 "| kind | " + " | ".join(OUTCOME_COLUMNS) + " |", "|---|" + "---|" * len(OUTCOME_COLUMNS)]
        for kind, by in self.requests.items():
            lines.append(f"| {kind} | " + " | ".join(str(by.get(o, 0)) for o in OUTCOME_COLUMNS) + " |")
        lines += ["", "| fault | survived | seconds | detail |", "|---|---|---|---|"]
        for fault in self.faults:
            survived = "yes" if fault["survived"] else ("not injected" if not fault["injected"] else "NO")
            lines.append(f"| {fault['name']} | {survived} | {fault['seconds']} | {fault['detail']} |")
            lines += [f"|  | {'ok' if ok else 'FAILED'} |  | {check} |" for check, ok in fault["checks"].items()]
        lines += ["", f"Errors explained by a fault: {json.dumps(self.explained)}",
                  f"Reuse kinds served: {json.dumps(self.reuse)}",
                  f"Checked field answers equal to the panel's truth: {self.right_vs_truth:.1%}",
                  f"Memory: {json.dumps({k: v for k, v in self.memory.items() if k != 'rss_by_process'})}",
                  f"The gateway's event-loop lag: {json.dumps(self.loop_lag)}",
                  f"Store at the end: {json.dumps(self.store)}"]
        lives = [life for life in self.memory.get("rss_by_process", ()) if life["samples"] > 1]
        if lives:
            lines += ["", "| process (pid) | sampled, min | RSS first, MiB | RSS last, MiB |", "|---|---|---|---|"]
            lines += [f"| {life['process']} ({life['pid']}) | {life['from_min']}-{life['to_min']} | "
                      f"{life['first_mib']} | {life['last_mib']} |" for life in lives]
        lines += ["", "Unexplained:", *[f"- {u}" for u in self.unexplained[:50]]] if self.unexplained else []
        if self.unexplained:
            lines += ["", "Worker health as the gateway saw it:", *[f"- {c}" for c in self.worker_changes[-80:]]]
        lines += ["", "Wrong answers:", *[f"- {w}" for w in self.wrong[:50]]] if self.wrong else []
        return "\n".join(lines) + "\n"


OUTCOME_COLUMNS = ("ok", "refused", "cancelled", "error", "unexpected", "lost")


class Soak:
    """The running soak, as the faults see it: the stack, the load and the checks they share."""

    def __init__(self, stack: Stack, plan: SoakPlan, say: Callable[[str], None]) -> None:
        self.stack = stack
        self.plan = plan
        self.say = say
        self.rng = random.Random(f"faults:{plan.seed}")
        self.load = Load(stack.url, stack.worker_urls, seed=plan.seed, check_share=plan.check_share,
                         worker_api_key=stack.worker_api_key)
        self.results: list[FaultResult] = []
        self.probe_seconds: list[float] = []  # how long each of served()'s requests took
        self.loop_lag: Counter[str] = Counter()  # the gateway's loop-lag histogram (cumulative buckets), summed
        # over its lives (a killed gateway's figures are read just before it is killed)
        self.rss_samples: list[tuple[float, dict[str, tuple[int, int]]]] = []  # (minute, Stack.rss_by_process())

    # --- checks the faults share ---

    async def served(self) -> bool:
        """The next requests, a chat and a new image, are answered."""
        rng = random.Random(f"probe:{len(self.load.records)}")
        text = await self.load.send("probe", 0, rng, self.load._text)
        image = await self.load.send("probe", 1, rng, self.load._new_image)
        self.probe_seconds += [text.ended - text.started, image.ended - image.started]
        return text.outcome == image.outcome == "ok"

    async def _health(self) -> dict | None:
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                return (await http.get(self.stack.url + "/health")).json()
        except (httpx.HTTPError, ValueError):
            return None

    async def all_workers_healthy(self, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = await self._health()
            if health and all(w["healthy"] for w in health["workers"]):
                return True
            await asyncio.sleep(0.25)
        return False

    async def worker_marked_down(self, url: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = await self._health()
            if health and any(w["url"] == url and not w["healthy"] for w in health["workers"]):
                return True
            await asyncio.sleep(0.25)
        return False

    async def store_check(self) -> dict:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "soak.store_check", env={**os.environ, **self.stack.store_env()},
            stdout=asyncio.subprocess.PIPE)
        out, _ = await process.communicate()
        try:
            return json.loads(out)
        except ValueError:
            return {"opened": False, "error": out.decode(errors="replace")[-500:]}

    async def stats(self) -> dict:
        async with httpx.AsyncClient(timeout=30) as http:
            return (await http.get(self.stack.url + "/admin/stats", headers=ADMIN)).json()

    async def books_entries(self) -> int:
        """The entries the gateway's books hold, once a books pass has run since now."""
        await asyncio.sleep(self.stack.settings.books_interval_s * 1.5)
        stats = await self.stats()
        return sum(tier["entries"] for tier in stats["tiers"].values())

    async def booked_keys(self) -> set[str]:
        """The keys the gateway's books hold, once a books pass has run since now (/admin/entries, page by page)."""
        await asyncio.sleep(self.stack.settings.books_interval_s * 1.5)
        keys: set[str] = set()
        cursor = None
        async with httpx.AsyncClient(timeout=30) as http:
            while True:
                page = (await http.get(self.stack.url + "/admin/entries", headers=ADMIN,
                                       params={"limit": 1000, **({"cursor": cursor} if cursor else {})})).json()
                keys.update(entry["key"] for entry in page["data"])
                if not page["has_more"]:
                    return keys
                cursor = page["next_cursor"]

    async def read_loop_lag(self) -> None:
        """Add the running gateway's event-loop lag histogram (revisit_event_loop_lag_seconds) to the tally."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            async with httpx.AsyncClient(timeout=30) as http:
                text = (await http.get(self.stack.url + "/metrics")).text
        except httpx.HTTPError:
            return
        for family in text_string_to_metric_families(text):
            if family.name == "revisit_event_loop_lag_seconds":
                for sample in family.samples:
                    if sample.name.endswith("_bucket"):
                        self.loop_lag[sample.labels["le"]] += int(sample.value)

    def loop_lag_summary(self) -> dict:
        """Samples of the gateway's loop lag (one per 10 ms) and the share above 50 ms, 100 ms, 250 ms and 1 s."""
        total = self.loop_lag.get("+Inf", 0)
        above = {f"over_{float(le) * 1000:.0f}ms": round(1 - self.loop_lag.get(le, 0) / max(1, total), 5)
                 for le in ("0.05", "0.1", "0.25", "1.0")}
        return {"samples": total, **above}

    async def demotions(self) -> int:
        return int((await self.stats())["decisions"].get("demote", 0))

    # --- running ---

    async def run(self, report: SoakReport) -> None:
        plan = self.plan
        started = time.monotonic()
        deadline = started + plan.minutes * 60
        load = asyncio.create_task(self.load.run(plan.clients, deadline, plan.max_requests))
        ticker = asyncio.create_task(self._tick(started))
        try:
            await self._sleep_or_done(plan.warmup_s, load)
            report.memory["rss_after_warmup_mib"] = round(self.stack.rss_bytes() / MiB)
            rounds = 0
            while not load.done() and (rounds == 0 or not plan.once):
                for name in plan.faults:
                    if load.done() or time.monotonic() > deadline:
                        break
                    await self._inject(name)
                    await self._sleep_or_done(plan.gap_s, load)
                rounds += 1
            if plan.once:
                self.load.stopping.set()
            await load
        finally:
            ticker.cancel()
            self.load.stopping.set()
            await asyncio.gather(load, return_exceptions=True)
        report.seconds = time.monotonic() - started

    async def _inject(self, name: str) -> None:
        result = FaultResult(name=name, started=time.monotonic())
        self.say(f"fault: {name}")
        self.probe_seconds = []
        try:
            await FAULTS[name](self, result)
        except Exception as exc:  # a fault that breaks the soak's own step is a failed fault, reported
            result.checks["the fault ran to its end"] = False
            result.detail += f" raised {type(exc).__name__}: {exc}"
        result.ended = time.monotonic()
        if self.probe_seconds:
            result.detail += f"; next requests answered in {', '.join(f'{t:.1f}' for t in self.probe_seconds)} s"
        store = await self.store_check()
        result.checks["the store opens"] = store.get("opened", False)
        self.results.append(result)
        verdict = "survived" if result.survived else ("not injected" if not result.injected else "FAILED")
        self.say(f"  {verdict} in {result.ended - result.started:.0f} s (from {self.clock(result.started)}): "
                 f"{result.detail}")
        for check, ok in result.checks.items():
            if not ok:
                self.say(f"  check failed: {check}")

    @staticmethod
    async def _sleep_or_done(seconds: float, task: asyncio.Task) -> None:
        await asyncio.wait([task], timeout=seconds)

    async def _tick(self, started: float) -> None:
        while True:
            await asyncio.sleep(60)
            outcomes = Counter(r.outcome for r in self.load.records)
            minute = (time.monotonic() - started) / 60
            rss = self.stack.rss_by_process()
            self.rss_samples.append((minute, rss))
            self.say(f"{minute:.0f} min: {len(self.load.records)} requests "
                     f"{dict(outcomes)}; {len(self.load.checks)} checked, "
                     f"{sum(c.wrong for c in self.load.checks)} wrong; RSS MiB "
                     + ", ".join(f"{name} {size / MiB:.0f}" for name, (_, size) in sorted(rss.items())))

    def rss_lifetimes(self) -> list[dict]:
        """Per process of the stack (a restarted one is a new process), its RSS at the first and the last minute
        it was sampled: what a leak would show as growth that does not level off."""
        lives: dict[tuple[str, int], dict] = {}
        for minute, rss in self.rss_samples:
            for name, (pid, size) in rss.items():
                life = lives.setdefault((name, pid), {"process": name, "pid": pid, "from_min": round(minute, 1),
                                                      "first_mib": round(size / MiB), "samples": 0})
                life.update(to_min=round(minute, 1), last_mib=round(size / MiB), samples=life["samples"] + 1)
        return sorted(lives.values(), key=lambda life: (life["process"], life["from_min"]))

    # --- accounting ---

    def account(self, report: SoakReport) -> None:
        load = self.load
        report.requests = {kind: dict(Counter(r.outcome for r in load.records if r.kind == kind))
                           for kind in dict.fromkeys(r.kind for r in load.records)}
        report.reuse = load.reuse_kinds()
        explained: Counter[str] = Counter()
        for record in load.records:
            if record.outcome in ("ok", "refused", "cancelled"):
                continue
            blame = self._blame(record) if record.outcome == "error" else None
            if blame is not None:
                explained[blame] += 1
            else:
                report.unexplained.append(f"at {self.clock(record.started)}: {_describe(record)}")
        report.explained = dict(explained)
        report.checked, report.checks_skipped = len(load.checks), load.checks_skipped
        report.wrong = [c.__dict__ for c in load.checks if c.wrong]
        with_truth = [c for c in load.checks if c.truth]  # field questions about one panel
        report.right_vs_truth = sum(c.answer == c.truth for c in with_truth) / max(1, len(with_truth))
        report.faults = [r.as_dict() for r in self.results]

    def clock(self, monotonic: float) -> str:
        """A moment of the soak as the wall clock the stack's logs are stamped with (HH:MM:SS)."""
        return time.strftime("%H:%M:%S", time.localtime(time.time() - time.monotonic() + monotonic))

    def _blame(self, record: Record) -> str | None:
        """The fault whose window this errored request overlapped, where that fault can cause errors."""
        for result in self.results:
            until = result.blame_until if result.blame_until is not None else result.ended
            if result.explains and record.started <= until + 1.0 and record.ended >= result.started - 1.0:
                return result.name
        return None


def _describe(record: Record) -> str:
    return f"{record.kind} ({record.outcome}, {record.ended - record.started:.1f} s): {record.detail}"


def run_soak(plan: SoakPlan, settings: StackSettings | None = None, say: Callable[[str], None] = print,
             logs: Path | None = None) -> SoakReport:
    """Run the soak; ``logs``: where the gateway's and the workers' logs are copied before the stack goes."""
    baseline = shm_files()
    stack = Stack.create(settings or StackSettings(), on_progress=say)
    report = SoakReport(plan=plan.__dict__, stack=stack.describe())
    try:
        stack.start(on_progress=say)
        say(f"stack ready: gateway {stack.url}, workers {stack.worker_urls}")
        report.memory["rss_at_start_mib"] = round(stack.rss_bytes() / MiB)
        report.memory["shm_at_start"] = _shm_summary(shm_files())
        soak = Soak(stack, plan, say)

        async def main() -> None:
            try:
                await soak.run(report)
                report.store["books_entries"] = await soak.books_entries()
                await soak.read_loop_lag()
                report.loop_lag = soak.loop_lag_summary()
                checked = await soak.store_check()
                report.store.update({k: v for k, v in checked.items() if k != "keys"})
                report.store["stored_entries"] = len(checked.get("keys", ()))
            finally:
                await soak.load.close()

        asyncio.run(main())
        soak.account(report)
        report.memory["rss_at_end_mib"] = round(stack.rss_bytes() / MiB)
        report.memory["rss_by_process"] = soak.rss_lifetimes()
        report.memory["shm_at_end"] = _shm_summary(shm_files())
    finally:
        report.worker_changes = _worker_changes(stack.root / "logs")
        if logs is not None:
            shutil.copytree(stack.root / "logs", logs, dirs_exist_ok=True)
        stack.close()
    left = sorted(set(shm_files()) - set(baseline))
    report.memory["shm_left_after_stop"] = left
    return report


def _worker_changes(logs: Path) -> list[str]:
    """The gateway's lines on worker health from its logs (one per start), in order."""
    lines: list[str] = []
    for log in sorted(logs.glob("gateway-*.log"), key=lambda path: int(path.stem.rpartition("-")[2])):
        with contextlib.suppress(OSError):
            lines += [line[:300] for line in log.read_text(errors="replace").splitlines()
                      if " gateway.workers: " in line]
    return lines


def _shm_summary(files: dict[str, int]) -> dict:
    return {"files": len(files), "mib": round(sum(files.values()) / MiB, 1)}
