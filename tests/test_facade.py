"""The library entry (prefixswarm/): its embedding defaults, the checks it shares with
`serve`, a peer it opens generating, the asyncio path through PeerThread, and the
package installed into a fresh venv working from outside the repository."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import prefixswarm
from peer import config as peer_config
from peer.node_runner import CacheOnlyEngine
from prefixswarm import (
    ConfigError,
    GenerationChunk,
    GenerationResult,
    PeerClosed,
    PeerConfig,
    PeerThread,
    SamplingParams,
    open_peer,
    serve_http,
)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-random"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
GREEDY = SamplingParams(max_new_tokens=6)


def test_embedding_defaults_are_loopback_and_ephemeral() -> None:
    config = PeerConfig()
    assert config.listen_addrs == ("/ip4/127.0.0.1/tcp/0",) == prefixswarm.EMBED_LISTEN
    assert config.identity_file is None and config.quarantine_path is None
    assert isinstance(config, peer_config.PeerConfig)  # the same fields, the same checks
    assert peer_config.PeerConfig().listen_addrs == ("/ip4/0.0.0.0/tcp/4001",)  # serve's
    with pytest.raises(ValueError, match="block_size"):
        PeerConfig(block_size=0)
    assert PeerThread().config == PeerConfig()


async def test_a_held_identity_is_refused_until_released(tmp_path: Path) -> None:
    identity = tmp_path / "identity.key"
    config = PeerConfig(identity_file=identity)
    async with open_peer(config, engine=CacheOnlyEngine()) as first:
        with pytest.raises(ConfigError, match="is in use by a running peer"):
            async with open_peer(config, engine=CacheOnlyEngine()):
                pass
        first_id = first.peer_id
    async with open_peer(config, engine=CacheOnlyEngine()) as again:  # released, same key
        assert again.peer_id == first_id


async def test_a_taken_listen_port_is_refused_before_starting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = PeerConfig(listen_addrs=(f"/ip4/127.0.0.1/tcp/{port}",))
        with pytest.raises(ConfigError, match=f"port {port} is already in use"):
            async with open_peer(config, engine=CacheOnlyEngine()):
                pass
    with pytest.raises(ConfigError, match="unknown model"):
        async with open_peer(PeerConfig(model="/no/such/checkpoint")):
            pass


async def test_a_peer_opened_through_the_facade_generates() -> None:
    async with open_peer(PeerConfig(model=MODEL)) as peer:  # the model loaded by name
        assert all(a.startswith("/ip4/127.0.0.1/tcp/") for a in peer.multiaddrs)
        assert not any("/tcp/4001/" in a for a in peer.multiaddrs)
        result = await peer.generate(PROMPT, GREEDY)
        assert result.served_by == peer.peer_id
        assert result.completion_tokens == 6 and result.prompt_tokens > 0
        url = await peer.start_service(serve_http, peer, "127.0.0.1", 0)
        async with httpx.AsyncClient() as client:
            models = (await client.get(f"{url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL, peer.model_id]  # name, full id


def test_asyncio_program_runs_a_peer_thread_end_to_end() -> None:
    async def program() -> dict[str, object]:
        seen: dict[str, object] = {}
        async with PeerThread(PeerConfig(model=MODEL)) as peer:
            assert peer.multiaddrs[0].startswith("/ip4/127.0.0.1/tcp/")
            ticks = 0

            async def tick() -> None:  # the asyncio loop keeps running during a request
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.001)

            ticker = asyncio.create_task(tick())
            result = await peer.agenerate(PROMPT, GREEDY)
            ticker.cancel()
            seen["result"], seen["ticks"] = result, ticks
            items = [item async for item in peer.astream(PROMPT, GREEDY)]
            seen["items"] = items
            # cancelling the awaiting task cancels the request in the peer's thread
            long = SamplingParams(max_new_tokens=500)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(peer.agenerate(PROMPT, long), timeout=0.05)
            await _wait_cancelled(peer, 1)
            # the blocking stream, from a worker thread; then an async one left early
            seen["blocking_items"] = await asyncio.to_thread(
                lambda: list(peer.stream(PROMPT, GREEDY))
            )
            async with aclosing(peer.astream(PROMPT, long)) as stream:
                async for _ in stream:
                    break  # leaving the loop cancels the request
            seen["after_cancel"] = await _wait_cancelled(peer, 2)
            url = await peer.acall(lambda p: p.start_service(serve_http, p, "127.0.0.1", 0))
            async with httpx.AsyncClient() as client:
                answer = await client.post(f"{url}/v1/completions", json={
                    "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                })
            seen["http_text"] = answer.json()["choices"][0]["text"]
            seen["thread"] = peer._thread
        with pytest.raises(PeerClosed):
            await peer.agenerate(PROMPT, GREEDY)
        return seen

    seen = asyncio.run(program())
    result = seen["result"]
    assert isinstance(result, GenerationResult) and result.completion_tokens == 6
    assert isinstance(seen["ticks"], int) and seen["ticks"] > 0
    items = seen["items"]
    assert isinstance(items, list) and isinstance(items[-1], GenerationResult)
    chunks = [i for i in items[:-1] if isinstance(i, GenerationChunk)]
    assert len(chunks) == len(items) - 1 >= 1
    assert "".join(c.text for c in chunks) == items[-1].text == result.text  # greedy
    assert seen["http_text"] == result.text
    assert [i.text for i in seen["blocking_items"]] == [i.text for i in items]  # type: ignore[attr-defined]
    requests = seen["after_cancel"]
    assert isinstance(requests, dict) and (requests["ok"], requests["cancelled"]) == (3, 2)
    thread = seen["thread"]
    assert isinstance(thread, threading.Thread) and not thread.is_alive()


def test_an_abandoned_async_start_leaves_no_peer_running(tmp_path: Path) -> None:
    config = PeerConfig(model=MODEL, identity_file=tmp_path / "identity.key")

    async def use() -> None:
        async with PeerThread(config):
            await asyncio.sleep(3600)

    async def program() -> None:
        with pytest.raises(TimeoutError):  # cancelled while the model loads
            await asyncio.wait_for(use(), timeout=0.05)

    asyncio.run(program())  # waits for its worker threads: start, then close
    with PeerThread(config, engine=CacheOnlyEngine()) as peer:  # the identity is free
        assert peer.peer_id
    running = [t for t in threading.enumerate() if t.name == "prefixswarm-peer"]
    assert running == [], running


async def _wait_cancelled(peer: PeerThread, count: int) -> dict[str, int]:
    """The peer's request outcomes once `count` requests ended cancelled (5 s at most)."""
    for _ in range(500):
        requests: dict[str, int] = peer.statistics()["serving"]["requests"]
        if requests["cancelled"] >= count:
            break
        await asyncio.sleep(0.01)
    return requests


