"""Peers as child processes: start them, follow their JSON reports, stop them.

The one supervisor for every place that runs peers as OS processes: `prefixswarm local`
(peer.local_swarm), bench.swarm, bench.adversary, bench.reach (in network namespaces),
and the runners of the tests and bench.gossip (peer.node_runner). A child prints one
JSON object a line on stdout (`peer.cli serve --report json`, `python -m
peer.node_runner`); its PeerProcess keeps what it last said.

    async with open_peer_processes() as procs:
        first = await procs.start(command, log_path=...)
        await first.wait_up(timeout_s)
        ...

Leaving the block, however it is left, stops every child: its stdin closes and it gets
SIGTERM, then whatever still runs after the grace period is SIGKILLed, and every child
is reaped. Children run in their own session (a terminal's Ctrl-C reaches only the
parent, which stops them) and stop by themselves when the parent dies (stdin closes).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # a peer closes its host and sockets in well under a second
POLL_S = 0.1  # readiness checks: children report every 0.1-0.5 s
LOG_TAIL_LINES = 25  # of a failed child's stderr, shown to the user
MAX_REPORT_LINE = 1 << 20  # a child's JSON line; longer means something is broken


class PeerProcessError(RuntimeError):
    """A child peer failed to start or died; the message carries the end of its log."""


@dataclass
class PeerProcess:
    """One child process and what it last reported."""

    index: int  # 1-based, in start order, as shown to the user
    process: trio.Process
    log_path: Path | None
    keep_reports: bool = False
    up: trio.Event = field(default_factory=trio.Event)  # "up" seen, or stdout closed
    peer_id: str = ""
    multiaddrs: tuple[str, ...] = ()
    http: str | None = None
    model: str = ""  # the model id it serves, format included ("up" line)
    known: frozenset[str] = frozenset()  # the peers it knows ("peers" or "table" lines)
    # of those, the ones with a measured round trip: its router's candidates ("peers")
    routable: frozenset[str] = frozenset()
    table: dict[str, Any] | None = None  # node_runner: the last table report
    stats: dict[str, Any] | None = None  # node_runner: the last statistics
    reports: list[dict[str, Any]] = field(default_factory=list)  # table lines, if kept
    events: list[dict[str, Any]] = field(default_factory=list)  # any other lines
    down: bool = False  # it said goodbye

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def log_tail(self) -> str:
        if self.log_path is None:
            return ""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def check_alive(self) -> None:
        """PeerProcessError, with the end of its log, if the child has exited."""
        code = self.process.poll()
        if code is not None:
            raise PeerProcessError(
                f"peer {self.index} exited with status {code}; its log ends with:\n"
                + self.log_tail()
            )

    def kill(self) -> None:
        """SIGKILL: no goodbye, no socket close (the supervisor still reaps it)."""
        self.process.kill()

    async def wait_up(self, timeout_s: float) -> None:
        """Return once the child reported its address; PeerProcessError if it exits first
        or takes longer than `timeout_s`."""
        with trio.move_on_after(timeout_s):
            await self.up.wait()
        if not self.peer_id:
            if not self.up.is_set():
                raise PeerProcessError(f"peer {self.index} not up within {timeout_s:.0f} s")
            raise PeerProcessError(
                f"peer {self.index} exited before reporting its address; its log ends with:\n"
                + self.log_tail()
            )

    def apply(self, report: Mapping[str, Any]) -> None:
        """Take one report line into account."""
        kind = report.get("event")
        if kind == "up":
            self.peer_id = str(report.get("peer_id", ""))
            self.multiaddrs = tuple(report.get("multiaddrs", ()))
            self.http = report.get("http")
            self.model = str(report.get("model", ""))
            self.up.set()
        elif kind == "peers":  # peer.cli serve
            self.known = frozenset(report.get("peer_ids", ()))
            self.routable = frozenset(report.get("routable", ()))
        elif kind == "table":  # peer.node_runner
            self.table, self.stats = report.get("peers"), report.get("stats")
            self.known = frozenset(self.table or {})
            if self.keep_reports:
                self.reports.append(dict(report))
        elif kind == "down":
            self.down = True
        elif kind != "loading":
            self.events.append(dict(report))


def peer_process_environment(peers: int) -> dict[str, str]:
    """The environment for one of `peers` peer processes on this machine: its share of
    the cores for torch's intra-op threads (default OpenMP threads spin-wait on each
    other when several peers share few cores; docs/model.md has the measurement)."""
    threads = str(max(1, (os.cpu_count() or 1) // max(1, peers)))
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


class PeerProcesses:
    """The children started in one `open_peer_processes()` block, in start order."""

    def __init__(self, nursery: trio.Nursery, *, cwd: Path | None, grace_s: float) -> None:
        self._nursery = nursery
        self._cwd = cwd
        self._grace_s = grace_s
        self._procs: list[PeerProcess] = []

    def __iter__(self) -> Iterator[PeerProcess]:
        return iter(list(self._procs))

    def __len__(self) -> int:
        return len(self._procs)

    async def start(
        self,
        command: Sequence[str],
        *,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        keep_reports: bool = False,
        on_report: Callable[[dict[str, Any]], None] | None = None,
    ) -> PeerProcess:
        """Start `command`; its stderr is appended to `log_path` (default: discarded).
        Returns at once: `await proc.wait_up(...)` waits for its address. Each JSON line
        goes to `on_report` if given (a child with reports of its own, which then says
        when it is up), else to `PeerProcess.apply`."""
        with open(log_path if log_path is not None else os.devnull, "ab") as log:
            process = await trio.lowlevel.open_process(
                list(command),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=self._cwd,
                env=None if env is None else dict(env),
                start_new_session=True,  # Ctrl-C reaches the parent only: it stops them
            )
        proc = PeerProcess(len(self._procs) + 1, process, log_path, keep_reports)
        self._procs.append(proc)
        self._nursery.start_soon(_follow, proc, on_report or proc.apply)
        return proc

    async def wait_for(
        self, ready: Callable[[], bool], what: str, timeout_s: float, poll_s: float = POLL_S
    ) -> None:
        """Poll until `ready()`; PeerProcessError if a child exits or time runs out."""
        with trio.move_on_after(timeout_s):
            while True:
                for proc in self._procs:
                    proc.check_alive()
                if ready():
                    return
                await trio.sleep(poll_s)
        raise PeerProcessError(f"not within {timeout_s:.0f} s: {what}")

    async def stop_all(self) -> None:
        """Close stdin and SIGTERM every child, wait up to the grace period, SIGKILL the
        rest; every child is reaped."""
        running = [p for p in self._procs if p.process.poll() is None]
        for proc in running:
            if proc.process.stdin is not None:
                await proc.process.stdin.aclose()
            proc.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(self._grace_s):
            for proc in running:
                await proc.process.wait()
        for proc in self._procs:
            if proc.process.poll() is None:
                logger.warning("peer %d still running after %.0f s: SIGKILL",
                               proc.index, self._grace_s)
                proc.process.kill()
            await proc.process.wait()


@asynccontextmanager
async def open_peer_processes(
    *, cwd: Path | None = None, grace_s: float = STOP_GRACE_S
) -> AsyncIterator[PeerProcesses]:
    """A supervisor whose children all stop (and are reaped) when the block exits."""
    async with trio.open_nursery() as nursery:
        procs = PeerProcesses(nursery, cwd=cwd, grace_s=grace_s)
        try:
            yield procs
        finally:
            with trio.CancelScope(shield=True):
                await procs.stop_all()
            nursery.cancel_scope.cancel()


async def _follow(proc: PeerProcess, apply: Callable[[dict[str, Any]], None]) -> None:
    """Hand the child's JSON lines to `apply` until its stdout closes."""
    assert proc.process.stdout is not None
    buffer = b""
    try:
        async for chunk in proc.process.stdout:
            buffer += chunk
            if len(buffer) > MAX_REPORT_LINE:
                raise PeerProcessError(
                    f"peer {proc.index} wrote a line over {MAX_REPORT_LINE} bytes"
                )
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                try:
                    report = json.loads(line)
                except ValueError:
                    logger.debug("peer %d: not a JSON line: %r", proc.index, line[:200])
                    continue
                if isinstance(report, dict):
                    apply(report)
    finally:
        proc.up.set()  # wakes wait_up() if the child died first
