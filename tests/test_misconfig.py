"""Loud misconfiguration: each mistake is one line on stderr and a non-zero exit, found
before the model loads where possible; never a traceback. Plus the join line and the
back-off logging of a departed peer."""

from __future__ import annotations

import logging
import os
import random
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from peer import cli
from peer.config import PeerConfig
from peer.net import discovery
from peer.net.dial_candidates import DIAL_BACKOFF_MAX_S
from peer.net.wire import PeerUnreachable
from peer.preflight import hold_identity

PEER_ID = "12D3KooWQ9jhRNWHHQioUtkmgTNTKoKjgvx8oZ3Qts9KdFLoW8Gy"
MODEL = "tiny-random"
QUIET = ["--identity", "none", "--model", MODEL, "--listen", "/ip4/127.0.0.1/tcp/0",
         "--http", "127.0.0.1:0", "--config", "none"]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PREFIXSWARM_") and name != "PREFIXSWARM_CACHE_DIR":
            monkeypatch.delenv(name)


def _listener(reuseport: bool) -> socket.socket:
    """A listening socket on a free port, as py-libp2p opens them (SO_REUSEPORT)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuseport:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _one_line(capsys: Any) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("prefixswarm: ")
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model", "nosuchmodel"], "unknown model 'nosuchmodel'"),
        (["--model", "/nonexistent/folder"], "unknown model"),
        (["--http", "localhost"], "expected HOST:PORT"),
        (["--http", "no-such-host.invalid:80"], "cannot resolve 'no-such-host.invalid'"),
        (["--bootstrap", f"/ip4/1.2.3.4/tcp/1/p2p/{PEER_ID[:-3]}"], "is not a peer id"),
        (["--bootstrap", "/ip4/1.2.3.4/tcp/1/p2p/notanid"], "is not a peer id"),
        (["--bootstrap", "/ip4/1.2.3.4/tcp/1"], "lacks the /p2p/"),
        (["--listen", "/ip4/1.2.3/tcp/1"], "is not a valid multiaddr"),
        (["--listen", "/ip4/192.0.2.1/tcp/4999"], "is not an address of this machine"),
        (["--cache-bytes", "lots"], "--cache-bytes"),
        (["--log-level", "debug", "--model", "nosuchmodel"], "unknown model"),
    ],
)
def test_each_misconfiguration_is_one_line_and_exit_2(capsys, argv, expected):
    assert cli.main(["serve", *QUIET, *argv]) == cli.EXIT_CONFIG
    assert expected in _one_line(capsys)


def test_log_level_lists_its_choices(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--log-level", "loud"])
    assert info.value.code == 2
    assert "'debug', 'info', 'warning', 'error', 'critical'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--listen", "--http"])
def test_a_port_in_use_is_refused_even_with_so_reuseport(capsys, flag):
    with _listener(reuseport=True) as sock:
        port = sock.getsockname()[1]
        value = f"/ip4/127.0.0.1/tcp/{port}" if flag == "--listen" else f"127.0.0.1:{port}"
        assert cli.main(["serve", *QUIET, flag, value]) == cli.EXIT_CONFIG
    assert f"port {port} is already in use" in _one_line(capsys)


def test_an_identity_in_use_is_refused(capsys, tmp_path):
    key = tmp_path / "identity.key"
    with hold_identity(key):
        argv = ["serve", *QUIET, "--identity", str(key)]
        assert cli.main(argv) == cli.EXIT_CONFIG
    line = _one_line(capsys)
    assert f"identity {key} is in use by a running peer (pid {os.getpid()})" in line
    with hold_identity(key):  # released by the first holder: taken again
        pass


def test_generate_and_status_against_nothing(capsys):
    assert cli.main(["generate", "hi", "--url", "http://127.0.0.1:1"]) == cli.EXIT_FAILURE
    assert "cannot reach a peer at http://127.0.0.1:1" in _one_line(capsys)
    assert cli.main(["status", "--url", "http://127.0.0.1:1"]) == cli.EXIT_FAILURE
    assert "cannot reach a peer at http://127.0.0.1:1" in _one_line(capsys)


def test_every_bootstrap_unreachable_exits_1(capsys):
    """End to end in this process: the model loads, the dials fail, the peer gives up."""
    with _listener(reuseport=False) as sock:  # a port nobody accepts on once closed
        port = sock.getsockname()[1]
    argv = ["serve", *QUIET, "--bootstrap", f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER_ID}",
            "--bootstrap-timeout", "1", "--report", "json"]
    assert cli.main(argv) == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert "--dtype auto: float32" in lines.pop(0)  # the format chosen, said first
    assert "fingerprinting the weights" in lines[0] and "done in" in lines[1]
    assert "warming up the engine" in lines[2] and f"model {MODEL}+w" in lines[4]
    assert "ready in" in lines[4]
    assert "WARNING peer.net.discovery: bootstrap" in lines[5]  # the first failed dial, said once
    assert f"answered within 1 s (/ip4/127.0.0.1/tcp/{port}: " in lines[6]
    assert "Connection refused); check the address" in lines[6]
    assert len(lines) == 7


# -- the join line, in virtual time --------------------------------------------------


class _FakeDiscovery:
    def __init__(self) -> None:
        self.event = trio.Event()
        refused = ConnectionRefusedError(111, "Connection refused")
        try:
            try:
                raise ExceptionGroup("all attempts failed", [refused])
            except ExceptionGroup as group:
                raise PeerUnreachable("dial failed: no addresses") from group
        except PeerUnreachable as exc:
            self.bootstrap_errors = {PEER_ID: exc}

    @property
    def bootstrapped(self) -> bool:
        return self.event.is_set()

    async def wait_bootstrapped(self) -> None:
        await self.event.wait()


class _NoStreams:
    """A host that opens no stream: the bootstrap peers' models stay unknown."""

    async def new_stream(self, peer_id: Any, protocols: Any, *, timeout_s: float = 0) -> Any:
        raise PeerUnreachable("no streams here")


