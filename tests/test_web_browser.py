"""The peer's page in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by Selenium) against `prefixswarm local --peers 3 --model
tiny-random`. The page lists the 3 peers within 10 s; a prompt typed into it streams an
answer and shows its serving peer and cached tokens; a second prompt sharing a prefix
shows cached tokens > 0; a killed peer's row goes within 3 summary intervals (plus one
page poll: see the last assertion). With an API key, the page asks for it and keeps it in
the tab only. Fields other parts add (nat's link and reachability, trust's ledger view)
and failed routes show as text, from fixed feeds.

make test installs chromium and chromium-driver when they are missing and it runs as root;
on a machine without them these tests are skipped (under CI they fail instead). The
browser helpers live in bench/web_page.py, which also takes the README's screenshots.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.web_page import (
    PageTimeout,
    answer_field,
    ask,
    browser_missing,
    cached_blocks,
    get_json,
    open_browser,
    open_local_swarm,
    request_rows,
    row_cell,
    rows,
    wait,
)
from protocols.invite import decode_invite

SUMMARY_INTERVAL_S = 1.0  # `prefixswarm local`'s default, passed explicitly
PAGE_POLL_S = SUMMARY_INTERVAL_S / 4  # peer/api/web/app.js polls 4 times an interval
SWARM_READY_S = 120.0  # three interpreters loading torch on a loaded 2-core machine
TABLE_WITHIN_S = 10.0  # the bound for the table to list every peer
ANSWER_WITHIN_S = 30.0
# ~420 tokens and a short answer for the second prompt: the prefill a cache saves then
# outweighs the peers' differences in decode speed, so the cost policy routes the second
# prompt to a peer holding the first (with 90 tokens and 32 to decode it need not).
PROMPT = "The quick brown fox jumps over the lazy dog. " * 40

pytestmark = pytest.mark.slow  # a browser, and for the first test 4 processes: ~30 s


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    missing = browser_missing()
    if missing:
        message = f"{', '.join(missing)} missing: apt-get install chromium chromium-driver"
        if os.environ.get("CI"):
            pytest.fail(message + " (make test installs them as root)")
        pytest.skip(message)
    with open_browser(tmp_path / "chromium") as driver:
        yield driver


@pytest.fixture
def local_swarm(tmp_path: Path) -> Iterator[dict[str, Any]]:
    started = time.monotonic()
    with open_local_swarm(tmp_path / "local.log", peers=3, model="tiny-random",
                          summary_interval_s=SUMMARY_INTERVAL_S,
                          ready_s=SWARM_READY_S) as report:
        print(f"local swarm ready after {time.monotonic() - started:.1f} s")
        yield report


def _wait(driver: Any, timeout_s: float, condition: Any, what: str) -> float:
    try:
        return wait(driver, timeout_s, condition, what)
    except PageTimeout as exc:
        pytest.fail(str(exc))


def _ask(driver: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    try:
        return ask(driver, prompt, max_tokens, ANSWER_WITHIN_S)
    except PageTimeout as exc:
        pytest.fail(f"{exc} (state: {answer_field(driver, 'state')!r})")


# Its bound on a dead peer's row (3.5 s from the kill) leaves 0.4 s to spare at load 7
# (gone after 3.08 s): `make test` runs it alone, after the parallel part.
@pytest.mark.serial
def test_the_page_shows_the_swarm_streams_answers_and_drops_a_dead_peer(local_swarm, browser):
    ids = [p["peer_id"] for p in local_swarm["peers"]]
    browser.get(local_swarm["http"] + "/")
    took = _wait(browser, TABLE_WITHIN_S, lambda d: sorted(rows(d)) == sorted(ids),
                 "the table lists the 3 peers")
    assert rows(browser)[0] == ids[0]  # this peer (the entry) first
    print(f"table lists 3 peers after {took:.2f} s")
    invite = browser.find_element("id", "invite").text.removeprefix("prefixswarm serve --join ")
    assert decode_invite(invite).bootstrap[0] == local_swarm["peers"][0]["multiaddrs"][0]
    assert browser.find_element("id", "copy-invite").is_enabled()
    assert row_cell(browser, ids[1], 9).startswith("prefixswarm/")  # its software version

    first = _ask(browser, PROMPT, 32)
    assert first["state"] == "done" and first["answer"]
    assert first["updates"] >= 2, "the answer arrived in one piece: not streamed"
    assert first["served_by"] in ids
    assert 0 <= first["cached"] < first["prompt_tokens"]
    # The serving peer's cache holds the prompt once its summary says so (the page shows it):
    # only then can the entry route a prompt sharing the prefix to it.
    _wait(browser, 5 * SUMMARY_INTERVAL_S, lambda d: cached_blocks(d, first["served_by"]) > 0,
          "the serving peer's row shows its cached blocks")

    second = _ask(browser, PROMPT + "And what did the dog do then?", 8)
    assert second["state"] == "done" and second["answer"]
    assert second["cached"] > 0, (first, second, get_json(local_swarm["http"] + "/v1/requests"))
    print(f"first: {first}\nsecond: {second}")

    _wait(browser, 5 * SUMMARY_INTERVAL_S, lambda d: len(request_rows(d)) == 2,
          "both requests in the recent requests table")
    assert all("why chosen" in text for text in request_rows(browser))  # routes, reasons

    victim = local_swarm["peers"][2]
    age = row_cell(browser, victim["peer_id"], 7)  # of its last summary, as last shown
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    _wait(browser, 4 * SUMMARY_INTERVAL_S, lambda d: victim["peer_id"] not in rows(d),
          "the killed peer's row goes")
    gone_after = time.monotonic() - killed_at
    print(f"killed peer's row gone after {gone_after:.2f} s (its summary was {age} old)")
    # A peer leaves the table 3 intervals after the last summary it *received* from it,
    # which came up to an interval before the kill (later under load: measured 2.2-3.1 s
    # here, docs/web.md); the page drops the row at that moment, between polls too. The
    # slack of two polls is for Chromium's timers and a loaded machine.
    assert gone_after <= 3 * SUMMARY_INTERVAL_S + 2 * PAGE_POLL_S
    assert sorted(rows(browser)) == sorted(ids[:2])


# -- the API key -------------------------------------------------------------------------

API_KEY = "s3cret-key"


class _KeyRequired:
    """ASGI middleware standing in for `serve --api-key`: 401 without `Bearer API_KEY`,
    except for the page's own files (PAGE_PATHS) and /health."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from starlette.responses import JSONResponse

        from peer.api.web.routes import PAGE_PATHS

        if scope["type"] == "http" and scope["path"] not in PAGE_PATHS | {"/health"}:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if given != f"Bearer {API_KEY}".encode():
                body = {"error": {"message": "a valid API key is required", "param": None,
                                  "type": "invalid_request_error", "code": "invalid_api_key"}}
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _storage(driver: Any) -> dict[str, Any]:
    return dict(driver.execute_script(
        "return {session: {...sessionStorage}, local: {...localStorage},"
        " cookies: document.cookie}"
    ))


