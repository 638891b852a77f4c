"""What the soak runs against: two real SGLang workers serving the oracle reader, a real ``revisit gateway``
process in front of them, and a store of its own (shared-memory files + LMDB) that nothing else uses.

Everything the soak kills it can start again on the same port: :meth:`Stack.kill_worker` /
:meth:`Stack.restart_worker`, :meth:`Stack.kill_gateway` / :meth:`Stack.start_gateway`. The LMDB tier lies on a
small tmpfs of its own where the soak may mount one (root), so it can really fill up; elsewhere the full-disk
fault is reported as not injected.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bundled import ORACLE, QWEN2_5_VL, build_model
from launcher import WorkerProcess, WorkerSpec, live_group_members, start_worker
from settings.secret import DataPlaneSecret, worker_api_key
from store.config import StoreConfig

MODEL_ID = "revisit-oracle"
ADMIN_TOKEN = "soak-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TENANTS = ("sk-soak-tenant-a", "sk-soak-tenant-b")  # two API keys: two namespaces (gateway.tenancy)
ATTACKER = "sk-soak-attacker"  # a third listed key, which the mixed load never uses (bench/dos_under_load.py)
SHM = Path("/dev/shm")
WORKER_READY_S = 600.0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class StackSettings:
    """Sizes chosen so that a short soak demotes entries to LMDB and can fill the disk under it."""

    workers: int = 2
    dram_capacity_bytes: int = 8 << 20  # the books' L2 size (some 40 entries): newer images push older ones to LMDB
    lmdb_capacity_bytes: int = 112 << 20  # headroom on its disk for LMDB's own pages and the features database
    disk_bytes: int = 192 << 20  # the tmpfs the LMDB tier lies on
    upstream_timeout_s: float = 90.0  # a hung worker's requests end with a 504 after this
    health_interval_s: float = 0.5
    health_timeout_s: float = 2.0  # SGLang answers /health in 1 s at best
    books_interval_s: float = 2.0
    gateway_env: tuple[tuple[str, str], ...] = ()  # more REVISIT_* settings for the gateway
    worker_args: tuple[str, ...] = ()  # more arguments for SGLang, last on each worker's command line


@dataclass
class Stack:
    settings: StackSettings
    root: Path  # logs, the LMDB disk
    store: StoreConfig
    model_path: Path
    disk_mounted: bool
    worker_ports: list[int]
    gateway_port: int
    workers: list[WorkerProcess] = field(default_factory=list)
    gateway: subprocess.Popen[bytes] | None = None
    gateway_starts: int = 0

    # --- life cycle ---

    @classmethod
    def create(cls, settings: StackSettings, on_progress=print) -> Stack:
        root = Path(tempfile.mkdtemp(prefix="revisit-soak-"))
        disk = root / "disk"
        disk.mkdir()
        mounted = _mount_tmpfs(disk, settings.disk_bytes)
        name = f"soak-{uuid.uuid4().hex[:10]}"
        secret = root / "secret"  # the deployment secret the gateway and the workers share (settings/secret.py)
        DataPlaneSecret.create(secret)
        store = StoreConfig(name=name, dram_dir=SHM / f"revisit-store-{name}", lmdb_dir=disk / "lmdb",
                            lmdb_map_size=settings.disk_bytes * 2, pin_host_memory=False, lmdb_sync=False,
                            secret_file=secret)
        on_progress("building the oracle reader (cached after the first build)")
        model_path = build_model(QWEN2_5_VL, ORACLE, on_progress=on_progress)
        stack = cls(settings=settings, root=root, store=store, model_path=model_path, disk_mounted=mounted,
                    worker_ports=[free_port() for _ in range(settings.workers)], gateway_port=free_port())
        (root / "logs").mkdir()
        return stack

    def start(self, on_progress=print) -> None:
        on_progress(f"starting {self.settings.workers} SGLang workers (logs in {self.root / 'logs'})")
        self.workers = [self._launch_worker(i) for i in range(self.settings.workers)]
        for worker in self.workers:
            worker.wait_ready(WORKER_READY_S)
        self.start_gateway()

    def close(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.send_signal(signal.SIGTERM)
            try:
                self.gateway.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.gateway.pid, signal.SIGKILL)
                self.gateway.wait(timeout=10)
        for worker in self.workers:
            worker.stop()
        for path in (self.store.dram_path, self.store.outcomes_path):
            shutil.rmtree(path, ignore_errors=True)
        if self.disk_mounted:
            subprocess.run(["umount", "-l", str(self.root / "disk")], check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    # --- workers ---

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.worker_ports]

    @property
    def worker_api_key(self) -> str | None:
        """What the workers take requests with (derived from the deployment secret, as the gateway derives it)."""
        return worker_api_key(DataPlaneSecret.read(self.store.secret_file))

    def store_env(self) -> dict[str, str]:
        s = self.store
        return {"REVISIT_STORE_NAME": s.name, "REVISIT_STORE_DRAM_DIR": str(s.dram_path),
                "REVISIT_STORE_LMDB_DIR": str(s.lmdb_path), "REVISIT_STORE_LMDB_MAP_SIZE": str(s.lmdb_map_size),
                "REVISIT_STORE_PIN_HOST_MEMORY": "0", "REVISIT_STORE_LMDB_SYNC": "0",
                "REVISIT_STORE_SECRET_FILE": str(s.secret_file)}

    def _launch_worker(self, index: int) -> WorkerProcess:
        spec = WorkerSpec(model_path=self.model_path, port=self.worker_ports[index], served_model_name=MODEL_ID,
                          log_file=self.root / "logs" / f"worker-{index}.log", env=self.store_env(),
                          extra_args=self.settings.worker_args)
        return start_worker(spec)

    def kill_worker(self, index: int) -> None:
        """SIGKILL, as a crash; what SGLang leaves in /dev/shm then goes too, as a supervisor removes it."""
        self.workers[index].kill()

    def restart_worker(self, index: int) -> float:
        """Start the worker again on its port; seconds until it was ready."""
        started = time.monotonic()
        self.workers[index] = self._launch_worker(index)
        self.workers[index].wait_ready(WORKER_READY_S)
        return time.monotonic() - started

    def worker_of(self, pid: int) -> int | None:
        """The index of the worker whose process group holds ``pid``."""
        for index, worker in enumerate(self.workers):
            if pid in worker.live_processes():
                return index
        return None

    def signal_worker(self, index: int, sig: signal.Signals) -> None:
        os.killpg(self.workers[index].pid, sig)

    # --- the gateway ---

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def start_gateway(self, timeout: float = 120.0) -> float:
        started = time.monotonic()
        s = self.settings
        env = {**os.environ, **self.store_env(), "REVISIT_MODEL": MODEL_ID,
               "REVISIT_WORKERS": ",".join(self.worker_urls), "REVISIT_MODEL_DIR": str(self.model_path),
               "REVISIT_ADMIN_TOKEN": ADMIN_TOKEN,
               # Every plan sent, whether it pays on the oracle reader or not: the soak's faults meet every reuse path.
               "REVISIT_PLAN_BY_COST": "0",
               "REVISIT_DRAM_CAPACITY_BYTES": str(s.dram_capacity_bytes),
               "REVISIT_LMDB_CAPACITY_BYTES": str(s.lmdb_capacity_bytes),
               "REVISIT_UPSTREAM_TIMEOUT_S": str(s.upstream_timeout_s),
               "REVISIT_HEALTH_INTERVAL_S": str(s.health_interval_s),
               "REVISIT_HEALTH_TIMEOUT_S": str(s.health_timeout_s),
               "REVISIT_BOOKS_INTERVAL_S": str(s.books_interval_s),
               # The response cache's exact level for the "answered" kind (no sentence embedder needed).
               "REVISIT_RESPONSE_CACHE_NAMESPACES": "*", "REVISIT_RESPONSE_CACHE_MAX_LEVEL": "exact"}
        # Keys mode, the default of `revisit gateway`: the tenants' keys are listed (by digest), one namespace each.
        keys = self.root / "api-keys"
        keys.write_text("".join(f"soak-{i} sha256:{hashlib.sha256(key.encode()).hexdigest()}\n"
                                for i, key in enumerate((*TENANTS, ATTACKER))))
        env.update(s.gateway_env)
        env["REVISIT_API_KEYS_FILE"] = str(keys)
        log = open(self.root / "logs" / f"gateway-{self.gateway_starts}.log", "wb")  # noqa: SIM115 (the child's)
        self.gateway = subprocess.Popen(
            [str(Path(sys.executable).parent / "revisit"), "gateway", "--port", str(self.gateway_port),
             "--log-level", "info"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.gateway_starts += 1
        deadline = time.monotonic() + timeout
        while True:
            if self.gateway.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.gateway.returncode}; see {self.root / 'logs'}")
            try:
                health = httpx.get(self.url + "/health", timeout=5)
                if health.status_code == 200 and all(w["healthy"] for w in health.json()["workers"]):
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not become ready")
            time.sleep(0.2)

    def kill_gateway(self) -> None:
        assert self.gateway is not None
        os.killpg(self.gateway.pid, signal.SIGKILL)
        self.gateway.wait(timeout=30)

    # --- what the soak measures ---

    def pids(self) -> list[int]:
        pids = [p for w in self.workers for p in live_group_members(w.pid)]
        if self.gateway is not None and self.gateway.poll() is None:
            pids += live_group_members(self.gateway.pid)
        return pids

    def rss_bytes(self) -> int:
        return sum(_rss(pid) for pid in self.pids())

    def rss_by_process(self) -> dict[str, tuple[int, int]]:
        """Per part of the stack ("gateway", "worker 0", ...): its leader's pid and the RSS of its live group."""
        parts = {f"worker {i}": w.pid for i, w in enumerate(self.workers)}
        if self.gateway is not None and self.gateway.poll() is None:
            parts["gateway"] = self.gateway.pid
        return {name: (pid, sum(_rss(p) for p in live_group_members(pid))) for name, pid in parts.items()}

    def disk_free_bytes(self) -> int:
        stat = os.statvfs(self.root / "disk")
        return stat.f_bavail * stat.f_frsize

    def describe(self) -> dict:
        return {"model": MODEL_ID, "workers": len(self.workers), "store": self.store.name,
                "lmdb_on_own_tmpfs": self.disk_mounted, "settings": self.settings.__dict__}


def shm_files() -> dict[str, int]:
    """Files and folders under /dev/shm other than soak stores' (their DRAM tier and outcomes box): name -> bytes."""
    out: dict[str, int] = {}
    for child in SHM.iterdir():
        if child.name.startswith("revisit-store-soak-"):
            continue
        try:
            files = child.rglob("*") if child.is_dir() else (child,)
            out[child.name] = sum(f.stat().st_size for f in files if f.is_file())
        except OSError:
            continue
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _mount_tmpfs(path: Path, size: int) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, check=False)
    return done.returncode == 0
