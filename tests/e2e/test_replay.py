"""Replaying a made trace through the embedded gateway (``revisit serve``: the gateway and a real SGLang CPU worker)
with ``revisit replay``: the report and every plot, hit rates equal to what /admin/stats counted, a stopped run
resumed, and --compare beside plain SGLang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from replay.maker import TraceShape, make_trace
from replay.runner import read_results
from store import StoreConfig
from tests.conftest import free_port, remove_store_memory, terminate

pytestmark = pytest.mark.sglang

REVISIT = str(Path(sys.executable).with_name("revisit"))
TOKEN = "replay-test-token"


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """``revisit serve`` with one worker, the admin API on and the books reconciled often."""
    logs = tmp_path_factory.mktemp("embedded")
    port, worker_port = free_port(), free_port()
    dram = Path("/dev/shm") / f"revisit-replay-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "REVISIT_STORE_DRAM_DIR": str(dram), "REVISIT_STORE_LMDB_DIR": str(logs / "lmdb"),
           "REVISIT_ADMIN_TOKEN": TOKEN, "REVISIT_BOOKS_INTERVAL_S": "0.5",
           # Every plan sent, whether it pays on the tiny model or not: the replay's counts of each kind are tested.
           "REVISIT_PLAN_BY_COST": "0"}
    process = subprocess.Popen([REVISIT, "serve", "--port", str(port), "--worker-port", str(worker_port),
                                "--log-dir", str(logs), "--log-level", "warning"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env=env)
    lines: list[str] = []
    deadline = time.monotonic() + 600
    try:
        while not any("ready:" in line for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            lines.append(process.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            terminate(process, timeout=90)
        finally:
            remove_store_memory(StoreConfig(dram_dir=dram))


def admin_plans(url: str) -> dict[str, int]:
    return httpx.get(url + "/admin/stats", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()["plans"]


def replay(trace: Path, url: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([REVISIT, "replay", str(trace), "--url", url, "--out", str(out), "--admin-token", TOKEN,
                           "--no-progress", *args], capture_output=True, text=True, timeout=1500)


def test_a_made_trace_of_500_requests(embedded, tmp_path):
    trace = make_trace(tmp_path / "trace", TraceShape(requests=500, tenants=3, seed=1, grids=((4, 6),), docs=False))
    before = admin_plans(embedded)
    done = replay(trace, embedded, tmp_path / "out", "--fast", "--concurrency", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    after = admin_plans(embedded)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    run = report["runs"][0]
    assert run["requests"] == run["ok"] == 500
    # The hit rates are what the gateway counted over the run: its plans, per kind, equal the headers' figures.
    counted = {kind: after[kind] - before[kind] for kind in ("miss", "exact_same_prefix", "exact_moved", "approximate")}
    assert counted == run["gateway"]["plans"] == {k: v for k, v in run["images"]["planned"].items() if k != "plain"}
    images = sum(counted.values())
    assert images == run["images"]["total"] == 500
    assert run["hit_rate"]["exact"] == pytest.approx(
        sum(r.reuse.count("exact_same_prefix") + r.reuse.count("exact_moved")
            for r in read_results(tmp_path / "out" / "results-all.jsonl")) / images)
    # The made trace holds what the gateway exists for: exact repeats and near-duplicates both get served.
    assert run["hit_rate"]["exact"] > 0.2 and run["hit_rate"]["approximate"] > 0.02, run["hit_rate"]
    assert set(run["ttft_s"]) >= {"miss", "exact_same_prefix"}
    assert run["gateway"]["bytes_per_hit"] > 0  # the worker's reads, from its /metrics
    # Every exact hit's image tokens came from the store (4x6-token images here), approximate hits' reused ones too,
    # but for the images SGLang's prefix cache held whole.
    exact = run["images"]["ran"]["exact_same_prefix"] + run["images"]["ran"]["exact_moved"]
    cached = sum(r.prefix_cached for r in read_results(tmp_path / "out" / "results-all.jsonl"))
    assert run["images"]["prefix_cached"] == cached
    assert run["store_tokens"] >= 24 * (exact - cached) > 0, (run["store_tokens"], exact, cached)
    for plot in ("hit_rate.png", "ttft_cdf.png", "tier_traffic.png", "bytes_per_hit.png"):
        assert (tmp_path / "out" / plot).read_bytes()[:4] == b"\x89PNG", plot
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "hit rate: exact" in markdown and "equal to the headers'" in markdown
    assert run["gateway"]["hits"]["exact"]["dram"] > 0  # tier traffic: exact hits served from the DRAM tier


def test_a_stopped_replay_resumes_and_compares_with_plain_sglang(embedded, tmp_path):
    trace = make_trace(tmp_path / "trace", TraceShape(requests=40, tenants=2, seed=2, grids=((4, 6),), docs=False))
    out = tmp_path / "out"
    first = replay(trace, embedded, out, "--fast", "--compare")
    assert first.returncode == 0, first.stdout + first.stderr
    kept = (out / "results-all.jsonl").read_text().splitlines()[:15]
    (out / "results-all.jsonl").write_text("\n".join(kept) + "\n" + '{"index": 99, "cut sh')  # as a kill leaves it
    before = admin_plans(embedded)
    again = replay(trace, embedded, out, "--fast", "--compare", "--interleave")  # resumed side by side
    assert again.returncode == 0, again.stdout + again.stderr
    resent = sum(admin_plans(embedded)[k] - before[k] for k in before if k in ("miss", "exact_same_prefix",
                                                                              "exact_moved", "approximate"))
    assert resent == 25  # one image per request: the 25 requests the results file lacked, and no others
    assert sorted(r.index for r in read_results(out / "results-all.jsonl")) == list(range(40))
    report = json.loads((out / "report.json").read_text())
    on, off = report["runs"]
    assert (on["mode"], off["mode"]) == ("all", "off") and on["ok"] == off["ok"] == 40
    assert off["images"]["ran"]["plain"] == 40 and off["hit_rate"]["any"] == 0.0
    assert on["hit_rate"]["any"] > 0
    assert "mode all | mode off" in (out / "report.md").read_text()
    assert report["interleaved"] and report["paired"]["baseline"] == "off"
    assert report["paired"]["runs"]["all"]["all"]["all"]["n"] == 40
