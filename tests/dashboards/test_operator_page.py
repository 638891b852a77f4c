"""The operator page in a real headless Chromium (Debian's, driven by Playwright): it refuses without the admin
token, and with it shows live figures that change as requests are served, charts of the last hour, and tables that
fit a 1400-px window without scrolling sideways. The run leaves a screenshot
(tests/dashboards/operator.png under the test's temporary folder, and in $REVISIT_TEST_ARTIFACTS when set)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

from gateway.config import ResponseCacheSettings
from tests.conftest import gateway_config, run_gateway
from tests.images_lib import data_url, encode, small

pytestmark = pytest.mark.sglang

TOKEN = "operator-page-token"
WINDOW_PX = 1400  # the window the page is laid out to fit
CHROMIUM = os.environ.get("REVISIT_CHROMIUM", "/usr/bin/chromium")
# As root in a sandbox with no network: no sandbox, no GPU, no background connections (refused here, slow to fail).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def admin_gateway(workers, model_path, shared_store):
    server = run_gateway(gateway_config(model_path, [w.url for w in workers], store=shared_store,
                                        admin_token=TOKEN, responses=ResponseCacheSettings(namespaces=("*",)),
                                        calibrate=True))  # the workers' costs shown (plans all sent, as in tests)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}: install Debian's chromium (apt-get install " \
                                    "chromium) or point REVISIT_CHROMIUM at one"
    profile = tempfile.mkdtemp(prefix="revisit-chromium-")
    with sync_playwright() as playwright:
        # bypass_csp: the page's policy forbids eval, which Playwright's waiting on a JavaScript condition uses.
        context = playwright.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                                args=FLAGS, bypass_csp=True,
                                                                viewport={"width": WINDOW_PX, "height": 900})
        try:
            yield context
        finally:
            context.close()
            shutil.rmtree(profile, ignore_errors=True)


def ask(gateway, image: str, headers: dict[str, str] | None = None, *, stream: bool = False) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/chat/completions", timeout=300, headers=headers, json={
        "model": gateway.config.model, "max_tokens": 2, "temperature": 0, "stream": stream,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]}]})


# Each panel's overflow: how far its content reaches past its box to the right (0 when it fits), by its heading.
OVERFLOW = """() => [...document.querySelectorAll('#panels section')].map(section => {
  const right = section.getBoundingClientRect().right;
  const parts = [...section.querySelectorAll('table, svg')];
  const reach = Math.max(section.scrollWidth - section.clientWidth,
                         ...parts.map(part => part.getBoundingClientRect().right - right));
  return [section.querySelector('h2').innerText, Math.max(0, Math.ceil(reach))];
})"""


def test_the_page_refuses_without_the_token(admin_gateway, browser):
    served = httpx.get(admin_gateway.url + "/dashboard", timeout=30)
    assert served.status_code == 200 and "default-src 'self'" in served.headers["content-security-policy"]
    assert "/admin/stats" in served.text and "revisit_cache" not in served.text  # figures come only from the API
    page = browser.new_page()
    for address in ("/dashboard", "/dashboard#token=not-the-token"):
        page.goto(admin_gateway.url + address)
        refused = page.get_by_test_id("refused")
        refused.wait_for(state="visible", timeout=15000)
        assert "refused" in refused.inner_text().lower()
        assert page.locator("#panels").is_hidden()
        assert page.get_by_test_id("images").inner_text() == "-"  # no figure was ever shown
        page.evaluate("sessionStorage.clear()")
    page.close()


def test_the_page_shows_live_figures_that_follow_the_requests(admin_gateway, browser, tmp_path):
    page = browser.new_page()
    page.goto(admin_gateway.url + f"/dashboard#token={TOKEN}")
    page.wait_for_function("Number(document.body.dataset.updates || 0) >= 1", timeout=15000)
    assert "token" not in page.url  # taken out of the address bar
    images_before = int(page.get_by_test_id("images").inner_text())
    picture = data_url(encode(small("coins.png", (112, 84))))
    assert ask(admin_gateway, picture).status_code == 200
    for _ in range(20):  # the worker stores the miss in the background; then the same image is an exact hit
        reply = ask(admin_gateway, picture)
        if reply.headers.get("x-revisit-reuse", "").split(";")[0] == "exact_same_prefix":  # ;prefix_cached too
            break
    assert reply.headers["x-revisit-reuse"].split(";")[0] == "exact_same_prefix"
    page.wait_for_function(f"Number(document.querySelector('[data-testid=images]').textContent) >= "
                           f"{images_before + 2}", timeout=15000)
    recent = page.get_by_test_id("recent")
    page.wait_for_function("document.querySelector('[data-testid=recent]').innerText.includes('exact_same_prefix')",
                           timeout=15000)
    assert "/v1/chat/completions" in recent.inner_text()
    assert page.get_by_test_id("rate-exact").inner_text().endswith("%")
    assert "up" in page.locator("#workers").inner_text()
    # The response cache's figures: a question asked twice, the second answered from it.
    exact = {"x-revisit-response-cache": "exact"}
    assert [ask(admin_gateway, picture, exact).headers["x-revisit-response-cache"] for _ in range(2)] == \
        ["miss", "exact"]
    page.wait_for_function("/exact\\s+1\\b/.test(document.querySelector('[data-testid=responses]').innerText)",
                           timeout=15000)
    assert "answers held" in page.get_by_test_id("responses").inner_text()
    # Each worker's measured costs, once the gateway has measured it (at start), and the predictions' accuracy.
    page.wait_for_function("(document.querySelector('[data-testid=costs]').innerText.match(/ ms/g) || []).length "
                           f">= {5 * len(admin_gateway.config.workers)}", timeout=120000)
    assert all(url.removeprefix("http://") in page.get_by_test_id("costs").inner_text()
               for url in admin_gateway.config.workers)
    # The last hour's charts: this minute's hit rate, a streamed request's TTFT under its reuse kind, the requests.
    assert ask(admin_gateway, picture, stream=True).status_code == 200
    page.wait_for_function("document.getElementById('legend-ttft').innerText.includes('exact_same_prefix')",
                           timeout=15000)
    assert page.locator("#chart-hits circle, #chart-hits path").count() >= 1
    assert page.locator("#chart-ttft circle, #chart-ttft path").count() >= 1
    assert page.locator("#chart-requests rect").count() >= 1
    assert "-60 min" in page.locator("#chart-requests").inner_html()
    # Every table and chart fits the window: nothing scrolls sideways, nothing is cut.
    page.wait_for_function("document.querySelectorAll('#tiers td.meter .bar').length >= 1", timeout=15000)
    overflow = page.evaluate(OVERFLOW)
    assert len(overflow) >= 8 and all(reach == 0 for _, reach in overflow), overflow
    assert page.evaluate("document.documentElement.scrollWidth") <= WINDOW_PX
    assert page.evaluate("document.querySelector('#tiers td.meter .bar').getBoundingClientRect().width") >= 40
    shot = tmp_path / "operator.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 10_000
    if artifacts := os.environ.get("REVISIT_TEST_ARTIFACTS"):
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / "operator.png")
    print(f"operator page screenshot: {shot}")
    page.close()