def _visible(driver: Any, element_id: str) -> bool:
    return bool(driver.execute_script(
        "const e = document.getElementById(arguments[0]); return !!e && !e.hidden;", element_id
    ))


async def test_the_page_asks_for_the_api_key_and_keeps_it_in_the_tab(
    nursery, tiny_engine_factory, browser
):
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from peer.api.http import HttpApi
    from peer.config import PeerConfig
    from tests.helpers_swarm import start_peer

    config = PeerConfig(model="tiny-random", listen_addrs=("/ip4/127.0.0.1/tcp/0",),
                        identity_file=None)
    running = await start_peer(nursery, config, tiny_engine_factory())
    hypercorn = Config()
    hypercorn.bind = ["127.0.0.1:0"]
    hypercorn.accesslog = hypercorn.errorlog = None
    app = _KeyRequired(HttpApi(running.peer).app)
    (url,) = await nursery.start(lambda task_status: serve(app, hypercorn,
                                                           task_status=task_status))

    def enter_key(key: str) -> None:
        box = browser.find_element(By.ID, "key-input")
        box.send_keys(key)
        box.send_keys(Keys.ENTER)  # keyboard only

    def drive() -> None:
        browser.get(url + "/")
        _wait(browser, 10, lambda d: _visible(d, "key-form"), "the page asks for the key")
        assert rows(browser) == []  # nothing shown without it
        enter_key("wrong")
        _wait(browser, 10, lambda d: "refused" in d.find_element(By.ID, "status").text,
              "a wrong key is refused")
        enter_key(API_KEY)
        _wait(browser, 10, lambda d: rows(d) == [running.peer.peer_id], "the table with the key")
        assert not _visible(browser, "key-form")
        assert _ask(browser, "Hello there, little model.", 4)["state"] == "done"  # Bearer too
        stored = _storage(browser)
        assert stored["session"] == {"prefixswarm-api-key": API_KEY}  # this tab only...
        assert stored["local"] == {} and stored["cookies"] == ""  # ...nowhere else
        browser.refresh()  # the same tab keeps it
        _wait(browser, 10, lambda d: rows(d) == [running.peer.peer_id], "the table after reload")
        assert not _visible(browser, "key-form")

    await trio.to_thread.run_sync(drive)


# -- fields other parts of the peer add ---------------------------------------------------

B, C = "12D3KooWBBBBBBBBBBBBbbbbbbbb", "12D3KooWCCCCCCCCCCCCcccccccc"
HOSTILE = '<img src=x id="injected">'  # text from other peers is shown, never parsed


