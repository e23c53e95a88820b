"""The OpenAI-compatible HTTP API, driven by the official `openai` client (tiny-random).

One in-process peer with its HTTP API on 127.0.0.1:0 per test; greedy answers are
compared with a fresh engine's local output.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import trio

from peer.api.http import MAX_BODY_BYTES, SERVED_BY_HEADER, serve_http
from peer.config import PeerConfig, Policy
from peer.engine.engine import SamplingParams
from tests.helpers_engine import SlowEngine
from tests.helpers_swarm import start_peer, wait_until

MODEL = "tiny-random"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # 60 tokens: 3 full blocks


async def start_api(nursery: trio.Nursery, engine: Any, **overrides: Any) -> tuple[Any, str]:
    fields: dict[str, Any] = dict(
        model=MODEL, listen_addrs=("/ip4/127.0.0.1/tcp/0",), identity_file=None
    )
    fields.update(overrides)
    running = await start_peer(nursery, PeerConfig(**fields), engine)
    url = await running.peer.start_service(serve_http, running.peer, "127.0.0.1", 0)
    return running.peer, url


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def local_text(factory: Any, prompt: Any, max_tokens: int) -> str:
    engine = factory()
    tokens = engine.encode_prompt(prompt)
    completion = await engine.generate(tokens, SamplingParams(max_new_tokens=max_tokens))
    return str(completion.text)


async def test_completion_matches_local_and_reports_cache(nursery, tiny_engine_factory):
    peer, url = await start_api(nursery, tiny_engine_factory())
    api = client(url)
    raw = await api.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0
    )
    first = raw.parse()
    assert raw.headers[SERVED_BY_HEADER] == peer.peer_id
    assert first.choices[0].text == await local_text(tiny_engine_factory, PROMPT, 6)
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 6
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    extension = first.model_extra["x_prefixswarm"]
    assert extension["served_by"] == peer.peer_id
    assert [a["outcome"] for a in extension["route"]] == ["ok"]

    again = await api.completions.create(
        model="tiny-random", prompt=[PROMPT + " again"], max_tokens=2, temperature=0
    )
    assert again.usage.prompt_tokens_details.cached_tokens == 48  # 3 blocks of 16
    assert again.usage.total_tokens == again.usage.prompt_tokens + 2


async def test_chat_streaming_equals_non_streaming(nursery, tiny_engine_factory):
    _, url = await start_api(nursery, tiny_engine_factory())
    api = client(url)
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = await api.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    assert text == await local_text(tiny_engine_factory, messages, 8)

    stream = await api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    deltas, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(deltas) == text
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 8
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same chat, cached by the first


async def test_completion_streaming(nursery, tiny_engine_factory):
    peer, url = await start_api(nursery, tiny_engine_factory())
    stream = await client(url).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True, stop=["\x00"]
    )
    pieces, served = [], None
    async for chunk in stream:
        pieces.append(chunk.choices[0].text)
        served = (chunk.model_extra or {}).get("x_prefixswarm", {}).get("served_by", served)
    assert "".join(pieces) == await local_text(tiny_engine_factory, PROMPT, 5)
    assert served == peer.peer_id


JSON = "application/json"  # a body not declared JSON is refused first (test_http_hardening)


async def test_errors_are_openai_error_objects(nursery, tiny_engine_factory):
    _, url = await start_api(nursery, tiny_engine_factory())
    api = client(url)
    async with httpx.AsyncClient(base_url=url, headers={"content-type": JSON}) as http:
        r = await http.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == "invalid_json"
        r = await http.post("/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1))
        assert r.status_code == 413
        r = await http.post("/v1/completions", json={"prompt": "hi", "temperature": "hot"})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "temperature")

    with pytest.raises(openai.NotFoundError) as info:  # 404, as OpenAI answers
        await api.completions.create(model="gpt-4", prompt="hi")
    assert info.value.code == "model_not_found" and "tiny-random" in info.value.message

    with pytest.raises(openai.BadRequestError) as info:
        await api.completions.create(model=MODEL, prompt="word " * 2100, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    assert "2048" in info.value.message

    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2
        )
    assert info.value.param == "n"

    with pytest.raises(openai.BadRequestError) as info:
        await api.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert info.value.param == "max_tokens"


async def test_overload_gives_429_with_retry_after(nursery, tiny_engine_factory):
    engine = SlowEngine(tiny_engine_factory(), delay_s=0.5)
    _, url = await start_api(nursery, engine, max_queue=1, policy=Policy.LOCAL)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "stream": True}
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as busy,
    ):
        assert busy.status_code == 200  # headers come with the first token: it is running
        with pytest.raises(openai.RateLimitError) as info:
            await client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.code == "overloaded"


async def test_client_disconnect_cancels_generation(nursery, tiny_engine_factory):
    inner = tiny_engine_factory()
    peer, url = await start_api(nursery, SlowEngine(inner, delay_s=0.2))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True}
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # one event received; now hang up
    await wait_until(
        lambda: inner.statistics()["cancelled_requests"] == 1,
        timeout_s=10,
        what="the engine request is cancelled",
    )
    stats = inner.statistics()
    assert stats["completed_requests"] == 0
    assert stats["generated_tokens"] < 10  # of 200 asked: it stopped right after the hang-up
    assert stats["running_requests"] == 0
    # Nothing runs any more: a probe through the same engine runs its own steps (a request
    # left in the batch would gain tokens in them) and adds its one token only.
    await inner.generate([11, 12, 13], SamplingParams(max_new_tokens=1))
    assert inner.statistics()["generated_tokens"] == stats["generated_tokens"] + 1
    assert peer.statistics()["serving"]["pipeline"]["entry_in_flight"] == 0


async def test_models_swarm_health_metrics(nursery, tiny_engine_factory):
    engine = tiny_engine_factory()
    peer, url = await start_api(nursery, engine, model="tiny-random")
    api = client(url)
    models = await api.models.list()
    assert [m.id for m in models.data] == ["tiny-random", engine.model_id]  # name, full id
    await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    async with httpx.AsyncClient(base_url=url) as http:
        health = (await http.get("/health")).json()
        assert health["status"] == "ok" and health["peer_id"] == peer.peer_id
        swarm = (await http.get("/v1/swarm")).json()
        assert swarm["self"]["peer_id"] == peer.peer_id
        assert swarm["self"]["cached_blocks"] == 3
        assert swarm["peers"] == []
        assert swarm["gossip_counts"]["accepted"] == {}  # alone: nobody to hear
        metrics = (await http.get("/metrics")).text
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
             for line in metrics.splitlines() if line and not line.startswith("#")}
    assert lines['prefixswarm_http_requests_total{endpoint="completions",status="200"}'] == 1
    assert lines['prefixswarm_tokens_total{kind="completion"}'] == 3
    assert lines["prefixswarm_time_to_first_token_seconds_count"] == 1
    assert lines["prefixswarm_peers_known"] == 0
    assert lines['prefixswarm_served_total{where="local"}'] == 1
    assert "prefixswarm_gossip_bytes_total" in json.dumps(list(lines))
    assert lines["prefixswarm_prefix_cache_queries_total"] == 61
    assert lines["prefixswarm_prefix_cache_hits_total"] == 0
