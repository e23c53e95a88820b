"""Helpers for swarm tests: loopback peer configs, peers in tasks, bounded waiting."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from peer.config import PeerConfig
from peer.engine.cache_only import CacheOnlyEngine
from peer.node import Peer, open_peer
from peer.node_runner import runner_command
from peer.processes import PeerProcess, PeerProcesses

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
TEST_INTERVAL_S = 0.5  # summaries every 0.5 s keep swarm tests fast (the default is 2 s)


def swarm_config(
    *,
    bootstrap: Sequence[str] = (),
    identity: Path | None = None,
    interval_s: float = TEST_INTERVAL_S,
) -> PeerConfig:
    return PeerConfig(
        model="prefixswarm/cache-only",
        listen_addrs=LOOPBACK,
        bootstrap=tuple(bootstrap),
        identity_file=identity,
        summary_interval_s=interval_s,
    )


@dataclass
class RunningPeer:
    """A peer running in its own task; `kill()` cancels it (no goodbye beyond close)."""

    peer: Peer
    scope: trio.CancelScope
    done: trio.Event

    async def kill(self) -> None:
        self.scope.cancel()
        with trio.fail_after(10):
            await self.done.wait()


async def start_peer(
    nursery: trio.Nursery, config: PeerConfig, engine: Any | None = None
) -> RunningPeer:
    """Start a peer in `nursery`; returns once it is up."""
    engine = engine if engine is not None else CacheOnlyEngine()

    async def run(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        done = trio.Event()
        try:
            with trio.CancelScope() as scope:
                async with open_peer(config, engine=engine) as peer:
                    task_status.started(RunningPeer(peer, scope, done))
                    await trio.sleep_forever()
        finally:
            done.set()

    result: RunningPeer = await nursery.start(run)
    return result


async def wait_until(
    condition: Callable[[], bool], *, timeout_s: float, what: str, poll_s: float = 0.05
) -> float:
    """Poll `condition` until true; returns the seconds it took. AssertionError on timeout.

    (Real sockets and real time: there is no event to wait on for "every table agrees".)
    """
    start = trio.current_time()
    with trio.move_on_after(timeout_s):
        while not condition():
            await trio.sleep(poll_s)
        return trio.current_time() - start
    raise AssertionError(f"not within {timeout_s} s: {what}")


def known_peers(peer: Peer) -> set[str]:
    return {view.peer_id for view in peer.table.views(trio.current_time())}


def everyone_sees_everyone(peers: Sequence[Peer]) -> bool:
    ids = {p.peer_id for p in peers}
    return all(known_peers(p) == ids - {p.peer_id} for p in peers)


# -- peers in their own OS processes (python -m peer.node_runner) ---------------------

REPO_ROOT = Path(__file__).resolve().parent.parent


RUNNER_STARTUP_S = 30.0  # an interpreter start-up (with torch) on a loaded machine


async def spawn_peer_process(
    procs: PeerProcesses, args: Sequence[str], *, stderr_path: Path
) -> PeerProcess:
    """A runner process (see peer.node_runner), once it reported its address. Start
    `procs` is the `runners` fixture (open_peer_processes from the repository root)."""
    proc = await procs.start(runner_command(args), log_path=stderr_path)
    await proc.wait_up(RUNNER_STARTUP_S)
    return proc
