"""The peer's page on a local swarm, in headless Chromium: what it shows, when, and pictures.

    python -m bench.web_page --json out/web.json [--model smollm2-135m] [--peers 3]
                             [--shots docs/img] [--requests 6]

Starts `prefixswarm local`, sends the demo's MMLU prompts (5-shot, two subjects, so
prefixes repeat) entering at each peer in turn, opens the first peer's page (1366 px
wide, a laptop), times until its table lists every peer, asks a question in its prompt
box, saves screenshots (--shots), then kills the last peer and times until its row goes.
Progress goes to stderr; the JSON to --json and stdout.

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package; the helpers
here also drive tests/test_web_browser.py.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.report import emit_json

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)
LAPTOP = (1366, 900)  # window size, pixels
WAITING = "waiting for the first token…"  # the page's answer state while a request runs
STOP_GRACE_S = 30.0  # `prefixswarm local` stops its peers in seconds


class PageTimeout(AssertionError):
    """The page did not show something in time."""


def browser_missing() -> list[str]:
    return [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]


@contextmanager
def open_browser(profile: Path, size: tuple[int, int] = LAPTOP) -> Iterator[Any]:
    """A headless Chromium (Selenium WebDriver) with a fresh profile in `profile`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--window-size={size[0]},{size[1]}",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@contextmanager
def open_local_swarm(
    log_path: Path, *, peers: int, model: str, summary_interval_s: float, ready_s: float
) -> Iterator[dict[str, Any]]:
    """`prefixswarm local --json` in a process: its ready report (pids, ids, HTTP URLs).
    Stopped with SIGINT on exit (it stops its peers), killed if it does not."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "peer.cli", "local", "--peers", str(peers),
             "--model", model, "--http", "127.0.0.1:0",
             "--summary-interval", str(summary_interval_s), "--json"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
        )
        try:
            assert process.stdout is not None
            ready, _, _ = select.select([process.stdout], [], [], ready_s)
            line = process.stdout.readline() if ready else b""
            if not line:
                raise RuntimeError(
                    f"the local swarm was not ready in {ready_s} s:\n" + log_path.read_text()
                )
            report = json.loads(line)
            if report.get("event") != "ready" or len(report["peers"]) != peers:
                raise RuntimeError(f"unexpected report from prefixswarm local: {report}")
            yield report
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def post_json(url: str, body: dict[str, Any], timeout_s: float = 300.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


# -- reading the page --------------------------------------------------------------------


def wait(driver: Any, timeout_s: float, condition: Callable[[Any], Any], what: str) -> float:
    """Seconds until `condition(driver)` holds; PageTimeout naming `what` after `timeout_s`."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    start = time.monotonic()
    try:
        WebDriverWait(driver, timeout_s, poll_frequency=0.05).until(condition)
    except TimeoutException:
        raise PageTimeout(f"not within {timeout_s} s: {what}") from None
    return time.monotonic() - start


def rows(driver: Any) -> list[str]:
    """The peer ids of the swarm table's rows, in order (read in one go: rows change)."""
    return list(driver.execute_script(
        "return [...document.querySelectorAll('#swarm-table tbody tr')].map(r => r.dataset.peer)"
    ))


def row_cell(driver: Any, peer_id: str, index: int) -> str:
    """The text of a swarm table row's cell (0 the peer, 6 cached blocks, 7 summary age)."""
    return str(driver.execute_script(
        "const r = document.querySelector(`tr[data-peer=\"${arguments[0]}\"]`);"
        "return r ? r.cells[arguments[1]].textContent : '';", peer_id, index
    ))


def cached_blocks(driver: Any, peer_id: str) -> int:
    text = row_cell(driver, peer_id, 6)  # "5 / 131072"
    return int(text.split("/")[0]) if text else 0


def request_rows(driver: Any) -> list[str]:
    """The recent requests table's rows, as text."""
    return list(driver.execute_script(
        "return [...document.querySelectorAll('#req-table tbody tr')]"
        ".filter((r) => r.dataset.request).map((r) => r.textContent)"
    ))


def answer_field(driver: Any, name: str) -> str:
    return str(driver.execute_script(
        "const e = document.querySelector(`#answer-meta [data-field=\"${arguments[0]}\"]`);"
        "return e ? e.textContent : '';", name
    ))


