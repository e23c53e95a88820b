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


async def test_an_idle_connection_outlives_a_clients_keepalive(nursery, tiny_engine_factory):
    """A client reuses an idle connection for up to 5 s (httpx's default): the server must
    not close it at that same moment, or the client's next request meets a closed
    connection ("Server disconnected without sending a response")."""
    expiry = httpx.Limits().keepalive_expiry
    assert expiry is not None
    _, url = await start_api(nursery, tiny_engine_factory())
    host, port = url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()

    async def answer(stream: trio.SocketStream) -> bytes:
        """One whole response (head and Content-Length body); b"" if the server closed."""
        data = b""
        while b"\r\n\r\n" not in data:
            if not (chunk := await stream.receive_some()):
                return data
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += await stream.receive_some()
        return head

    with trio.fail_after(30):
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(request)
        assert (await answer(stream)).startswith(b"HTTP/1.1 200")
        await trio.sleep(expiry + 0.5)  # hypercorn's default (5 s) closes it meanwhile
        await stream.send_all(request)  # the same connection, idle past a client's expiry
        assert (await answer(stream)).startswith(b"HTTP/1.1 200")
        await stream.aclose()


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


@pytest.mark.parametrize(
    "bind,host,allowed",
    [
        ("127.0.0.1", "localhost", True), ("127.0.0.1", "127.0.0.9", True),
        ("127.0.0.1", "192.0.2.1", False), ("127.0.0.1", "peer.example.org", False),
        ("0.0.0.0", "192.0.2.1", True), ("0.0.0.0", "2001:db8::1", True),
        ("0.0.0.0", "localhost", True), ("0.0.0.0", "peer.example.org", True),
        ("0.0.0.0", "PEER.example.org.", True), ("0.0.0.0", "evil.example", False),
        ("0.0.0.0", "", False), ("api.example.net", "api.example.net", True),
        ("api.example.net", "peer.example.org", True), ("api.example.net", "x.net", False),
    ],
)
def test_allowed_hosts_are_the_bound_and_announced_names(bind, host, allowed) -> None:
    from peer.api.auth import AllowedHosts

    assert AllowedHosts(bind, ["peer.example.org"]).allows(host) is allowed


def test_announced_names_come_from_dns_multiaddrs() -> None:
    from peer.api.auth import multiaddr_names

    addrs = ["/ip4/192.0.2.1/tcp/1", "/dns4/a.example/tcp/1", "/dns/b.example/udp/1/quic-v1",
             "/dnsaddr/c.example", "/dns6/"]
    assert multiaddr_names(addrs) == ["a.example", "b.example", "c.example"]


async def test_an_api_bound_beyond_loopback_answers_only_its_own_names(
    nursery, tiny_engine_factory
):
    """DNS rebinding against a peer serving on all interfaces: the attacker's name is
    refused, the peer's announced name, its addresses and loopback are served."""
    from peer.config import PeerConfig
    from tests.helpers_swarm import start_peer

    config = PeerConfig(model=MODEL, listen_addrs=("/ip4/127.0.0.1/tcp/0",),
                        announce_addrs=("/dns4/peer.example.org/tcp/4001",), identity_file=None)
    running = await start_peer(nursery, config, tiny_engine_factory())
    url = await running.peer.start_service(
        functools.partial(serve_http, api_key=KEY), running.peer, "0.0.0.0", 0
    )
    port = url.rsplit(":", 1)[1]
    auth = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        rebound = await http.get("/v1/swarm", headers={**auth, "host": f"evil.example:{port}"})
        assert rebound.status_code == 421
        assert "peer.example.org" in rebound.json()["error"]["message"]
        for host in (f"peer.example.org:{port}", f"192.0.2.1:{port}", f"localhost:{port}"):
            assert (await http.get("/v1/swarm", headers={**auth, "host": host})).status_code == 200


def test_a_non_loopback_bind_without_a_key_is_refused_in_one_line(capsys, monkeypatch) -> None:
    """`serve` refuses before loading anything, with one line naming the way out."""
    from peer import cli

    monkeypatch.delenv("PREFIXSWARM_API_KEY", raising=False)
    code = cli.main(["serve", "--identity", "none", "--config", "none", "--http", "0.0.0.0:0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_CONFIG
    assert len(err) == 1 and "without an API key" in err[0]
    assert "--insecure-no-api-key" in err[0]


def test_an_insecure_bind_says_so_in_one_warning_line(caplog) -> None:
    import logging

    from peer.preflight import check_http

    with caplog.at_level(logging.WARNING, logger="peer.preflight"):
        check_http("0.0.0.0:0", insecure=True)
        check_http("0.0.0.0:0", api_key="k")  # a key: nothing to say
        check_http("127.0.0.1:0", insecure=True)  # loopback: nothing to say
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "without an API key" in lines[0] and "\n" not in lines[0]
