"""The peer's page in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by Selenium) against `prefixswarm local --peers 3 --model
tiny-random`. The page lists the 3 peers within 10 s; a prompt typed into it streams an
answer and shows its serving peer and cached tokens; a second prompt sharing a prefix
shows cached tokens > 0; a killed peer's row goes within 3 summary intervals.

.ci/run installs chromium and chromium-driver when they are missing; on a machine without
them this test is skipped (under CI it fails instead).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1366,900",  # a laptop's screen
)
SUMMARY_INTERVAL_S = 1.0  # `prefixswarm local`'s default, passed explicitly
SWARM_READY_S = 120.0  # three interpreters loading torch on a loaded 2-core machine
TABLE_WITHIN_S = 10.0  # the bound for the table to list every peer
ANSWER_WITHIN_S = 30.0
PAGE_POLL_S = SUMMARY_INTERVAL_S / 4  # peer/web/app.js
WAITING = "waiting for the first token…"  # the page's state while a request runs
# ~420 tokens and a short answer for the second prompt: the prefill a cache saves then
# outweighs the peers' differences in decode speed, so the cost policy routes the second
# prompt to a peer holding the first (with 90 tokens and 32 to decode it need not).
PROMPT = "The quick brown fox jumps over the lazy dog. " * 40

pytestmark = pytest.mark.slow  # spawns 4 processes and a browser: ~30 s


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def _need_browser() -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if not missing:
        return
    message = f"{', '.join(missing)} missing: apt-get install chromium chromium-driver"
    if os.environ.get("CI"):
        pytest.fail(message + " (.ci/run should have)")
    pytest.skip(message)


@pytest.fixture
def local_swarm(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """`prefixswarm local --peers 3 --model tiny-random --json`: its ready report."""
    log = open(tmp_path / "local.log", "wb")  # noqa: SIM115 (closed below, after the process)
    process = subprocess.Popen(
        [sys.executable, "-m", "peer.cli", "local", "--peers", "3", "--model", "tiny-random",
         "--http", "127.0.0.1:0", "--summary-interval", str(SUMMARY_INTERVAL_S), "--json"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
    )
    started = time.monotonic()
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], SWARM_READY_S)
        line = process.stdout.readline() if ready else b""
        if not line:
            process.kill()
            process.wait()
            pytest.fail("the local swarm did not start:\n" + (tmp_path / "local.log").read_text())
        report = json.loads(line)
        print(f"local swarm ready after {time.monotonic() - started:.1f} s")
        assert report["event"] == "ready" and len(report["peers"]) == 3
        yield report
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # it stops its peers
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: Any, timeout_s: float, condition: Any, what: str) -> float:
    """Seconds until `condition(driver)` holds; fails with `what` after `timeout_s`."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    start = time.monotonic()
    try:
        WebDriverWait(driver, timeout_s, poll_frequency=0.05).until(condition)
    except TimeoutException:
        pytest.fail(f"not within {timeout_s} s: {what}")
    return time.monotonic() - start


def _rows(driver: Any) -> list[str]:
    """The peer ids of the swarm table's rows, in order (read in one go: rows change)."""
    return list(driver.execute_script(
        "return [...document.querySelectorAll('#swarm-table tbody tr')].map(r => r.dataset.peer)"
    ))


def _field(driver: Any, name: str) -> str:
    return str(driver.execute_script(
        "const e = document.querySelector(`#answer-meta [data-field=\"${arguments[0]}\"]`);"
        "return e ? e.textContent : '';", name
    ))


def _cached_blocks(driver: Any, peer_id: str) -> int:
    text = driver.execute_script(  # the "Cached blocks" cell: "5 / 131072"
        "const r = document.querySelector(`tr[data-peer=\"${arguments[0]}\"]`);"
        "return r ? r.cells[6].textContent : '0';", peer_id
    )
    return int(str(text).split("/")[0])


