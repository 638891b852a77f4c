"""compose.yaml validates with the Compose tool (no Docker engine needed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from store import StoreConfig

ROOT = Path(__file__).resolve().parent.parent


def compose_command() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("neither 'docker compose' nor 'docker-compose' is installed (.ci/run installs docker-compose)")


def test_compose_file_validates():
    result = subprocess.run([*compose_command(), "-f", str(ROOT / "compose.yaml"), "config"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert {"gateway", "worker-0", "worker-1"} <= set(services)
    workers = services["gateway"]["environment"]["REVISIT_WORKERS"].split(",")
    assert workers == ["http://worker-0:30000", "http://worker-1:30000"]
    for name in ("worker-0", "worker-1"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert any("/var/lib/revisit/store" in str(v) for v in services[name]["volumes"])
    assert "kv-store" in config["volumes"]
    # Gateway and workers name the same store, with variables the store understands.
    stores = []
    for name in ("gateway", "worker-0", "worker-1"):
        env = {k: str(v) for k, v in services[name]["environment"].items() if k.startswith("REVISIT_STORE_")}
        stores.append(StoreConfig.from_env(env))
        assert services[name].get("ipc") == "host"
    assert stores[0] == stores[1] == stores[2] and str(stores[0].lmdb_path).startswith("/var/lib/revisit/store")
