"""peer.net.libp2p_fixes: applied at host open, idempotent, each checked before it patches."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import libp2p.network.swarm as libp2p_swarm
import pytest
from libp2p.pubsub.pubsub import Pubsub

from peer.net import libp2p_fixes

ROOT = Path(__file__).resolve().parent.parent


def test_importing_the_peer_patches_nothing_and_leaves_logging_alone() -> None:
    code = (
        "import logging\n"
        "logging.getLogger('libp2p.network.auto_connector')\n"
        "import libp2p, libp2p.network.swarm as s, libp2p.network.auto_connector\n"
        "before = (s._HAPPY_EYEBALLS_DELAY, logging.getLogger('libp2p').propagate,\n"
        "          logging.getLogger('libp2p.network.auto_connector').level,\n"
        "          logging.getLogger().level, len(logging.getLogger().handlers))\n"
        "import peer.node, peer.net.host, peer.cli\n"
        "after = (s._HAPPY_EYEBALLS_DELAY, logging.getLogger('libp2p').propagate,\n"
        "         logging.getLogger('libp2p.network.auto_connector').level,\n"
        "         logging.getLogger().level, len(logging.getLogger().handlers))\n"
        "assert before == after, (before, after)\n"
        "assert s._HAPPY_EYEBALLS_DELAY > 0\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_apply_is_idempotent_and_patches_every_target() -> None:
    names = [fix.name for fix in libp2p_fixes.fixes()]
    assert libp2p_fixes.apply() == names
    reader = Pubsub.continuously_read_stream
    assert libp2p_fixes.apply() == names  # again: nothing wrapped twice
    assert Pubsub.continuously_read_stream is reader
    assert libp2p_swarm._HAPPY_EYEBALLS_DELAY == 0.0
    assert logging.getLogger("libp2p").propagate


def test_another_libp2p_version_skips_every_fix_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="peer.net.libp2p_fixes"):
        assert libp2p_fixes.apply(version="0.9.0") == []
    lines = [r.getMessage() for r in caplog.records if r.name == "peer.net.libp2p_fixes"]
    assert len(lines) == 1
    assert "0.9.0" in lines[0] and "0.8.1" in lines[0] and "yamux-window" in lines[0]


def test_a_fix_whose_target_changed_is_skipped_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def changed(self: object, stream: object, extra: int) -> None: ...

    monkeypatch.setattr(Pubsub, "continuously_read_stream", changed)
    with caplog.at_level(logging.WARNING, logger="peer.net.libp2p_fixes"):
        in_force = libp2p_fixes.apply()
    assert "pubsub-decode" not in in_force
    assert Pubsub.continuously_read_stream is changed  # left as found
    lines = [r.getMessage() for r in caplog.records if r.name == "peer.net.libp2p_fixes"]
    assert lines == [
        "py-libp2p fix pubsub-decode skipped: Pubsub.continuously_read_stream takes "
        "('self', 'stream', 'extra'), expected ('self', 'stream')"
    ]


def test_a_missing_module_global_is_reported_not_created(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(libp2p_swarm, "_HAPPY_EYEBALLS_DELAY")
    with caplog.at_level(logging.WARNING, logger="peer.net.libp2p_fixes"):
        in_force = libp2p_fixes.apply()
    assert "happy-eyeballs-delay" not in in_force
    assert not hasattr(libp2p_swarm, "_HAPPY_EYEBALLS_DELAY")
    assert any("happy-eyeballs-delay skipped" in r.getMessage() for r in caplog.records)


async def test_blacklisting_a_peer_whose_connection_died_meanwhile_is_no_error() -> None:
    """The peer's stream is gone from `peers` by the time its reset returns (the
    connection's own teardown removed it): the host must not fail on a KeyError."""
    from types import SimpleNamespace

    libp2p_fixes.apply()
    forgotten: list[object] = []
    pubsub = SimpleNamespace(peers={}, _forget_all_subscriptions=forgotten.append)

    class DyingStream:
        async def reset(self) -> None:
            del pubsub.peers["p"]  # the race: removed while the reset awaited

    pubsub.peers["p"] = DyingStream()
    await Pubsub._teardown_if_connected(pubsub, "p")  # type: ignore[arg-type]
    assert pubsub.peers == {} and forgotten == ["p"]
    await Pubsub._teardown_if_connected(pubsub, "q")  # never connected
    assert forgotten == ["p", "q"]
