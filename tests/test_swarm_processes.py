"""Swarm membership with one peer per OS process (python -m peer.node_runner).

Discovery through one bootstrap peer, summaries crossing process boundaries, a SIGKILLed
peer expiring from every table, and its return with the same identity.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from peer.processes import PeerProcess, PeerProcesses
from tests.helpers_swarm import spawn_peer_process, wait_until

INTERVAL_S = 0.5
PREFIX_TOKENS = 64  # 4 blocks of 16


def _args(*, identity: Path, bootstrap: str | None = None, insert: int = 0) -> list[str]:
    args = [
        "--interval",
        str(INTERVAL_S),
        "--identity",
        str(identity),
        "--probe-tokens",
        str(PREFIX_TOKENS),
        "--insert-tokens",
        str(insert),
        "--report-interval",
        "0.1",
    ]
    return args if bootstrap is None else [*args, "--bootstrap", bootstrap]


def _complete(procs: list[PeerProcess]) -> bool:
    ids = {p.peer_id for p in procs}
    return all(p.known == ids - {p.peer_id} for p in procs)


@pytest.mark.slow  # ~20 s on a loaded 2-core machine: 5 interpreter start-ups
async def test_processes_discover_exchange_expire_and_return(
    runners: PeerProcesses, tmp_path: Path
) -> None:
    with trio.fail_after(90):
        log = tmp_path / "stderr.log"
        first = await spawn_peer_process(
            runners, _args(identity=tmp_path / "p0.key"), stderr_path=log
        )
        boot = first.multiaddrs[0]
        rest: dict[int, PeerProcess] = {}

        async def spawn(i: int) -> None:
            args = _args(
                identity=tmp_path / f"p{i}.key",
                bootstrap=boot,
                insert=PREFIX_TOKENS if i == 1 else 0,
            )
            rest[i] = await spawn_peer_process(runners, args, stderr_path=log)

        async with trio.open_nursery() as starting:  # start the processes in parallel
            for i in range(1, 4):
                starting.start_soon(spawn, i)
        procs = [first, rest[1], rest[2], rest[3]]
        took = await wait_until(lambda: _complete(procs), timeout_s=15, what="complete tables")
        print(f"process tables complete after {took:.2f} s")

        # Peer 1 started with the prefix cached; everyone else estimates 4 blocks for it.
        holder = procs[1].peer_id
        for p in procs:
            for peer_id, row in (p.table or {}).items():
                assert row["match_blocks"] == (4 if peer_id == holder else 0), (p.peer_id, peer_id)

        victim = procs[3]
        victim_id = victim.peer_id
        killed_at = trio.current_time()
        victim.kill()
        survivors = procs[:3]
        await wait_until(
            lambda: all(victim_id not in p.known for p in survivors),
            timeout_s=3 * INTERVAL_S + 2,
            what="SIGKILLed peer gone from every table",
        )
        took = trio.current_time() - killed_at
        print(f"SIGKILLed peer expired after {took:.2f} s")
        assert took <= 3 * INTERVAL_S + 1.0  # + report interval and a loaded machine

        back = await spawn_peer_process(
            runners, _args(identity=tmp_path / "p3.key", bootstrap=boot), stderr_path=log
        )
        assert back.peer_id == victim_id
        took = await wait_until(
            lambda: _complete([*survivors, back]), timeout_s=15, what="restarted peer seen"
        )
        print(f"restarted process seen again after {took:.2f} s")