def _fake_peer(views: list[Any]) -> Any:
    return SimpleNamespace(
        discovery=_FakeDiscovery(), table=SimpleNamespace(views=lambda now: list(views)),
        host=_NoStreams(), model_id="m", invite=lambda: None,
    )


async def test_no_bootstrap_answer_raises_after_the_timeout(autojump_clock):
    peer = _fake_peer([])
    config = PeerConfig(bootstrap=(f"/ip4/1.2.3.4/tcp/1/p2p/{PEER_ID}",), identity_file=None,
                        bootstrap_timeout_s=7.0)
    with pytest.raises(cli.BootstrapFailed, match=r"\(/ip4/1.2.3.4/tcp/1: Connection refused\)"):
        await cli._watch_join(peer, config)
    assert trio.current_time() == pytest.approx(7.0)


async def test_joined_line_once_other_peers_are_known(autojump_clock, capsys):
    views: list[Any] = []
    peer = _fake_peer(views)
    config = PeerConfig(bootstrap=(f"/ip4/1.2.3.4/tcp/1/p2p/{PEER_ID}",), identity_file=None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cli._watch_join, peer, config)
        await trio.sleep(2)
        peer.discovery.event.set()
        await trio.sleep(3)
        assert "joined" not in capsys.readouterr().err
        views.extend(["a", "b"])
    assert capsys.readouterr().err.strip() == "prefixswarm: joined: 3 peers"


# -- a departed peer: dials back off, one warning --------------------------------------


class _DeadHost:
    peer_id = ID.from_base58(PEER_ID)

    def __init__(self) -> None:
        self.alive = False
        self.dials = 0

    async def connect(self, info: Any) -> None:
        self.dials += 1
        if not self.alive:
            raise PeerUnreachable("dial failed: connection refused")

    def is_connected(self, peer_id: Any) -> bool:
        return False

    def is_relayed(self, peer_id: Any) -> bool:
        return False


