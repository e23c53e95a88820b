"""HTTP hardening and private requests over HTTP, tiny-random:
bad input is a 4xx error object, bugs are counted 500s, bursts are accepted, every 429 and
503 says Retry-After, an optional API key, and `cache_salt`."""

from __future__ import annotations

import functools
from typing import Any

import httpx
import openai
import pytest
import trio

from peer.api.http import LISTEN_BACKLOG, error_for, hypercorn_config, serve_http
from peer.api.openai_schema import ApiError
from peer.request.pipeline import RequestFailed
from tests.test_http import MODEL, PROMPT, client, start_api

KEY = "sk-test-0123456789"


def metric_lines(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


async def test_lone_surrogates_and_deep_nesting_are_400(nursery, tiny_engine_factory):
    _, url = await start_api(nursery, tiny_engine_factory())
    bodies = {
        "prompt": b'{"prompt": "a\\ud800b", "max_tokens": 2}',
        "messages": b'{"messages": [{"role": "user", "content": "x\\udfff"}]}',
        "role": b'{"messages": [{"role": "\\ud800", "content": "hi"}]}',
        "parts": b'{"messages": [{"role": "user", "content": [{"type": "text", '
        b'"text": "\\ud83d"}]}]}',
        "stop": b'{"prompt": "hi", "stop": ["\\ud800"]}',
        "nested": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "nested_top": b"[" * 100_000 + b"]" * 100_000,
    }
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for name, body in bodies.items():
            path = "/v1/chat/completions" if name in ("messages", "role", "parts") else (
                "/v1/completions"
            )
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (name, r.status_code, r.text[:200])
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, name
        metrics = metric_lines((await http.get("/metrics")).text)
        # The peer keeps serving.
        ok = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert ok.status_code == 200
    assert not any("unexpected" in k for k in metrics)
    assert metrics['prefixswarm_http_requests_total{endpoint="completions",status="400"}'] == 4


async def test_unexpected_errors_are_counted_json_500s(nursery, tiny_engine_factory,
                                                      monkeypatch):
    peer, url = await start_api(nursery, tiny_engine_factory())

    def broken_encode(prompt: Any) -> list[int]:
        raise RuntimeError("a bug in the tokenizer")

    async def broken_run(*args: Any, **kwargs: Any) -> Any:
        async for item in real_run(*args, **kwargs):
            yield item
            raise KeyError("a bug after the first token")

    real_run = peer.serving.run
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        peer.serving.encode = broken_encode
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "internal_error"
        assert "RuntimeError" in r.json()["error"]["message"]
        del peer.serving.encode
        peer.serving.run = broken_run
        r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert (r.status_code, r.json()["error"]["code"]) == (500, "internal_error")
        body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200  # the headers went out with the first token
        assert '"internal_error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
        del peer.serving.run
        metrics = metric_lines((await http.get("/metrics")).text)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        monkeypatch.setattr(peer, "swarm_view", lambda: broken_encode(None))
        r = await http.get("/v1/swarm")
        assert (r.status_code, r.json()["error"]["code"]) == (500, "internal_error")
        monkeypatch.undo()
        metrics = metric_lines((await http.get("/metrics")).text)
    unexpected = "prefixswarm_http_unexpected_errors_total"
    assert metrics[f'{unexpected}{{endpoint="swarm",error="RuntimeError"}}'] == 1
    assert metrics[f'{unexpected}{{endpoint="completions",error="RuntimeError"}}'] == 1
    assert metrics[f'{unexpected}{{endpoint="completions",error="KeyError"}}'] == 2
    assert metrics['prefixswarm_http_requests_total{endpoint="completions",status="500"}'] == 3


def test_every_429_and_503_carries_retry_after():
    failed = error_for(RequestFailed("no peer could serve it", []))
    assert (failed.status, failed.headers["Retry-After"]) == (503, "1")
    assert ApiError(503, "no model").headers == {"Retry-After": "1"}
    assert ApiError(429, "busy", headers={"Retry-After": "7"}).headers == {"Retry-After": "7"}
    assert ApiError(400, "bad").headers == {}


async def test_listen_backlog_fits_a_burst_of_300_connections(nursery, tiny_engine_factory):
    assert hypercorn_config("127.0.0.1", 0).backlog == LISTEN_BACKLOG == 1024
    _, url = await start_api(nursery, tiny_engine_factory())
    host, port = url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    streams: list[trio.SocketStream] = []
    answers: list[bytes] = []

    async def connect() -> None:
        streams.append(await trio.open_tcp_stream(host, int(port)))

    async def ask(stream: trio.SocketStream) -> None:
        await stream.send_all(request)
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
        answers.append(data)
        await stream.aclose()

    with trio.fail_after(60):
        async with trio.open_nursery() as burst:  # 300 handshakes at once, before any accept
            for _ in range(300):
                burst.start_soon(connect)
        async with trio.open_nursery() as burst:
            for stream in streams:
                burst.start_soon(ask, stream)
    assert len(answers) == 300
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers)


