"""The gateway's web page in a real headless browser (Debian's chromium driven by selenium) on the real stack:
an answer streams in with its figures, the live workers are listed, the waterfall draws the request's trace,
and a screenshot is kept as tests/artifacts/page.png."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningStack

pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

STATIC = Path(__file__).parents[1] / "gateway" / "static"
SCREENSHOT = Path(__file__).parent / "artifacts" / "page.png"
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
WAIT = 60.0
# Records when the answer's text grows, to tell a stream from one late block of text.
WATCH_OUTPUT = """
const output = document.getElementById("output");
window.growth = [];
new MutationObserver(() => window.growth.push([performance.now(), output.textContent.length]))
  .observe(output, {childList: true, characterData: true, subtree: true});
"""
UNKNOWN = "\N{EN DASH}"  # what the page shows for a figure not known yet


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    # A driver path of our own keeps selenium-manager from looking anything up or downloading it.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait(browser: webdriver.Chrome, what: str, condition: Callable[[], object], timeout: float = WAIT) -> None:
    # The page redraws what it shows (stale elements) and shows UNKNOWN until a figure is known (ValueError).
    WebDriverWait(browser, timeout, ignored_exceptions=(StaleElementReferenceException, ValueError)).until(
        lambda _: condition(), message=f"the page never showed {what}")


def text(browser: webdriver.Chrome, element_id: str) -> str:
    return browser.find_element(By.ID, element_id).get_attribute("textContent")


def fill(browser: webdriver.Chrome, element_id: str, value: str) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def send_and_watch(browser: webdriver.Chrome) -> list[tuple[float, int]]:
    """Sends the form, waits for the answer to end, and returns (ms, length) each time its text grew."""
    before = text(browser, "request-id")
    browser.execute_script("window.growth = [];")
    browser.find_element(By.ID, "send").click()
    wait(browser, "the end of the answer",
         lambda: text(browser, "request-id") not in (UNKNOWN, before) and text(browser, "finish") != UNKNOWN)
    return [(at, length) for at, length in browser.execute_script("return window.growth;") if length]


def assert_streamed(growth: list[tuple[float, int]], answer: str) -> None:
    lengths = [length for _, length in growth]
    assert lengths == sorted(lengths) and lengths[-1] == len(answer)
    assert len(set(lengths)) >= 3, f"the answer did not arrive piece by piece: {lengths}"
    assert growth[-1][0] - growth[0][0] > 10, "every piece arrived at once"


def assert_figures(browser: webdriver.Chrome, tokens: int, finish: str) -> None:
    assert float(text(browser, "ttft")) > 0
    assert float(text(browser, "tps")) > 0
    assert text(browser, "tokens") == str(tokens)
    assert text(browser, "finish") == finish
    assert re.fullmatch(r"[0-9a-f]{32}", text(browser, "request-id"))


def test_the_page_and_only_its_files_are_served_without_external_resources(stack: RunningStack) -> None:
    page = httpx.get(f"{stack.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    scripts = sorted(path.name for path in STATIC.glob("*.js"))
    assert all(f'src="/static/{script}"' in page.text for script in scripts)  # each one the page loads
    for name, kind in (*((script, "text/javascript") for script in scripts), ("style.css", "text/css")):
        served = httpx.get(f"{stack.url}/static/{name}")
        assert served.status_code == 200 and served.headers["content-type"].startswith(kind)
        assert served.text == (STATIC / name).read_text()
    missing = httpx.get(f"{stack.url}/static/page.py")
    assert missing.status_code == 404 and "error" in missing.json()
    # The machines that run it may be offline: nothing may come from another origin.
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)
    assert "url(" not in (STATIC / "style.css").read_text()
    for script in scripts:
        assert not re.search(r"""fetch\(\s*["'`](https?:)?//""", (STATIC / script).read_text())


# Marked, not skipped in the fixture, so that the stack does not start for a test that cannot run.
@pytest.mark.skipif(not CHROMIUM or not CHROMEDRIVER,
                    reason="Debian's chromium is not installed (apt-get install -y chromium chromium-driver)")
def test_the_page_streams_answers_and_shows_the_cluster_and_their_journeys(stack: RunningStack,
                                                                          browser: webdriver.Chrome) -> None:
    model = httpx.get(f"{stack.url}/v1/models").json()["data"][0]["id"]
    question = "What is the capital of France?"
    settings = {"model": model, "max_tokens": 12, "temperature": 0}
    chat = httpx.post(f"{stack.url}/v1/chat/completions", timeout=WAIT,
                      json={**settings, "messages": [{"role": "user", "content": question}]}).json()
    prompt = "The three primary colours are"
    completion = httpx.post(f"{stack.url}/v1/completions", timeout=WAIT, json={**settings, "prompt": prompt}).json()

    browser.get(f"{stack.url}/")
    try:
        wait(browser, "the model", lambda: browser.find_element(By.ID, "model").get_attribute("value") == model)
        browser.execute_script(WATCH_OUTPUT)
        assert browser.find_element(By.ID, "mode-chat").is_selected()

        # A refused request shows the gateway's message and gives the message back to send again.
        fill(browser, "prompt", question)
        fill(browser, "max-tokens", "12")
        fill(browser, "temperature", "5")
        browser.find_element(By.ID, "send").click()
        error = browser.find_element(By.ID, "error")
        wait(browser, "the error", lambda: error.is_displayed() and "temperature" in error.text)
        assert error.text.startswith("400")
        assert browser.find_element(By.ID, "prompt").get_attribute("value") == question

        # Chat: the greedy answer streams in, the same as the API's whole answer.
        fill(browser, "temperature", "0")
        growth = send_and_watch(browser)
        assert not error.is_displayed()
        answer = chat["choices"][0]["message"]["content"]
        assert text(browser, "output") == answer
        assert_streamed(growth, answer)
        assert_figures(browser, chat["usage"]["completion_tokens"], chat["choices"][0]["finish_reason"])
        assert question in text(browser, "transcript")
        chat_id = text(browser, "request-id")

        # Completion: the switch changes the route.
        browser.find_element(By.ID, "mode-completion").click()
        assert not browser.find_element(By.ID, "transcript").is_displayed()
        fill(browser, "prompt", prompt)
        growth = send_and_watch(browser)
        answer = completion["choices"][0]["text"]
        assert text(browser, "output") == answer
        assert_streamed(growth, answer)
        assert_figures(browser, completion["usage"]["completion_tokens"], completion["choices"][0]["finish_reason"])
        completion_id = text(browser, "request-id")

        # The cluster view lists the live workers with their slots, and saw the tokens just generated.
        def listed() -> bool:
            cluster = httpx.get(f"{stack.url}/v1/cluster").json()
            rows = browser.find_elements(By.CSS_SELECTOR, "#workers tr.worker")
            shown = {row.find_element(By.CSS_SELECTOR, "td.id").text: row.text for row in rows}
            return bool(rows) and shown.keys() == {w["id"] for w in cluster["workers"]} and all(
                f"{w['running']} / {w['slots'] - w['running']}" in shown[w["id"]] for w in cluster["workers"])

        wait(browser, "the live workers", listed)
        wait(browser, "the recent tokens/s", lambda: float(text(browser, "cluster-tps")) > 0)
        assert text(browser, "queue") == "0"

        # The batch jobs of the key (none here): their progress, refreshed with the cluster.
        lines = "\n".join(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
                                      "body": {**settings, "prompt": f"{prompt} {i}", "max_tokens": 2}})
                          for i in range(3))
        upload = httpx.post(f"{stack.url}/v1/files", files={"file": ("page.jsonl", lines.encode())},
                            data={"purpose": "batch"}).json()
        job = httpx.post(f"{stack.url}/v1/batches", json={"input_file_id": upload["id"],
                                                          "endpoint": "/v1/completions"}).json()

        def job_row() -> str:
            rows = browser.find_elements(By.CSS_SELECTOR, f"#batch-jobs tr[data-batch-id='{job['id']}']")
            return rows[0].text if rows else ""

        wait(browser, "the batch job done", lambda: "completed" in job_row() and "3 / 3" in job_row())

        # One waterfall row per request, newest first, each drawn up to its last hop.
        def journeys() -> list[tuple[str, list[str]]]:
            rows = browser.find_elements(By.CSS_SELECTOR, "#waterfall g.journey")
            return [(row.get_attribute("data-request-id"),
                     [bar.get_attribute("data-hop") for bar in row.find_elements(By.CSS_SELECTOR, "rect.seg")])
                    for row in rows]

        wait(browser, "both journeys up to delivery",
             lambda: [(rid, hops[-1:]) for rid, hops in journeys()] == [(completion_id, ["delivered"]),
                                                                        (chat_id, ["delivered"])])
        assert all(len(hops) >= 3 for _, hops in journeys())
        # Each row says which model served its request.
        labels = browser.find_elements(By.CSS_SELECTOR, "#waterfall g.journey > text[data-model]")
        assert [label.get_attribute("data-model") for label in labels] == [model, model]
    finally:
        SCREENSHOT.parent.mkdir(exist_ok=True)
        # The whole page, not just the first screenful: a headless window cannot outgrow its screen, a viewport can.
        height = browser.execute_script("return document.documentElement.scrollHeight;")
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                {"width": 1400, "height": height, "deviceScaleFactor": 1, "mobile": False})
        browser.save_screenshot(str(SCREENSHOT))
