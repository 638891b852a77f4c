"""Start and stop a Mooncake Store cluster on this host: one master and its storage nodes.

The shared tier (store/mooncake_tier.py) needs a running cluster: a ``mooncake_master`` (which here also serves the
transfer metadata over HTTP) and one or more storage nodes, ``mooncake_client`` processes that lend memory
segments to the cluster. On GPU hosts compose runs them as services (compose.yaml's scale-out example); this module
runs them for the tests and the benches, from the binaries the
``mooncake-transfer-engine`` package installs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from launcher.errors import LauncherError

READY_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0


def binary(name: str) -> Path:
    """A Mooncake executable (mooncake_master, mooncake_client) from the installed package."""
    try:
        import mooncake
    except ImportError as exc:
        raise LauncherError(f"the mooncake-transfer-engine package is not installed: {exc}") from exc
    path = Path(mooncake.__file__).parent / name
    if not path.is_file():
        raise LauncherError(f"{path} is missing from the mooncake-transfer-engine package")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class MooncakeCluster:
    """A master and its storage nodes, each the leader of its own process group, logging under ``log_dir``."""

    host: str
    master_port: int
    metadata_port: int
    admin_port: int
    log_dir: Path
    master: subprocess.Popen[bytes] | None = None
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.master_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    def store_settings(self) -> dict[str, str]:
        """The REVISIT_STORE_* variables that point a store at this cluster."""
        return {"REVISIT_STORE_MOONCAKE_MASTER": self.master_address,
                "REVISIT_STORE_MOONCAKE_METADATA_SERVER": self.metadata_server,
                "REVISIT_STORE_MOONCAKE_ADMIN_URL": self.admin_url}

    @classmethod
    def start(cls, log_dir: Path, *, host: str = "127.0.0.1", segment_bytes: int = 1 << 30, nodes: int = 1,
              lease_ms: int = 10_000) -> MooncakeCluster:
        """A master and ``nodes`` storage nodes of ``segment_bytes`` each, ready to store. Raises LauncherError."""
        log_dir.mkdir(parents=True, exist_ok=True)
        cluster = cls(host=host, master_port=free_port(host), metadata_port=free_port(host),
                      admin_port=free_port(host), log_dir=log_dir)
        try:
            cluster.master = _spawn([
                str(binary("mooncake_master")), f"--rpc_address={host}", f"--rpc_port={cluster.master_port}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
                f"--http_metadata_server_port={cluster.metadata_port}", f"--metrics_host={host}",
                f"--metrics_port={cluster.admin_port}", f"--default_kv_lease_ttl={lease_ms}",
                "--enable_metric_reporting=false",
            ], log_dir / "master.log")
            cluster._wait(lambda: cluster._get("/health") is not None, "the master", cluster.master)
            for _ in range(nodes):
                cluster.add_node(segment_bytes)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def add_node(self, segment_bytes: int) -> subprocess.Popen[bytes]:
        """Another storage node lending ``segment_bytes`` of memory; returns once the master lists its segment."""
        before = self.segments()
        node = _spawn([
            str(binary("mooncake_client")), f"--host={self.host}", f"--port={free_port(self.host)}",
            f"--master_server_address={self.master_address}", f"--metadata_server={self.metadata_server}",
            f"--global_segment_size={segment_bytes}", "--protocol=tcp",
        ], self.log_dir / f"node-{len(self.nodes)}.log")
        self.nodes.append(node)
        self._wait(lambda: len(self.segments()) > len(before), "a storage node", node)
        return node

    def segments(self) -> list[str]:
        text = self._get("/get_all_segments")
        return [line for line in (text or "").splitlines() if line.strip()]

    def _get(self, path: str) -> str | None:
        try:
            with urllib.request.urlopen(self.admin_url + path, timeout=2.0) as response:
                return response.read().decode()
        except (OSError, urllib.error.URLError):
            return None

    def _wait(self, ready, what: str, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise LauncherError(f"{what} of the Mooncake cluster exited ({process.returncode}); see "
                                    f"{self.log_dir}")
            if ready():
                return
            time.sleep(0.1)
        raise LauncherError(f"{what} of the Mooncake cluster was not ready in {READY_TIMEOUT_S:.0f} s; see "
                            f"{self.log_dir}")

    def stop(self) -> None:
        """Storage nodes first (their memory, and every object in it, goes with them), then the master."""
        for process in [*self.nodes, *([self.master] if self.master else [])]:
            _stop(process)
        self.nodes.clear()
        self.master = None

    def __enter__(self) -> MooncakeCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _spawn(argv: list[str], log_file: Path) -> subprocess.Popen[bytes]:
    with open(log_file, "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass
