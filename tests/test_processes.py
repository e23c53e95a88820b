"""peer.processes: children followed through their JSON lines, and all stopped on exit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import trio

from peer.processes import PeerProcessError, open_peer_processes

UP = {"event": "up", "peer_id": "12D3KooWchild", "multiaddrs": ["/ip4/127.0.0.1/tcp/1"],
      "http": "http://127.0.0.1:2", "model": "smollm2-135m@int4+w0123456789ab"}


def child(*, ignore_term: bool = False, exit_code: int | None = None) -> list[str]:
    """A stand-in peer: reports up and peers, then waits for stdin to close."""
    code = [
        "import json, signal, sys",
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_term else "",
        "print('not json', flush=True)",
        "sys.stderr.write('child log line\\n'); sys.stderr.flush()",
        f"print(json.dumps({UP!r}), flush=True)" if exit_code is None else "",
        "print(json.dumps({'event': 'peers', 'peer_ids': ['a', 'b'], 'routable': ['b']}), "
        "flush=True)",
        "print(json.dumps({'event': 'published', 'seq': 1}), flush=True)",
        f"sys.exit({exit_code})" if exit_code is not None else "",
        "sys.stdin.read()" if not ignore_term else "import time; time.sleep(60)",
    ]
    return [sys.executable, "-c", "\n".join(line for line in code if line)]


async def test_reports_are_followed_and_every_child_stops_at_exit(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_peer_processes() as procs:
            one = await procs.start(child(), log_path=tmp_path / "one.log")
            two = await procs.start(child())
            await one.wait_up(20)
            await two.wait_up(20)
            await procs.wait_for(lambda: one.known == {"a", "b"}, "peers line", 20)
            assert one.routable == {"b"}  # known with a measured round trip
            assert (one.index, two.index) == (1, 2)
            assert (one.peer_id, one.multiaddrs, one.http, one.model) == (
                UP["peer_id"], tuple(UP["multiaddrs"]), UP["http"], UP["model"])
            assert one.events == [{"event": "published", "seq": 1}]
            assert list(procs) == [one, two]
        # stopped gracefully (stdin closed, SIGTERM), not SIGKILLed
        assert {one.process.returncode, two.process.returncode} <= {0, -15}
    assert "child log line" in one.log_tail()


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_peer_processes(grace_s=0.5) as procs:
            stubborn = await procs.start(child(ignore_term=True))
            await stubborn.wait_up(20)
            stopping = trio.current_time()
        assert stubborn.process.returncode == -9
        assert 0.5 <= trio.current_time() - stopping < 10


async def test_a_child_that_dies_before_up_is_a_clear_error(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_peer_processes() as procs:
            dead = await procs.start(child(exit_code=3), log_path=tmp_path / "dead.log")
            with pytest.raises(PeerProcessError, match="exited before reporting") as info:
                await dead.wait_up(20)
            assert "child log line" in str(info.value)
            await dead.process.wait()
            with pytest.raises(PeerProcessError, match="exited with status 3"):
                await procs.wait_for(lambda: False, "never", 20)


async def test_own_reports_go_to_the_callers_reader() -> None:
    seen: list[dict[str, object]] = []
    with trio.fail_after(30):
        async with open_peer_processes() as procs:
            proc = await procs.start(child(), on_report=seen.append)
            await procs.wait_for(lambda: len(seen) == 3, "three lines", 20)
    assert seen[0] == json.loads(json.dumps(UP)) and not proc.peer_id
