"""The peer's page: its files, /v1/requests, and the RequestLog fed by the request path.

In-process peers (tiny-random) on 127.0.0.1:0; the browser test against a real local
swarm is in tests/test_web_browser.py.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from peer.api.web.routes import ASSETS
from peer.config import Policy
from tests.helpers_engine import SlowEngine
from tests.helpers_swarm import wait_until
from tests.test_http import MODEL, PROMPT, client, start_api


async def test_the_page_and_its_files_are_served_with_a_strict_policy(
    nursery, tiny_engine_factory
):
    _, url = await start_api(nursery, tiny_engine_factory())
    async with httpx.AsyncClient(base_url=url) as http:
        page = await http.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for src in ("/web/app.js", "/web/style.css", "/web/icon.svg"):
            assert src in page.text
            asset = await http.get(src)
            assert asset.status_code == 200 and asset.content
            assert asset.headers["content-type"] == ASSETS[src.rsplit("/", 1)[1]]
        # Nothing outside the fixed list: no other file, no path out of the package.
        for bad in ("/web/routes.py", "/web/__init__.py", "/web/..%2Froutes.py", "/web/x.js"):
            response = await http.get(bad)
            assert response.status_code == 404, bad
        assert "http://" not in page.text and "https://" not in page.text  # nothing remote


async def test_requests_feed_shows_each_request_with_its_route(nursery, tiny_engine_factory):
    peer, url = await start_api(nursery, tiny_engine_factory(), summary_interval_s=0.2)
    api = client(url)
    await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    await api.completions.create(model=MODEL, prompt=PROMPT + " More.", max_tokens=4)
    async with httpx.AsyncClient(base_url=url) as http:
        feed = (await http.get("/v1/requests")).json()
    assert feed["peer_id"] == peer.peer_id
    assert feed["summary_interval_s"] == peer.config.summary_interval_s
    assert feed["summary_expiry_s"] == peer.config.summary_expiry_s
    assert feed["requests"]["entered"] == 2 and feed["requests"]["served_here"] == 2
    assert feed["requests"]["by_outcome"]["ok"] == 2
    assert feed["engine"]["cached_tokens"] == 48 and feed["engine"]["hit_ratio"] > 0
    second, first = feed["recent"]
    assert first["cached_tokens"] == 0 and second["cached_tokens"] == 48  # 3 blocks of 16
    assert second["prompt_tokens"] > first["prompt_tokens"]
    for record in feed["recent"]:
        assert record["outcome"] == "ok" and record["served_by"] == peer.peer_id
        assert record["completion_tokens"] == 4 and 0 < record["ttft_s"] <= record["total_s"]
        (step,) = record["route"]
        assert step["peer_id"] == peer.peer_id and step["local"] and step["outcome"] == "ok"
        assert step["reason"].startswith(f"self {peer.peer_id}")  # the router's account

    # The chart's samples, one every 0.2 s (the summary interval): the next one has both.
    async with httpx.AsyncClient(base_url=url) as http:
        with trio.fail_after(5):
            while (history := (await http.get("/v1/requests")).json()["history"])[-1][
                "hit_ratio"
            ] != feed["engine"]["hit_ratio"]:
                await trio.sleep(0.1)
    assert history[0]["hit_ratio"] is None  # sampled at start, before any prompt
    assert [h["age_s"] for h in history] == sorted((h["age_s"] for h in history), reverse=True)
    cache = peer.engine.cache
    assert history[-1]["fill"] == cache.num_blocks / cache.capacity_blocks > 0


async def test_refused_and_abandoned_requests_are_logged(nursery, tiny_engine_factory):
    inner = tiny_engine_factory()
    peer, url = await start_api(
        nursery, SlowEngine(inner, delay_s=0.2), max_queue=1, policy=Policy.LOCAL
    )
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 50, "stream": True}
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as busy,
    ):
        assert busy.status_code == 200
        refused = await http.post("/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 429
    log = peer.serving.requests
    await wait_until(lambda: len(log) == 2, timeout_s=10, what="both requests logged")
    abandoned, overloaded = log.records()  # the refusal ended first
    assert overloaded.outcome.value == "overloaded" and "overloaded" in overloaded.error
    assert overloaded.prompt_tokens > 0 and overloaded.ttft_s is None
    assert abandoned.outcome.value == "cancelled" and abandoned.served_by == ""


async def test_invalid_requests_are_not_logged(nursery, tiny_engine_factory):
    _, url = await start_api(nursery, tiny_engine_factory())
    async with httpx.AsyncClient(base_url=url) as http:
        bad = await http.post("/v1/completions", json={"prompt": [10**9], "max_tokens": 2})
        assert bad.status_code == 400
        assert (await http.get("/v1/requests")).json()["recent"] == []


@pytest.mark.parametrize("name", sorted(ASSETS))
def test_assets_ship_in_the_package(name):
    from peer.api.web.routes import asset

    assert asset(name)
