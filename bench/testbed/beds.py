"""Where testbed peers run: a `Bed` starts a swarm of real peers and stops it.

`IsolatedBed` (the testbed proper) gives each peer its own network namespace behind the
link emulator and its own CPU share (bench/testbed/net.py), and starts peers through a
fork server (bench/testbed/zygote.py) so a start costs no imports. `LoopbackBed`
(`--no-isolation`, for developing the runner) starts plain peer processes on 127.0.0.1,
with neither delay nor quotas. Each swarm starts fresh (cold caches): peer 0 first, the
others bootstrapped to it, and it is handed over once every peer can route to every other.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from bench.testbed.net import CFS_PERIOD_US, cpu_groups, testbed_network
from peer.processes import PeerProcess, PeerProcessError, open_peer_processes

PEER_PORT, HTTP_PORT = 4001, 8000
PORT_CYCLE = 64  # each swarm of an isolated bed listens on the next ports: no wait for reuse
READY_TIMEOUT_S = 60.0  # a forked tiny-random peer is up in ~1-3 s; a busy machine is slow
REQUEST_TIMEOUT_S = 60.0  # one request end to end; far above any healthy request here
MAX_IN_FLIGHT = 256  # client-side bound; the peers' own admission bounds sit behind it
STOP_GRACE_S = 5.0
DRAIN_TIMEOUT_S = 1.0  # every request has ended when a swarm stops
POLL_S = 0.1


def log(message: str) -> None:
    print(f"bench.testbed: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class PeerSettings:
    """How every peer of a run is started (trust and everything else at defaults)."""

    model: str = "tiny-random"
    cache_bytes: int = 2_000_000
    summary_interval_s: float = 1.0
    log_path: Path = Path(os.devnull)
    extra_args: tuple[str, ...] = ()

    def argv(self, policy: str, listen: str, http: str, bootstrap: Sequence[str],
             insecure: bool, identity: str = "none") -> list[str]:
        """`peer.cli serve` arguments (without the program) for one peer."""
        argv = [
            "serve", "--config", "none", "--model", self.model, "--policy", policy,
            "--identity", identity, "--listen", listen, "--http", http,
            "--cache-bytes", str(self.cache_bytes),
            "--summary-interval", str(self.summary_interval_s), "--threads", "1",
            "--drain-timeout", str(DRAIN_TIMEOUT_S),
            "--report", "json", "--log-level", "error", *self.extra_args,
        ]
        if insecure:
            argv.append("--insecure-no-api-key")
        if bootstrap:
            argv += ["--bootstrap", *bootstrap]
        return argv


class SwarmPeer(Protocol):
    """What the runner reads of a running peer (peer.processes.PeerProcess has it)."""

    @property
    def peer_id(self) -> str: ...
    @property
    def http(self) -> str | None: ...
    @property
    def multiaddrs(self) -> tuple[str, ...]: ...
    @property
    def known(self) -> frozenset[str]: ...
    @property
    def routable(self) -> frozenset[str]: ...


@dataclass
class Swarm:
    """A running swarm: its peers in index order and each one's CPU seconds so far."""

    peers: list[SwarmPeer]
    cpu_seconds: Callable[[int], float]
    shares: tuple[float, ...]
    up_s: float = math.nan  # from the first spawn until every peer reported its address


class Bed(Protocol):
    """Where swarms run: `swarm(policy)` starts one and stops it when the block exits."""

    shares: tuple[float, ...]
    isolated: bool

    def swarm(self, policy: str) -> Any: ...  # an async context manager of Swarm
    def set_delay(self, delay_s: float) -> None: ...
    def link_stats(self) -> dict[str, Any]: ...


def _proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (loopback bed: no cgroups)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_known(peers: Sequence[SwarmPeer], alive: Callable[[], None]) -> None:
    """Until every peer can route to every other: a summary of it and a measured round
    trip (a serving peer's router skips peers it never pinged). Knowing a peer by gossip
    alone comes seconds earlier on starved peers, and a workload sent then measured the
    swarm still connecting: the forwarding policies had only the bootstrap peer to pick."""
    ids = {p.peer_id for p in peers}
    with trio.move_on_after(READY_TIMEOUT_S):
        while not all(p.routable >= ids - {p.peer_id} for p in peers):
            alive()
            await trio.sleep(POLL_S)
        return
    raise PeerProcessError(
        f"not within {READY_TIMEOUT_S:.0f} s: every peer measured a round trip to every other")


