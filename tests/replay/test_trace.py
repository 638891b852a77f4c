"""Traces: made from real images, read back with clear errors, imported from image hashes; and the report's
figures from a run's results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.importer import import_hashes
from replay.maker import FAMILIES, TraceShape, make_trace
from replay.report import summarize, write_report
from replay.runner import ReplaySettings, Result, Run, Sample, _read_reuse, read_results
from replay.trace import ImageFiles, TraceError, image_parts, read_trace


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    return make_trace(tmp_path_factory.mktemp("trace"), TraceShape(requests=120, tenants=3, seed=3, docs=False))


def test_a_made_trace_reads_back_with_every_family_and_revisits(made):
    trace = read_trace(made)
    assert len(trace.requests) == 120 and trace.header["made_by"] == "revisit trace make"
    assert [r.index for r in trace.requests] == list(range(120))
    times = [r.t for r in trace.requests]
    assert times == sorted(times) and times[0] > 0
    assert {r.meta["family"] for r in trace.requests} == set(FAMILIES)
    steps = [r.meta["step"] for r in trace.requests]
    assert 0.2 < steps.count("revisit") / len(steps) < 0.5
    urls = [part["url"] for r in trace.requests for part in image_parts(r.body)]
    assert len(urls) == 120 and len(set(urls)) < len(urls)  # revisits name the same file
    assert all((made.parent / url).is_file() for url in urls)
    assert len(trace.tenants) == 3


def test_the_same_seed_makes_the_same_trace(made, tmp_path):
    again = make_trace(tmp_path, TraceShape(requests=120, tenants=3, seed=3, docs=False))
    assert again.read_text() == made.read_text()


def test_a_trace_of_several_image_sizes_keeps_each_session_at_one(tmp_path):
    """Sessions take their grids at random from the ones asked for, so the sizes mix through the trace; every image
    has exactly one of those sizes, and an image's repeats and its session's other images keep it."""
    from PIL import Image

    from replay.cli import _grids
    from replay.maker import TOKEN

    grids = _grids("2x2, 4x6,8x8")
    assert grids == ((2, 2), (4, 6), (8, 8))
    path = make_trace(tmp_path, TraceShape(requests=60, tenants=2, seed=5, grids=grids, docs=False))
    trace = read_trace(path)
    sizes: dict[tuple[str, str], set[tuple[int, int]]] = {}
    for request in trace.requests:
        url = next(image_parts(request.body))["url"]
        with Image.open(path.parent / url) as image:
            sizes.setdefault((request.tenant, request.meta["session"]), set()).add(image.size)
    assert all(len(seen) == 1 for seen in sizes.values())
    assert {size for seen in sizes.values() for size in seen} == {(c * TOKEN, r * TOKEN) for r, c in grids}
    assert trace.header["grids"] == [[2, 2], [4, 6], [8, 8]]
    with pytest.raises(ValueError, match="ROWSxCOLS"):
        _grids("8x8,,16x16")


def test_documentation_pages_rendered_by_chromium(tmp_path):
    """Doc sessions over documentation pages where Chromium and Debian's docs are installed: scrolls show other
    parts of one page, an edit re-renders it with one word changed."""
    import random

    import numpy as np

    from replay.maker import RENDER_HEIGHT, RENDER_WIDTH, TOKEN, _doc_sites, _Sources

    sites, renderer = _doc_sites(tmp_path / "renders")
    if renderer is None:
        pytest.skip("rendered documentation needs Chromium and python3.11-doc or sqlite3-doc (apt-get install "
                    "chromium python3.11-doc): doc sessions use the scanned pages instead, tested above")
    sources = _Sources(TraceShape(grids=((6, 9),), render_dir=tmp_path / "renders"), random.Random(4))
    frames = [np.asarray(frame) for frame in sources._rendered_doc(6, 9)]
    assert all(frame.shape == (6 * TOKEN, 9 * TOKEN, 3) for frame in frames) and len(frames) >= 6
    assert len({frame.tobytes() for frame in frames}) > 1
    assert list((tmp_path / "renders").glob("*.png")) and (RENDER_WIDTH, RENDER_HEIGHT) == (812, 1680)


def test_images_are_inlined_when_replayed(made):
    trace = read_trace(made)
    files = ImageFiles(trace.base_dir)
    body = files.inline(trace.requests[0].body)
    url = next(image_parts(body))["url"]
    assert url.startswith("data:image/png;base64,") and next(image_parts(trace.requests[0].body))["url"] != url
    with pytest.raises(TraceError, match="leaves the trace's folder"):
        files.data_url("../../etc/passwd")


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ('{"t": -1, "tenant": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}', "t must be"),
    ('{"t": 1, "tenant": "", "body": {"messages": [{"role": "user", "content": "hi"}]}}', "tenant"),
    ('{"t": 1, "tenant": "a", "body": {"messages": []}}', "messages"),
    ('[1, 2]', "JSON object"),
])
def test_a_bad_line_is_named(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"t": 0, "tenant": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}\n' + line)
    with pytest.raises(TraceError, match=message) as info:
        read_trace(path)
    assert f"{path}:2" in str(info.value)


def test_time_never_goes_back(tmp_path):
    body = '"tenant": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}'
    path = tmp_path / "trace.jsonl"
    path.write_text(f'{{"t": 5, {body}}}\n{{"t": 4, {body}}}\n')
    with pytest.raises(TraceError, match="back in time"):
        read_trace(path)


def test_importing_image_hashes_keeps_the_repeats_and_the_timing(tmp_path):
    csv = tmp_path / "log.csv"
    csv.write_text("timestamp,user,image_hashes,prompt\n"
                   "2026-01-01T10:00:05Z,u1,aa;bb,What is it?\n"
                   "2026-01-01T10:00:00Z,u2,aa,\n"
                   "2026-01-01T10:00:07Z,u1,,Hello\n"
                   "2026-01-01T10:00:09Z,u2,cc bb,Compare them\n")
    trace = read_trace(import_hashes(csv, tmp_path / "out"))
    assert [r.t for r in trace.requests] == [0.0, 5.0, 7.0, 9.0] and trace.tenants == ("u2", "u1")
    urls = [[part["url"] for part in image_parts(r.body)] for r in trace.requests]
    assert urls[0][0] == urls[1][0] and urls[1][1] == urls[3][1]  # aa, then bb, again
    assert len({u for us in urls for u in us}) == 3 and urls[2] == []
    with pytest.raises(TraceError, match="no timestamp"):
        bad = tmp_path / "bad.csv"
        bad.write_text("when,image_hash\n1,aa\n")
        import_hashes(bad, tmp_path / "bad")


def test_reuse_header_and_results_file(tmp_path):
    result = Result(index=0, tenant="a", family="doc", sent_s=0.0)
    _read_reuse(result, "approximate;similarity=0.9731,miss;planned=exact_moved;fallback=entry_absent,miss,"
                        "exact_same_prefix;derived;prefix_cached")
    assert result.reuse == ["approximate", "miss", "miss", "exact_same_prefix"]
    assert result.planned == ["approximate", "exact_moved", "miss", "exact_same_prefix"]
    assert (result.derived, result.prefix_cached) == (1, 1)
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(result.__dict__) + "\n" + '{"index": 1, "ten')  # the last line cut by a kill
    assert [r.index for r in read_results(path)] == [0]


def _result(index: int, reuse: list[str], ttft: float, family: str = "doc") -> Result:
    return Result(index=index, tenant="a", family=family, sent_s=index * 0.1, status=200, ttft_s=ttft,
                  latency_s=ttft + 0.05, reuse=reuse, planned=list(reuse), prompt_tokens=100, cached_tokens=10)


def _stats(exact: int, approximate: int, miss: int) -> dict:
    return {"plans": {"miss": miss, "exact_same_prefix": exact, "exact_moved": 0, "approximate": approximate},
            "hits": {"exact": {"dram": exact, "lmdb": 0}, "approximate": {"dram": approximate, "lmdb": 0}},
            "decisions": {"admit": miss, "promote": 0}, "evictions": {"dram": {"capacity": 0}},
            "tiers": {"dram": {"entries": miss}}}


def test_the_report_counts_what_the_headers_said(tmp_path):
    results = [_result(i, [kind], ttft) for i, (kind, ttft) in enumerate(
        [("miss", 1.0)] * 6 + [("exact_same_prefix", 0.1)] * 3 + [("approximate", 0.4)] * 1)]
    for result in results[6:9]:
        result.store_tokens = 64  # the exact hits' image tokens, as x-revisit-store-tokens said
    results.append(Result(index=10, tenant="a", family="doc", sent_s=1.0, status=413, error="too large"))
    run = Run(settings=ReplaySettings(url="http://x"), results=results, wall_s=2.0,
              samples=[Sample(0.0, _stats(5, 5, 5), 1000), Sample(1.0, _stats(7, 5, 9), 3000),
                       Sample(2.0, _stats(8, 6, 11), 9000)])
    summary = summarize(run)
    assert summary["requests"] == 11 and summary["ok"] == 10 and summary["failed"] == {"413": 1}
    assert summary["hit_rate"] == {"exact": 0.3, "approximate": 0.1, "any": 0.4}
    assert summary["ttft_s"]["exact_same_prefix"]["p50"] == pytest.approx(0.1)
    # Every request here has 100 prompt tokens: one size bucket holds them all.
    assert summary["ttft_by_size_s"]["< 128"]["n"] == 10 and summary["ttft_by_size_s"]["128-511"]["n"] == 0
    assert summary["gateway"]["plans"] == {"miss": 6, "exact_same_prefix": 3, "exact_moved": 0, "approximate": 1}
    assert summary["images"]["ran"]["plain"] == 0
    assert summary["gateway"]["plans_match_headers"]
    assert summary["gateway"]["store_bytes_read"] == 8000 and summary["gateway"]["bytes_per_hit"] == 2000
    report = write_report([run], tmp_path, trace_name="t")
    assert sorted(report["plots"]) == ["bytes_per_hit.png", "hit_rate.png", "tier_traffic.png", "ttft_cdf.png"]
    for name in report["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "hit rate: exact | 30.0%" in (tmp_path / "report.md").read_text()
    assert "predicted" not in (tmp_path / "report.md").read_text()  # a gateway that predicts nothing shows nothing
    assert "TTFT p50 / p95 (ms), prompts of < 128 tokens | 1000 / 1000 (n 10) |" in (tmp_path / "report.md").read_text()
    assert "prompts of 128-511 tokens" not in (tmp_path / "report.md").read_text()  # empty buckets left out
    assert "prompt tokens cached by SGLang | 100 of 1000 |" in (tmp_path / "report.md").read_text()
    assert "prompt tokens read from the store | 192 of 1000 |" in (tmp_path / "report.md").read_text()
    assert "prompt tokens reused (both) | 292 of 1000 |" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["runs"][0]["images"]["total"] == 10


def test_the_report_shows_the_gateways_predictions_and_refusals(tmp_path):
    results = [_result(i, ["miss"], 1.0) for i in range(3)]
    last = {**_stats(0, 0, 3), "refused": {"similarity": 1, "changed_share": 0, "cost": 2},
            "worker_costs": {"workers": {}, "predicted": {
                "miss": {"requests": 3, "predicted_over_measured": 0.91, "relative_error": 0.09}}}}
    run = Run(settings=ReplaySettings(url="http://x"), results=results, wall_s=1.0,
              samples=[Sample(0.0, _stats(0, 0, 0), None), Sample(1.0, last, None)])
    summary = summarize(run)
    assert summary["gateway"]["refused"] == {"similarity": 1, "cost": 2}
    assert summary["gateway"]["predicted"]["miss"]["predicted_over_measured"] == 0.91
    write_report([run], tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "near them, by why: similarity 1, cost 2" in text and "| miss | 3 | 0.91 | 9.0% |" in text


def test_a_replay_waits_for_the_gateways_calibration_of_its_workers():
    """The calibration's probes must not run beside the first mode's requests: the replay waits until /admin/stats
    shows every healthy worker calibrated (an in-process gateway stand-in: the wait is the replay's own rule)."""
    import asyncio

    import httpx

    from replay.runner import _calibrated

    polls = {"stats": 0}

    def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"workers": [{"url": "http://w0", "healthy": True},
                                                         {"url": "http://w1", "healthy": False}]})
        polls["stats"] += 1
        calibration = {"seconds": 3.0} if polls["stats"] >= 3 else None
        return httpx.Response(200, json={"worker_costs": {"workers": {"http://w0": {"calibration": calibration}}}})

    async def wait(settings: ReplaySettings) -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(gateway), base_url="http://g") as client:
            await _calibrated(client, settings)

    asyncio.run(wait(ReplaySettings(url="http://g", admin_token="admin-token")))
    assert polls["stats"] == 3  # waited for w0, the healthy one; w1 is down and not waited for
    polls["stats"] = 0
    asyncio.run(wait(ReplaySettings(url="http://g")))  # no admin token: nothing to read, no wait
    assert polls["stats"] == 0