async def test_api_key(nursery, tiny_engine_factory):
    peer, _ = await start_api(nursery, tiny_engine_factory())
    url = await peer.start_service(functools.partial(serve_http, api_key=KEY), peer, "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.get("/health")).status_code == 200  # probes stay open
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                                 ("POST", "/v1/completions")):
                r = await http.request(method, path, headers=headers, json={"prompt": "hi"})
                assert r.status_code == 401, (headers, path)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
        ok = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        await client(url).models.list()
    keyed = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    done = await keyed.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert done.usage.completion_tokens == 2
    with pytest.raises(ValueError):
        await serve_http(peer, "127.0.0.1", 0, api_key="")


async def test_cache_salt_over_http(nursery, tiny_engine_factory):
    peer, url = await start_api(nursery, tiny_engine_factory())
    api = client(url)

    async def cached(**extra: Any) -> int:
        done = await api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body=extra or None
        )
        return int(done.usage.prompt_tokens_details.cached_tokens)

    assert await cached(cache_salt="alice") == 0
    assert await cached(cache_salt="alice") == 48  # same salt: shared
    assert await cached(cache_salt="bob") == 0  # another salt: nothing to match
    assert await cached() == 0  # public: the private blocks are invisible
    assert await cached() == 48
    assert set(peer.engine.cache.cached_hashes()) == set(peer.engine.hasher.chain(
        peer.engine.encode_prompt(PROMPT)
    ))
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for salt in (b'""', b"5", b'"\\ud800"', b'"' + b"s" * 257 + b'"'):
            r = await http.post(
                "/v1/completions", content=b'{"prompt": "hi", "cache_salt": ' + salt + b"}",
                headers={"content-type": "application/json"},
            )
            assert (r.status_code, r.json()["error"]["param"]) == (400, "cache_salt"), salt


async def test_cli_clients_send_the_api_key(nursery, tiny_engine_factory, capsys, monkeypatch):
    from peer import cli

    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    peer, _ = await start_api(nursery, tiny_engine_factory())
    url = await peer.start_service(functools.partial(serve_http, api_key=KEY), peer, "127.0.0.1", 0)
    args = ["generate", "hi", "--url", url, "--max-tokens", "2"]
    assert await trio.to_thread.run_sync(cli.main, args) == 1
    assert "error 401" in capsys.readouterr().err
    assert await trio.to_thread.run_sync(cli.main, [*args, "--api-key", KEY]) == 0
    monkeypatch.setenv(cli.API_KEY_ENV, KEY)
    assert await trio.to_thread.run_sync(cli.main, ["status", "--url", url]) == 0
    serve_args = cli.build_parser().parse_args(["serve", "--identity", "none", "--config", "none"])
    assert cli.settings_from_args(serve_args)[1].api_key == KEY  # serve reads it as a setting


# -- a page on another site, through its visitor's browser -------------------------------


async def test_the_api_refuses_cross_site_shapes(nursery, tiny_engine_factory):
    """A text/plain POST (what a cross-site form or fetch may send without a preflight) is
    refused; so is a foreign Host on a loopback-bound API (DNS rebinding)."""
    _peer, url = await start_api(nursery, tiny_engine_factory())
    body = '{"model": "tiny-random", "prompt": "hi", "max_tokens": 2}'
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        plain = await http.post("/v1/completions", content=body,
                                headers={"content-type": "text/plain"})
        assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
        form = await http.post("/v1/completions", data={"prompt": "hi"})
        assert form.status_code == 415
        ok = await http.post("/v1/completions", content=body,
                             headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200
        rebound = await http.get("/v1/swarm", headers={"host": "evil.example:8000"})
        assert rebound.status_code == 421
        assert "loopback only" in rebound.json()["error"]["message"]
        for host in ("localhost:1234", "127.0.0.1", "[::1]:8000"):
            assert (await http.get("/health", headers={"host": host})).status_code == 200


@pytest.mark.parametrize(
    "host,loopback",
    [("localhost", True), ("127.0.0.5", True), ("::1", True), ("a.localhost", True),
     ("0.0.0.0", False), ("192.0.2.1", False), ("evil.example", False), ("", False)],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    from peer.settings import is_loopback_host

    assert is_loopback_host(host) is loopback


def test_a_non_loopback_http_bind_needs_an_api_key() -> None:
    from peer.preflight import check_http
    from peer.settings import ConfigError

    with pytest.raises(ConfigError, match=r"without an API key.*--insecure-no-api-key"):
        check_http("0.0.0.0:0")
    check_http("0.0.0.0:0", api_key="k")
    check_http("0.0.0.0:0", insecure=True)
    check_http("127.0.0.1:0")