class LoopbackBed:
    """Peers as plain processes on 127.0.0.1: no namespaces, quotas or delay (develop)."""

    isolated = False

    def __init__(self, shares: Sequence[float], settings: PeerSettings) -> None:
        self.shares = tuple(shares)
        self.settings = settings

    def set_delay(self, delay_s: float) -> None:
        if delay_s:
            log(f"loopback bed: no link emulation, delay {delay_s * 1000:g} ms ignored")

    def link_stats(self) -> dict[str, Any]:
        return {}

    @asynccontextmanager
    async def swarm(self, policy: str) -> AsyncIterator[Swarm]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        async with open_peer_processes(grace_s=STOP_GRACE_S) as procs:

            async def start(bootstrap: Sequence[str]) -> PeerProcess:
                argv = self.settings.argv(policy, "/ip4/127.0.0.1/tcp/0", "127.0.0.1:0",
                                          bootstrap, insecure=False)
                proc = await procs.start([sys.executable, "-m", "peer.cli", *argv],
                                         log_path=self.settings.log_path, env=env)
                await proc.wait_up(READY_TIMEOUT_S)
                return proc

            first = await start([])
            rest: list[PeerProcess | None] = [None] * (len(self.shares) - 1)

            async def other(i: int) -> None:
                rest[i] = await start(first.multiaddrs[:1])

            async with trio.open_nursery() as nursery:
                for i in range(len(rest)):
                    nursery.start_soon(other, i)
            peers = [first, *(p for p in rest if p is not None)]

            def alive() -> None:
                for p in peers:
                    p.check_alive()

            await _wait_known(peers, alive)
            yield Swarm(list(peers), lambda i: _proc_cpu_seconds(peers[i].pid), self.shares)