async def test_a_departed_peer_is_logged_once_and_backed_off(
    autojump_clock, caplog, monkeypatch
):
    monkeypatch.setattr(discovery, "dht_forget_peer", lambda *a: None)
    host = _DeadHost()
    d = discovery.Discovery(host, None, b"k", [], liveness_interval_s=1.0,  # type: ignore[arg-type]
                            rng=random.Random(0))
    other = ID.from_base58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    d._book.learn(other.to_base58(), PeerInfo(other, []), discovery.LOCAL_SOURCE, 0.0)
    d._book.connected(other.to_base58())  # it was a member: it departed
    caplog.set_level(logging.DEBUG, logger="peer.net.discovery")
    attempts = []
    while trio.current_time() < 600:  # ten minutes of a dead peer
        d._book.learn(other.to_base58(), PeerInfo(other, []), discovery.LOCAL_SOURCE,
                      trio.current_time())  # its record stays in our store
        for dial in d._book.due(trio.current_time(), lambda peer: False):
            attempts.append(trio.current_time())
            await d._dial(dial)
        await trio.sleep(1)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert len(attempts) < 20  # back-off to a minute: not one every 15 s
    assert attempts[-1] - attempts[-2] >= DIAL_BACKOFF_MAX_S
    host.alive = True
    while not (dials := d._book.due(trio.current_time(), lambda peer: False)):
        await trio.sleep(1)
    await d._dial(dials[0])
    assert "reachable again" in caplog.records[-2].getMessage() + caplog.records[-1].getMessage()


def test_lock_file_sits_next_to_the_key(tmp_path):
    key = tmp_path / "sub" / "id.key"
    with hold_identity(key):
        assert Path(str(key) + ".lock").read_text().strip() == str(os.getpid())


def test_stage_lines_say_what_and_how_long():
    import io

    from peer.progress import stage

    out = io.StringIO()
    ticks = iter([10.0, 12.5])
    with stage("converting", out=out, clock=lambda: next(ticks)):
        assert out.getvalue() == "prefixswarm: converting...\n"
    assert out.getvalue().splitlines()[1] == "prefixswarm: converting: done in 2.5 s"


@pytest.mark.parametrize("level", ["warning", "debug"])
def test_log_lines_have_timestamps_and_libp2p_noise_is_dropped(capsys, level):
    import re

    from peer.logs import setup_logging

    library = logging.getLogger("libp2p")
    saved, propagated = library.level, library.propagate
    try:
        setup_logging(level)
        # What the command's peer meets once its host opens: `import libp2p` sets its
        # logger to WARNING without propagation, peer/net/libp2p_fixes.py restores the
        # propagation (set here: the test must not depend on an earlier one's host).
        library.setLevel(logging.WARNING)
        library.propagate = True
        logging.getLogger("peer.net.discovery").warning("peer X unreachable")
        logging.getLogger("libp2p.transport.tcp.tcp").error("Failed to open TCP stream: x")
        logging.getLogger("libp2p.kad_dht.provider_store").warning("Failed to send ADD_PROVIDER")
        logging.getLogger("libp2p.network").error("a real libp2p error")
    finally:
        library.setLevel(saved)
        library.propagate = propagated
        # conftest's autouse fixture removes the handler bound to capsys's stream
    lines = capsys.readouterr().err.splitlines()
    stamp = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "
    assert all(re.match(stamp, line) for line in lines)
    assert lines[0].endswith("WARNING peer.net.discovery: peer X unreachable")
    assert lines[-1].endswith("ERROR libp2p.network: a real libp2p error")
    assert len(lines) == (4 if level == "debug" else 2)


async def test_a_new_swarm_says_so_then_joined(autojump_clock, capsys):
    views: list[Any] = []
    peer = _fake_peer(views)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cli._watch_join, peer, PeerConfig(identity_file=None))
        await trio.sleep(1)
        assert "started a new swarm" in capsys.readouterr().err
        views.append("a")
    assert capsys.readouterr().err.strip() == "prefixswarm: joined: 2 peers"


def test_a_model_that_fails_to_load_is_one_line_and_exit_1(capsys, tmp_path):
    """Past the checks, inside the running peer's nursery: still one line, no traceback."""
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["serve", *QUIET, "--model", str(tmp_path)]) == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"prefixswarm: cannot load a causal LM from {tmp_path}: " in err.splitlines()[-1]
    assert "tokenizer" in err.splitlines()[-1]  # transformers' multi-line reason, joined