def test_blocking_peer_thread_holds_its_identity_and_reports_start_errors(
    tmp_path: Path,
) -> None:
    identity = tmp_path / "identity.key"
    config = PeerConfig(identity_file=identity)
    with PeerThread(config, engine=CacheOnlyEngine()) as first:
        rival = PeerThread(config, engine=CacheOnlyEngine())
        with pytest.raises(ConfigError, match="is in use by a running peer"):
            rival.start()
        assert first.statistics()["peers_known"] == 0
        peer_id = first.peer_id
        with pytest.raises(RuntimeError, match="cache-only"):  # the error crosses back
            first.generate(PROMPT, GREEDY)

        async def close_from_inside(_: object) -> None:
            first.close()

        async def call_from_inside(_: object) -> None:
            first.generate(PROMPT, GREEDY)

        for inside in (close_from_inside, call_from_inside):
            with pytest.raises(RuntimeError, match="own thread"):  # it would wait for itself
                first.call(inside)
    with pytest.raises(PeerClosed):
        first.generate(PROMPT, GREEDY)
    with PeerThread(config, engine=CacheOnlyEngine()) as again:
        assert again.peer_id == peer_id
    first.close()  # twice is harmless


@dataclass(frozen=True)
class Installed:
    """The package installed into a fresh venv, and a folder outside the repository."""

    venv: Path
    purelib: str
    outside: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """`pip install .` into a fresh venv (no dependencies: they come from this venv's
    site-packages through a .pth line, which adds the folder only: its own .pth files,
    this checkout's editable install among them, are not read)."""
    tmp_path = tmp_path_factory.mktemp("installed")
    source = tmp_path / "source"  # a copy: pip builds in the tree it is given
    for name in ("pyproject.toml", "README.md", "LICENSE", "peer", "protocols", "prefixswarm"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        elif (ROOT / name).exists():
            source.mkdir(exist_ok=True)
            shutil.copy(ROOT / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    shared = sysconfig.get_paths()["purelib"]
    Path(purelib, "shared-dependencies.pth").write_text(shared + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--quiet", "--no-deps", "--no-build-isolation", str(source)],
        check=True, env=env, cwd=tmp_path, timeout=120,
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    return Installed(venv, purelib, outside, env)


@pytest.mark.slow
def test_pip_install_into_a_fresh_venv_works_outside_the_repository(
    installed: Installed,
) -> None:
    helped = subprocess.run(
        [str(installed.venv / "bin" / "prefixswarm"), "--help"],
        capture_output=True, text=True, env=installed.env, cwd=installed.outside, timeout=60,
    )
    assert helped.returncode == 0, helped.stderr
    assert "serve" in helped.stdout and "local" in helped.stdout
    imported = subprocess.run(
        [str(installed.venv / "bin" / "python"), "-c",
         "from prefixswarm import open_peer, PeerConfig, SamplingParams; "
         "import prefixswarm, peer; print(prefixswarm.__file__); print(peer.__file__)"],
        capture_output=True, text=True, env=installed.env, cwd=installed.outside, timeout=60,
    )
    assert imported.returncode == 0, imported.stderr
    files = imported.stdout.split()
    assert len(files) == 2 and all(f.startswith(installed.purelib) for f in files), files
    assert not any(f.startswith(str(ROOT)) for f in files)


@pytest.mark.slow
def test_the_embedding_example_runs_on_the_installed_package(installed: Installed) -> None:
    example = installed.outside / "embed_peer.py"
    shutil.copy(ROOT / "examples" / "embed_peer.py", example)
    done = subprocess.run(
        [str(installed.venv / "bin" / "python"), str(example), "--model", MODEL],
        capture_output=True, text=True, env=installed.env, cwd=installed.outside, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "up at /ip4/127.0.0.1/tcp/" in done.stdout
    assert "cached 48/" in done.stdout  # the second question reused the first one's blocks