def _ask(driver: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Type `prompt`, send it with the keyboard, wait for the end; what the page showed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.execute_script(  # count the answer's updates: it streams if there are several
        "window.__updates = 0; new MutationObserver((r) => { window.__updates += r.length; })"
        ".observe(document.getElementById('answer'),"
        " {childList: true, characterData: true, subtree: true});"
        "document.getElementById('answer-meta').replaceChildren();"
    )
    limit = driver.find_element(By.ID, "max-tokens")
    limit.clear()
    limit.send_keys(str(max_tokens))
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    box.send_keys(Keys.CONTROL, Keys.ENTER)  # keyboard only
    _wait(driver, ANSWER_WITHIN_S, lambda d: _field(d, "state") not in ("", WAITING),
          "the answer completes")
    return {
        "state": _field(driver, "state"),
        "answer": driver.find_element(By.ID, "answer").text,
        "updates": driver.execute_script("return window.__updates"),
        "served_by": driver.find_element(By.ID, "answer-meta").get_attribute("data-served-by"),
        "cached": int(_field(driver, "cached")),
        "prompt_tokens": int(_field(driver, "prompt")),
    }


def test_the_page_shows_the_swarm_streams_answers_and_drops_a_dead_peer(local_swarm, browser):
    ids = [p["peer_id"] for p in local_swarm["peers"]]
    browser.get(local_swarm["http"] + "/")
    took = _wait(browser, TABLE_WITHIN_S, lambda d: sorted(_rows(d)) == sorted(ids),
                 "the table lists the 3 peers")
    assert _rows(browser)[0] == ids[0]  # this peer (the entry) first
    print(f"table lists 3 peers after {took:.2f} s")

    first = _ask(browser, PROMPT, 32)
    assert first["state"] == "done" and first["answer"]
    assert first["updates"] >= 2, "the answer arrived in one piece: not streamed"
    assert first["served_by"] in ids
    assert 0 <= first["cached"] < first["prompt_tokens"]
    # The serving peer's cache holds the prompt once its summary says so (the page shows it):
    # only then can the entry route a prompt sharing the prefix to it.
    _wait(browser, 5 * SUMMARY_INTERVAL_S, lambda d: _cached_blocks(d, first["served_by"]) > 0,
          "the serving peer's row shows its cached blocks")

    second = _ask(browser, PROMPT + "And what did the dog do then?", 8)
    assert second["state"] == "done" and second["answer"]
    assert second["cached"] > 0, (first, second, _get(local_swarm["http"] + "/v1/requests"))
    print(f"first: {first}\nsecond: {second}")

    _wait(browser, 5 * SUMMARY_INTERVAL_S, lambda d: d.execute_script(
        "return [...document.querySelectorAll('#req-table tbody tr')]"
        ".filter((r) => r.dataset.request).length") == 2,
        "both requests in the recent requests table")
    routes = browser.execute_script(
        "return [...document.querySelectorAll('#req-table tbody tr')].map(r => r.textContent)"
    )
    assert all("why chosen" in text for text in routes)  # each with its route and reasons

    victim = local_swarm["peers"][2]
    age = browser.execute_script(  # of its last summary, as the page last showed it
        "const r = document.querySelector(`tr[data-peer=\"${arguments[0]}\"]`);"
        "return r.cells[7].textContent;", victim["peer_id"]
    )
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    _wait(browser, 4 * SUMMARY_INTERVAL_S, lambda d: victim["peer_id"] not in _rows(d),
          "the killed peer's row goes")
    gone_after = time.monotonic() - killed_at
    print(f"killed peer's row gone after {gone_after:.2f} s (its summary was {age} old)")
    # A peer leaves the table 3 intervals after its last summary, which came up to one
    # interval before the kill; the page polls 4 times an interval.
    assert gone_after <= 3 * SUMMARY_INTERVAL_S + PAGE_POLL_S
    assert sorted(_rows(browser)) == sorted(ids[:2])