def test_interleaved_modes_take_turns_request_by_request(tmp_path, monkeypatch):
    """--interleave: each trace request goes under every mode back to back, the modes' order turning with the
    request, one at a time at concurrency 1; each mode resumes from its own results file (an in-process gateway
    stand-in: the order is the replay's own rule)."""
    import asyncio

    import httpx

    from replay import runner
    from replay.runner import replay_interleaved
    from replay.trace import Trace, TraceRequest

    sent: list[tuple[str, str]] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/health":
            return httpx.Response(200, json={"workers": []})
        if request.url.path == "/admin/stats":
            return httpx.Response(200, json={"plans": {}})
        body = json.loads(request.content)
        sent.append((request.headers["x-revisit-reuse-mode"], body["messages"][0]["content"]))
        return httpx.Response(200, json={"usage": {"prompt_tokens": 5}})

    class Client(httpx.AsyncClient):
        def __init__(self, **kwargs):
            super().__init__(transport=httpx.MockTransport(gateway), **kwargs)

    monkeypatch.setattr(runner.httpx, "AsyncClient", Client)
    trace = Trace(header={}, base_dir=tmp_path, requests=tuple(
        TraceRequest(index=i, t=0.1 * i, tenant="a", body={"messages": [{"role": "user", "content": f"q{i}"}]},
                     meta={}) for i in range(4)))
    lanes = [(ReplaySettings(url="http://g", mode=mode, concurrency=1, paced=False, admin_token="t"),
              tmp_path / f"results-{mode}.jsonl") for mode in ("off", "all")]
    (tmp_path / "results-off.jsonl").write_text(json.dumps(Result(
        index=2, tenant="a", family="", sent_s=0.0, status=200, ttft_s=0.1).__dict__) + "\n")  # off did q2 already
    runs = asyncio.run(replay_interleaved(trace, lanes))
    assert sent == [("off", "q0"), ("all", "q0"), ("all", "q1"), ("off", "q1"), ("all", "q2"),
                    ("all", "q3"), ("off", "q3")]
    assert [r.settings.mode for r in runs] == ["off", "all"]
    assert runs[0].samples == [] and runs[1].samples  # the gateway's counts go with the mode that plans
    assert [[r.index for r in run.results] for run in runs] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert all(r.ok for run in runs for r in run.results)