def ask(driver: Any, prompt: str, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    """Type `prompt` into "Try it", send it with the keyboard, wait for the end; what the
    page showed (and how many times the answer changed: more than once means it streamed)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.execute_script(
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
    wait(driver, timeout_s, lambda d: answer_field(d, "state") not in ("", WAITING),
         "the answer completes")
    return {
        "state": answer_field(driver, "state"),
        "answer": driver.execute_script("return document.getElementById('answer').textContent"),
        "updates": driver.execute_script("return window.__updates"),
        "served_by": driver.find_element(By.ID, "answer-meta").get_attribute("data-served-by"),
        "cached": int(answer_field(driver, "cached") or -1),
        "prompt_tokens": int(answer_field(driver, "prompt") or -1),
        "ttft": answer_field(driver, "ttft"),
    }


def full_page_screenshot(driver: Any, path: Path, width: int = LAPTOP[0]) -> None:
    """The whole page at `width` (a viewport as tall as the page, through DevTools)."""
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(path))
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


# -- the bench ---------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"bench.web_page: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from peer.demo_data import demo_prompts

    out: dict[str, Any] = {"model": args.model, "peers": args.peers}
    started = time.monotonic()
    with open_local_swarm(workdir / "local.log", peers=args.peers, model=args.model,
                          summary_interval_s=args.summary_interval,
                          ready_s=args.ready_timeout) as swarm:
        out["swarm_ready_s"] = round(time.monotonic() - started, 2)
        log(f"swarm ready in {out['swarm_ready_s']} s")
        peers = swarm["peers"]
        names = {p["peer_id"]: f"peer {p['index']}" for p in peers}
        sent = []
        for i, (subject, prompt, _) in enumerate(demo_prompts()[: args.requests]):
            entry = peers[i % len(peers)]
            body = post_json(entry["http"] + "/v1/completions", {
                "prompt": prompt, "max_tokens": 4, "temperature": 0, "stop": ["\n"]})
            sent.append({
                "subject": subject, "entry": names[entry["peer_id"]],
                "served_by": names.get(body["x_prefixswarm"]["served_by"], "?"),
                "prompt_tokens": body["usage"]["prompt_tokens"],
                "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"],
            })
            log(f"request {i + 1}: {sent[-1]}")
        out["requests"] = sent
        with open_browser(workdir / "chromium") as driver:
            driver.get(swarm["http"] + "/")
            ids = sorted(p["peer_id"] for p in peers)
            out["table_lists_every_peer_s"] = round(
                wait(driver, 30, lambda d: sorted(rows(d)) == ids, "every peer listed"), 2)
            question = "In one sentence: why does a swarm of peers share a prefix cache?"
            answer = ask(driver, question, args.max_tokens, timeout_s=300)
            out["try_it"] = {k: answer[k] for k in ("state", "cached", "prompt_tokens", "ttft")}
            out["try_it"]["served_by"] = names.get(answer["served_by"], "?")
            out["try_it"]["answer_updates"] = answer["updates"]
            log(f"try it: {out['try_it']}")
            entered = 1 + sum(r["entry"] == "peer 1" for r in sent)
            wait(driver, 10, lambda d: len(request_rows(d)) == entered,
                 "every request entered at peer 1 in its table")
            time.sleep(2 * args.summary_interval)  # the peers' next summaries: loads settle
            if args.shots:
                driver.execute_script(  # show the routers' reasons in the picture
                    "document.querySelectorAll('#req-table details').forEach((d) => {"
                    " d.open = true; });"
                )
                full_page_screenshot(driver, Path(args.shots) / "web-page.png")
                driver.execute_script("window.scrollTo(0, 0)")
                driver.save_screenshot(str(Path(args.shots) / "web-page-top.png"))
                log(f"screenshots in {args.shots}")
            victim = peers[-1]
            age = row_cell(driver, victim["peer_id"], 7)
            os.kill(victim["pid"], signal.SIGKILL)
            killed = time.monotonic()
            wait(driver, 10 * args.summary_interval, lambda d: victim["peer_id"] not in rows(d),
                 "the killed peer's row goes")
            out["row_gone_after_kill_s"] = round(time.monotonic() - killed, 2)
            out["victim_summary_age_at_kill"] = age
            out["summary_interval_s"] = args.summary_interval
            log(f"killed peer's row gone after {out['row_gone_after_kill_s']} s")
    return out


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m bench.web_page", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the JSON here too")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--requests", type=int, default=6, help="demo prompts sent first")
    parser.add_argument("--max-tokens", type=int, default=32, help="for the prompt box")
    parser.add_argument("--summary-interval", type=float, default=1.0)
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--shots", help="folder for web-page.png and web-page-top.png")
    args = parser.parse_args(argv)
    missing = browser_missing()
    if missing:
        print(f"missing {', '.join(missing)}: apt-get install chromium chromium-driver",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-web-") as tmp:
        out = run(args, Path(tmp))
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