def _fake_feeds() -> tuple[dict[str, Any], dict[str, Any]]:
    swarm = {
        "self": {"peer_id": "12D3KooWAAAAAAAAAAAAaaaaaaaa", "addrs": ["/ip4/10.0.0.1/tcp/1"],
                 "model": "tiny-random", "block_size": 16, "cached_blocks": 5,
                 "capacity_blocks": 10, "queued_prompt_tokens": 0, "running_requests": 1,
                 "prefill_tokens_per_s": 900.0, "decode_tokens_per_s": 50.0,
                 "policy": "cost", "reachability": "private"},
        "peers": [
            {"peer_id": B, "addrs": ["/ip4/1.2.3.4/tcp/4001/p2p-circuit/p2p/" + B],
             "rtt_s": 0.0123, "summary_age_s": 0.5, "cached_blocks": 7,
             "capacity_blocks": 10, "queued_prompt_tokens": 30, "running_requests": 2,
             "prefill_tokens_per_s": 800.0, "decode_tokens_per_s": 40.0, "link": "relayed",
             "trust": {"state": "quarantined", "reason": "wrong tokens " + HOSTILE,
                       "verified": 3, "served": 9, "discount": 0.5, "claims": "ignored"}},
            {"peer_id": C, "addrs": [], "rtt_s": None, "summary_age_s": 1.5,
             "cached_blocks": 0, "capacity_blocks": 10, "queued_prompt_tokens": 0,
             "running_requests": 0, "prefill_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0,
             "link": None},
        ],
    }
    step = {"peer_id": B, "local": False, "outcome": "failed", "detail": "reset " + HOSTILE,
            "tokens": 0, "reason": "peer B [cost]: ~3 blocks matched (Bloom)"}
    activity = {
        "peer_id": swarm["self"]["peer_id"], "summary_interval_s": 1.0, "summary_expiry_s": 60,
        "requests": {"entered": 1, "served_here": 0, "forwarded": 0, "served_for_others": 0,
                     "by_outcome": {"ok": 0, "failed": 1}},
        "engine": {"prompt_tokens": 0, "cached_tokens": 0, "hit_ratio": None},
        "recent": [{"request_id": "r1", "age_s": 2.0, "outcome": "failed", "prompt_tokens": 40,
                    "cached_tokens": 0, "completion_tokens": 0, "ttft_s": None,
                    "total_s": None, "served_by": "", "route": [step, {**step, "peer_id": C}],
                    "error": "no peer could serve it"}],
        "history": [],
    }
    return swarm, activity


async def test_the_page_shows_links_reachability_trust_and_failures_as_text(nursery, browser):
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from peer.api.web.routes import index, web_asset

    swarm, activity = _fake_feeds()

    async def swarm_json(request: Any) -> JSONResponse:
        return JSONResponse(swarm)

    async def activity_json(request: Any) -> JSONResponse:
        return JSONResponse(activity)

    app = Starlette(routes=[
        Route("/", index), Route("/web/{name}", web_asset),
        Route("/v1/swarm", swarm_json), Route("/v1/requests", activity_json),
    ])
    hypercorn = Config()
    hypercorn.bind = ["127.0.0.1:0"]
    hypercorn.accesslog = hypercorn.errorlog = None
    (url,) = await nursery.start(lambda task_status: serve(app, hypercorn,
                                                           task_status=task_status))

    def drive() -> None:
        browser.get(url + "/")
        _wait(browser, 10, lambda d: len(rows(d)) == 3, "3 rows")
        me = swarm["self"]["peer_id"]
        assert row_cell(browser, me, 2) == "reachability: private"
        assert row_cell(browser, B, 1) == "/ip4/1.2.3.4/tcp/4001/p2p-circuit"
        assert row_cell(browser, B, 2) == "relayed"
        assert row_cell(browser, B, 3) == "12.3 ms"
        assert row_cell(browser, B, 4) == "2 running, 30 queued tok"
        assert row_cell(browser, B, 8) == (
            f"quarantined, claims ignored, 3 verified: wrong tokens {HOSTILE}"
        )
        assert "trust-quarantined" in browser.execute_script(
            f"return document.querySelector('tr[data-peer=\"{B}\"]').className")
        assert [row_cell(browser, C, i) for i in (1, 2, 3, 8)] == ["-", "not connected", "-", "-"]
        facts = browser.find_element("id", "self-facts").text
        assert "Reachability\nprivate" in facts and "1 failed" in facts
        _wait(browser, 10, lambda d: len(request_rows(d)) == 1, "the failed request")
        (text,) = request_rows(browser)
        assert "FAILED" in text and "no peer could serve it" in text
        assert text.count("failed — reset") == 2  # both candidates, in order, with causes
        assert browser.execute_script("return document.getElementById('injected')") is None

    await trio.to_thread.run_sync(drive)