def test_the_report_pairs_each_request_with_itself_in_the_baseline(tmp_path):
    """With several runs the report divides each request's TTFT by the same request's in mode off: median and
    geometric mean, over all, per prompt size and per kind."""
    def run(mode: str, ttfts: list[float], kinds: list[str]) -> Run:
        results = [_result(i, [kind], ttft) for i, (ttft, kind) in enumerate(zip(ttfts, kinds, strict=True))]
        results[3].prompt_tokens = 1500
        return Run(settings=ReplaySettings(url="http://x", mode=mode), results=results, samples=[], wall_s=1.0)

    off = run("off", [1.0, 1.0, 2.0, 10.0], ["plain"] * 4)
    on = run("all", [0.5, 1.0, 2.0, 2.5], ["exact_same_prefix", "miss", "miss", "approximate"])
    report = write_report([on, off], tmp_path, interleaved=True)
    pairs = report["paired"]
    assert pairs["baseline"] == "off" and list(pairs["runs"]) == ["all"]
    ratios = pairs["runs"]["all"]
    assert ratios["all"]["all"]["n"] == 4 and ratios["all"]["all"]["median"] == pytest.approx(0.75)
    assert ratios["all"]["all"]["geomean"] == pytest.approx((0.5 * 1 * 1 * 0.25) ** 0.25)
    assert list(ratios["size"]) == ["< 128", "1024-2047"] and ratios["size"]["1024-2047"]["median"] == 0.25
    assert ratios["kind"]["miss"] == {"n": 2, "median": 1.0, "geomean": 1.0}
    text = (tmp_path / "report.md").read_text()
    assert "replayed together, request by request" in text
    assert "| all | prompts of 1024-2047 tokens | 1 | 0.250 | 0.250 |" in text
    write_report([on], tmp_path)
    assert "against itself" not in (tmp_path / "report.md").read_text()  # one run: nothing to pair
