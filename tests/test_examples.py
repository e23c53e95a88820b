"""The examples run (tiny-random, in this process where they can).

Loaded from their files under unique module names: `examples` is also a top-level
package that libp2p installs, so `import examples...` would find the wrong one."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from types import ModuleType

import trio

from tests.test_http import MODEL, start_api

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"prefixswarm_example_{name}", EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_embed_peer_example(capsys):
    await load_example("embed_peer.py").main(MODEL, [], "127.0.0.1:0")
    out = capsys.readouterr().out
    assert "HTTP API on http://127.0.0.1:" in out
    cached = [line for line in out.splitlines() if line.startswith("  served by")]
    assert len(cached) == 2
    assert "cached 0/" in cached[0] and "cached 48/" in cached[1]  # the shared prefix
    assert "peers known: 0" in out


def test_embed_asyncio_example(capsys):
    asyncio.run(load_example("embed_asyncio.py").main(MODEL, []))
    out = capsys.readouterr().out
    assert "up at /ip4/127.0.0.1/tcp/" in out
    assert "(12 tokens, served by" in out
    assert "a request past its timeout was cancelled inside the peer" in out
    assert "HTTP API on http://127.0.0.1:" in out
    assert out.rstrip().endswith("peer stopped")


async def test_openai_client_example(nursery, tiny_engine_factory, capsys):
    _, url = await start_api(nursery, tiny_engine_factory())
    await trio.to_thread.run_sync(load_example("openai_client.py").main, url, MODEL)
    out = capsys.readouterr().out
    assert "models: ['tiny-random', 'tiny-random+w" in out  # its name, then its full id
    assert "route ['ok']" in out
    assert "(16 tokens)" in out
    assert "an unknown model is refused: 404 model_not_found" in out


def test_local_swarm_example_uses_the_library_api():
    module = load_example("local_swarm.py")
    assert module.LocalSwarmOptions(peers=2, model=MODEL).peers == 2  # runs under test_cli
