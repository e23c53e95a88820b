"""The `prefixswarm` command: argument handling, generate/status against a live peer, and
`prefixswarm local` end to end in real processes (every process gone after Ctrl-C)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from peer import cli, cli_clients
from peer.api.http import serve_http
from peer.config import Policy
from tests.helpers_swarm import start_peer
from tests.test_http import MODEL, PROMPT, start_api

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 180  # three children import torch and libp2p on a busy 2-core machine


def test_split_host_port():
    assert cli.split_host_port("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert cli.split_host_port("[::1]:0") == ("::1", 0)
    for bad in ("8000", "host:", ":80", "h:99999", "h:x"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            cli.split_host_port(bad)


def test_serve_arguments_become_a_config(tmp_path):
    boot = "/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWQ9jhRNWHHQioUtkmgTNTKoKjgvx8oZ3Qts9KdFLoW8Gy"
    args = cli.build_parser().parse_args(
        ["serve", "--bootstrap", boot, "--listen", "/ip4/0.0.0.0/tcp/5000",
         "--announce", "/ip4/203.0.113.7/tcp/5000", "--identity", str(tmp_path / "k"),
         "--policy", "longest_prefix", "--cache-bytes", "1000", "--summary-interval", "3"]
    )
    config = cli.config_from_args(args)
    assert config.bootstrap == (boot,)
    assert config.announce_addrs == ("/ip4/203.0.113.7/tcp/5000",)
    assert config.listen_addrs == ("/ip4/0.0.0.0/tcp/5000",)
    assert config.identity_file == tmp_path / "k"
    assert (config.policy, config.cache_bytes, config.summary_interval_s) == (
        Policy.LONGEST_PREFIX, 1000, 3.0
    )
    missing_id = cli.build_parser().parse_args(["serve", "--bootstrap", "/ip4/1.2.3.4/tcp/1"])
    with pytest.raises(ValueError, match="/p2p/"):
        cli.config_from_args(missing_id)
    assert cli.main(["serve", "--bootstrap", "/ip4/1.2.3.4/tcp/1"]) == 2  # one line, no trace


def test_format_status_table():
    view: dict[str, Any] = {
        "self": {"peer_id": "12D3Self", "addrs": ["/ip4/127.0.0.1/tcp/1/p2p/12D3Self"],
                 "model": "tiny-random", "policy": "cost", "cached_blocks": 3,
                 "capacity_blocks": 100, "running_requests": 0, "queued_prompt_tokens": 0,
                 "software": "prefixswarm/0.2.0"},
        "peers": [{"peer_id": "12D3Other", "addrs": ["/ip4/127.0.0.1/tcp/2"], "rtt_s": 0.0012,
                   "summary_age_s": 0.4, "cached_blocks": 7, "capacity_blocks": 100,
                   "running_requests": 1, "queued_prompt_tokens": 48,
                   "trust": {"state": "probation"}, "software": "prefixswarm/0.1.0",
                   "older_software": True}],
        "invite": "prefixswarm:abc",
    }
    lines = cli_clients.format_status(view).splitlines()
    assert lines[0] == "model tiny-random, policy cost, 2 peers; 1 peers run older software"
    assert lines[1].split()[:2] == ["PEER", "ADDRESS"]
    assert "12D3Self (this)" in lines[2] and "3/100" in lines[2]
    assert "/ip4/127.0.0.1/tcp/1 " in lines[2] and "/p2p/" not in lines[2]
    assert "1.2 ms" in lines[3] and "~7/100" in lines[3] and "0.4 s" in lines[3]
    assert "1 run, 48 tok queued" in lines[3]
    assert lines[2].split()[-1] == "prefixswarm/0.2.0"
    assert lines[3].split()[-3:] == ["probation", "prefixswarm/0.1.0", "(older)"]
    assert lines[4] == "others join with: prefixswarm serve --join prefixswarm:abc"


async def test_generate_and_status_commands(nursery, tiny_engine_factory, capsys):
    peer, url = await start_api(nursery, tiny_engine_factory())
    other = await start_peer(nursery, _loopback_config(peer.multiaddrs), tiny_engine_factory())
    await other.peer.start_service(serve_http, other.peer, "127.0.0.1", 0)
    code = await trio.to_thread.run_sync(
        cli.main, ["generate", PROMPT, "--url", url, "--max-tokens", "4"]
    )
    out, err = capsys.readouterr()
    assert code == 0
    assert out.strip() and f"served by {peer.peer_id}" in err
    assert "cached 0/61 prompt tokens" in err  # 60 + the trailing space as its own token

    with trio.fail_after(20):
        while other.peer.peer_id not in {v.peer_id for v in peer.table.views(trio.current_time())}:
            await trio.sleep(0.05)
    code = await trio.to_thread.run_sync(cli.main, ["status", "--url", url])
    out, _ = capsys.readouterr()
    assert code == 0
    assert f"{peer.peer_id} (this)" in out and other.peer.peer_id in out
    assert "2 peers" in out.splitlines()[0]

    code = await trio.to_thread.run_sync(
        cli.main, ["generate", "hi", "--url", url, "--model", "nope"]
    )
    assert code == 1 and "error 404" in capsys.readouterr().err


def _loopback_config(bootstrap: list[str]) -> Any:
    from peer.config import PeerConfig

    return PeerConfig(model=MODEL, listen_addrs=("/ip4/127.0.0.1/tcp/0",), identity_file=None,
                      bootstrap=tuple(bootstrap[:1]), summary_interval_s=0.5)


# -- real processes -------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it has exited and holds no resources)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _start_local(*extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "peer.cli", "local", "--model", MODEL, "--http", "127.0.0.1:0",
         "--summary-interval", "0.5", "--json", *extra],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def _operator_settings(home: Path) -> dict[str, str]:
    """An environment whose user has a real peer's settings: an API key in the config
    file and in PREFIXSWARM_API_KEY."""
    config = home / ".config" / "prefixswarm" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('api_key = "from-the-file"\n')
    return {**os.environ, "HOME": str(home), "PREFIXSWARM_API_KEY": "from-the-environment"}


def _read_ready(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    line = process.stdout.readline()  # the first stdout line, once every peer knows the rest
    if not line:
        process.kill()
        raise AssertionError(f"no ready line; stderr:\n{process.communicate()[1]}")
    ready: dict[str, Any] = json.loads(line)
    assert ready["event"] == "ready"
    return ready


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.slow
def test_local_swarm_serves_and_stops_every_process_on_sigint(tmp_path: Path):
    """Also: a throwaway swarm ignores the operator's config file and PREFIXSWARM_*
    variables (its API answers without their key)."""
    process = _start_local("--peers", "3", env=_operator_settings(tmp_path))
    try:
        ready = _read_ready(process)
        pids = [p["pid"] for p in ready["peers"]]
        assert len(set(pids)) == 3 and all(_alive(p) for p in pids)
        url = ready["http"]
        assert url == ready["peers"][0]["http"]
        swarm = httpx.get(url + "/v1/swarm", timeout=30).json()
        assert {p["peer_id"] for p in swarm["peers"]} == {
            p["peer_id"] for p in ready["peers"][1:]
        }
        # each peer in the table got there by a summary accepted from it
        accepted = swarm["gossip_counts"]["accepted"]
        assert set(accepted) == {p["peer_id"] for p in ready["peers"][1:]}
        assert all(n >= 1 for n in accepted.values())
        assert swarm["gossip_counts"]["published"] >= 1
        ids = {p["peer_id"] for p in ready["peers"]}
        for entry in ready["peers"]:  # a request entering at each peer
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
            answer = httpx.post(entry["http"] + "/v1/completions", json=body, timeout=60).json()
            assert answer["x_prefixswarm"]["served_by"] in ids
            assert answer["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
        assert process.returncode == 0, err
        assert "all peers stopped" in err
        assert _wait_gone(pids, 5) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_child_peer_stops_when_its_stdin_closes():
    """How `local`'s children outlive no parent: a dead parent closes their stdin."""
    process = subprocess.Popen(
        [sys.executable, "-m", "peer.cli", "serve", "--model", MODEL, "--identity", "none",
         "--listen", "/ip4/127.0.0.1/tcp/0", "--http", "", "--report", "json",
         "--exit-with-stdin"],
        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stdin is not None
        assert json.loads(process.stdout.readline())["event"] == "loading"
        process.stdin.close()  # what the kernel does when the parent dies, even by SIGKILL
        assert process.wait(timeout=20) == 0  # during the model load: abandoned at once
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_listen_none_is_an_outbound_only_peer():
    args = cli.build_parser().parse_args(["serve", "--listen", "none", "--no-relay-service"])
    config = cli.config_from_args(args)
    assert config.listen_addrs == ()
    assert config.relay_service is False and config.use_relays is True