@dataclass
class ReportedPeer:
    """A zygote child's JSON reports, read from its stdout file."""

    index: int
    pid: int
    stdout: Path
    log_path: Path
    peer_id: str = ""
    http: str | None = None
    multiaddrs: tuple[str, ...] = ()
    known: frozenset[str] = frozenset()
    routable: frozenset[str] = frozenset()
    _offset: int = 0
    _buffer: bytes = b""

    def poll(self) -> None:
        """Take the report lines written since the last poll."""
        try:
            with open(self.stdout, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return
        self._offset += len(chunk)
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        for line in lines:
            try:
                report = json.loads(line)
            except ValueError:
                continue
            if not isinstance(report, dict):
                continue
            if report.get("event") == "up":
                self.peer_id = str(report.get("peer_id", ""))
                self.multiaddrs = tuple(report.get("multiaddrs", ()))
                self.http = report.get("http")
            elif report.get("event") == "peers":
                self.known = frozenset(report.get("peer_ids", ()))
                self.routable = frozenset(report.get("routable", ()))

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        try:  # a zombie (exited, not yet reaped by its zygote) is not alive
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def check(self) -> None:
        if not self.alive():
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
            raise PeerProcessError(f"peer {self.index} (pid {self.pid}) exited; log ends:\n"
                                   f"{tail}")


class Zygote:
    """The fork server (bench/testbed/zygote.py): one request, one reply, in turn."""

    def __init__(self, proc: PeerProcess,
                 replies: trio.MemoryReceiveChannel[dict[str, Any]]) -> None:
        self.proc = proc
        self.replies = replies
        self.lock = trio.Lock()

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        async with self.lock:
            stdin = self.proc.process.stdin
            assert stdin is not None
            await stdin.send_all((json.dumps(request) + "\n").encode())
            with trio.fail_after(READY_TIMEOUT_S):
                return await self.replies.receive()


class IsolatedBed:
    """Namespaces, the link emulator and CPU groups (bench/testbed/net.py) and one fork
    server whose children enter their peer's namespace; `async with IsolatedBed.open(...)`."""

    isolated = True

    def __init__(self, shares: Sequence[float], settings: PeerSettings, net: Any,
                 groups: Any, zygote: Zygote, workdir: Path) -> None:
        self.shares = tuple(shares)
        self.settings = settings
        self.net = net
        self.groups = groups
        self.zygote = zygote
        self.workdir = workdir
        self._bandwidth_bps = 20e6
        self._runs = 0
        self._swarms = 0
        self.identities = [workdir / f"identity-p{i}.key" for i in range(len(self.shares))]
        self.peer_ids = [_make_identity(path) for path in self.identities]

    @classmethod
    @asynccontextmanager
    async def open(cls, shares: Sequence[float], settings: PeerSettings, tag: str,
                   bandwidth_bps: float, workdir: Path, period_us: int,
                   ) -> AsyncIterator[IsolatedBed]:
        with (testbed_network(len(shares), tag) as net,
              cpu_groups(shares, tag, period_us) as groups):
            net.set_link(0.0, bandwidth_bps)
            async with open_peer_processes(grace_s=STOP_GRACE_S) as procs:
                send, receive = trio.open_memory_channel[dict[str, Any]](16)
                ready = trio.Event()

                def on_report(report: dict[str, Any]) -> None:
                    if report.get("ready"):
                        ready.set()
                    else:
                        send.send_nowait(report)

                proc = await procs.start([sys.executable, "-m", "bench.testbed.zygote"],
                                         log_path=settings.log_path, on_report=on_report)
                with trio.fail_after(READY_TIMEOUT_S * 2):
                    await ready.wait()
                zygote = Zygote(proc, receive)
                bed = cls(shares, settings, net, groups, zygote, workdir)
                bed._bandwidth_bps = bandwidth_bps
                yield bed

    def set_delay(self, delay_s: float) -> None:
        self.net.set_link(delay_s, self._bandwidth_bps)

    def link_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.net.stats()
        return stats

    async def _spawn(self, i: int, policy: str, bootstrap: Sequence[str]) -> ReportedPeer:
        ip = self.net.peer_ips[i]
        offset = self._swarms % PORT_CYCLE
        argv = self.settings.argv(policy, f"/ip4/{ip}/tcp/{PEER_PORT + offset}",
                                  f"{ip}:{HTTP_PORT + offset}",
                                  bootstrap, insecure=True, identity=str(self.identities[i]))
        self._runs += 1
        stdout = self.workdir / f"run{self._runs}-p{i}.out"
        reply = await self.zygote.call({"op": "spawn", "argv": argv, "stdout": str(stdout),
                                         "stderr": str(self.settings.log_path),
                                         "netns": self.net.namespaces[i]})
        if "pid" not in reply:
            raise PeerProcessError(f"zygote {i} could not spawn a peer: {reply}")
        peer = ReportedPeer(i, int(reply["pid"]), stdout, self.settings.log_path)
        with trio.move_on_after(READY_TIMEOUT_S):
            while not peer.peer_id:
                peer.check()
                await trio.sleep(POLL_S)
                peer.poll()
        if not peer.peer_id:
            raise PeerProcessError(f"peer {i} not up within {READY_TIMEOUT_S:.0f} s")
        return peer

    async def _stop(self, peers: Sequence[ReportedPeer]) -> None:
        """SIGKILL: the run is measured, a graceful drain would only cost time."""
        for p in peers:
            if p.alive():
                with _suppress_lookup():
                    os.kill(p.pid, signal.SIGKILL)
        with trio.move_on_after(STOP_GRACE_S):
            while any(p.alive() for p in peers):
                await trio.sleep(POLL_S)
        with trio.move_on_after(STOP_GRACE_S):
            await self.zygote.call({"op": "reap"})

    @asynccontextmanager
    async def swarm(self, policy: str) -> AsyncIterator[Swarm]:
        peers: list[ReportedPeer] = []
        began = time.perf_counter()
        try:
            # Identities are made in advance, so peer 0's address is known and every peer
            # starts at once (a bootstrap dial retries while peer 0 comes up).
            self._swarms += 1
            first = self.net.peer_ips[0]
            port = PEER_PORT + self._swarms % PORT_CYCLE
            bootstrap = [f"/ip4/{first}/tcp/{port}/p2p/{self.peer_ids[0]}"]
            started: list[ReportedPeer | None] = [None] * len(self.shares)

            async def start(i: int) -> None:
                started[i] = await self._spawn(i, policy, bootstrap if i else [])

            async with trio.open_nursery() as nursery:
                for i in range(len(self.shares)):
                    nursery.start_soon(start, i)
            peers += [p for p in started if p is not None]
            if len(peers) != len(self.shares):
                raise PeerProcessError("a peer did not start")
            up_s = time.perf_counter() - began

            async def follow() -> None:
                while True:
                    for p in peers:
                        p.poll()
                    await trio.sleep(POLL_S)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow)

                def alive() -> None:
                    for p in peers:
                        p.check()

                await _wait_known(peers, alive)
                # Start-up runs unconfined (it is not measured); the quotas from here on.
                for p in peers:
                    self.groups.join(p.index, p.pid)
                yield Swarm(list(peers), self.groups.usage_s, self.shares, up_s)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._stop(peers)


def _make_identity(path: Path) -> str:
    """Create an ed25519 identity file for a peer; its peer id."""
    from libp2p.peer.id import ID

    from peer.net.host import load_or_create_identity

    return str(ID.from_pubkey(load_or_create_identity(path).public_key))


class _suppress_lookup:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        return kind is ProcessLookupError


# -- one policy run ---------------------------------------------------------------------


@asynccontextmanager
async def open_bed(isolated: bool, shares: Sequence[float], settings: PeerSettings,
                   bandwidth_bps: float, workdir: Path,
                   period_us: int = CFS_PERIOD_US) -> AsyncIterator[Bed]:
    """The bed the CLI asked for (`period_us`: the CPU groups' CFS period)."""
    async with AsyncExitStack() as stack:
        if isolated:
            tag = f"{os.getpid() % 10000}"
            bed: Bed = await stack.enter_async_context(
                IsolatedBed.open(shares, settings, tag, bandwidth_bps, workdir, period_us))
        else:
            bed = LoopbackBed(shares, settings)
        yield bed
