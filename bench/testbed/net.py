"""The testbed's machines on one host: a network namespace per peer, the link emulator
between them, and a CPU group (cgroup quota) per peer.

    with testbed_network(peers=4, tag=tag) as net:       # namespaces pst<tag>-p<i>
        net.set_link(delay_s=0.02, bandwidth_bps=20e6)   # every directed peer pair
        argv = net.in_namespace(0, [...])                # runs inside peer 0's namespace
        net.peer_ips[0], net.client_ip, net.stats()
    with cpu_groups([0.2, 0.3, 0.4, 0.5], tag) as groups:
        groups.join(0, pid); groups.usage_s(0)

Addresses: 10.97.K.0/24 (K the first subnet not routed here yet, so two testbeds can run
at once), peer i at 10.97.K.(i+1), the client (the root namespace, where the load
generator runs) at 10.97.K.254. Every packet between two of them crosses the emulator
(bench.testbed.emulator): peer<->peer through that pair's delay and cap, client<->peer at
once (the client stands for a user next to its entry peer).
netem would do the same in the kernel; `netem_available()` says whether this kernel has
it, but the userspace emulator is used either way, so results compare across machines.
Everything built here is removed on exit, also after a failure. Needs root.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

SUBNET_PREFIX = "10.97"
CLIENT_HOST = 254
MAX_PEERS = 200  # hosts .1 .. .200 of the /24; the client is .254
EMULATOR_READY_TIMEOUT_S = 30.0
LOCK_PATH = Path("/run/prefixswarm-testbed.lock")  # serialises the choice of a free subnet
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V1_CPUACCT = Path("/sys/fs/cgroup/cpuacct")
CGROUP_V2 = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000  # the kernel's default period
MIN_CFS_PERIOD_US, MAX_CFS_PERIOD_US = 1_000, 1_000_000  # what the kernel accepts
MIN_CFS_QUOTA_US = 1_000


class TestbedUnavailable(Exception):
    """This machine cannot build the testbed; the message is the one line saying why."""


def _sh(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise TestbedUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def _cgroup_v2_cpu() -> bool:
    """cgroup v2 mounted at /sys/fs/cgroup with the cpu controller available."""
    controllers = CGROUP_V2 / "cgroup.controllers"
    return controllers.exists() and "cpu" in controllers.read_text().split()


def check_support() -> str | None:
    """None when this machine can run the testbed, else one line saying what is missing."""
    if sys.platform != "linux":
        return "the testbed needs Linux (network namespaces, cgroups, TUN)"
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, TUN devices, cgroups)"
    if shutil.which("ip") is None:
        return "`ip` is missing (apt-get install -y iproute2)"
    if not Path("/dev/net/tun").exists():
        return "/dev/net/tun is missing (the link emulator needs TUN devices)"
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as exc:
        return f"/dev/net/tun cannot be opened: {exc.strerror}"
    if not (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists() and not _cgroup_v2_cpu():
        return "no cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 cpu.max)"
    probe = f"pstprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        return f"network namespaces are unavailable: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, check=False)
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (tried on lo of a throwaway namespace)."""
    if shutil.which("tc") is None:
        return False
    probe = f"pstnetem{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True,
                      check=False).returncode != 0:
        return False
    try:
        done = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo",
                               "root", "netem", "delay", "1ms"], capture_output=True,
                              check=False)
        return done.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True, check=False)


def _free_subnet() -> str:
    """The first 10.97.K (K in 0..255) with no route in the root namespace."""
    routes = _sh("ip", "-4", "route", "show")
    used = {line.split()[0] for line in routes.splitlines() if line}
    for k in range(256):
        if f"{SUBNET_PREFIX}.{k}.0/24" not in used:
            return f"{SUBNET_PREFIX}.{k}"
    raise TestbedUnavailable(f"no free {SUBNET_PREFIX}.K.0/24 subnet left")


@dataclass
class TestbedNet:
    """A built testbed network (see the module doc); its methods talk to the emulator."""

    namespaces: tuple[str, ...]
    peer_ips: tuple[str, ...]
    client_ip: str
    emulator_pid: int
    _emulator: subprocess.Popen[str] = field(repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def in_namespace(self, i: int, argv: list[str]) -> list[str]:
        """`argv` wrapped to run inside peer i's namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        stdin, stdout = self._emulator.stdin, self._emulator.stdout
        assert stdin is not None and stdout is not None
        with self._lock:
            stdin.write(json.dumps(request) + "\n")
            stdin.flush()
            line = stdout.readline()
        if not line:
            raise RuntimeError(f"the link emulator exited (code {self._emulator.poll()})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise ValueError(f"link emulator: {answer['error']}")
        return answer

    def set_link(self, delay_s: float, bandwidth_bps: float) -> None:
        """Every directed peer<->peer link gets one-way delay `delay_s` and cap
        `bandwidth_bps` (math.inf: no cap). Packets already queued keep their times."""
        bandwidth_mbit = None if bandwidth_bps == float("inf") else bandwidth_bps / 1e6
        self._ask({"op": "set", "delay_ms": delay_s * 1e3, "bandwidth_mbit": bandwidth_mbit})

    def stats(self) -> dict[str, Any]:
        """The emulator's counters (packets, bytes, dropped, per_link, cpu_s)."""
        return self._ask({"op": "stats"})


def _wait_ready(process: subprocess.Popen[str]) -> dict[str, Any]:
    """The emulator's ready line; TestbedUnavailable with its error when it fails."""
    stdout: IO[str] | None = process.stdout
    assert stdout is not None
    timer = threading.Timer(EMULATOR_READY_TIMEOUT_S, process.kill)
    timer.start()
    try:
        line = stdout.readline()
    finally:
        timer.cancel()
    if not line:
        stderr = process.stderr.read() if process.stderr else ""
        tail = stderr.strip().splitlines()[-1:] or [f"exit code {process.wait()}"]
        raise TestbedUnavailable(f"the link emulator did not start: {tail[0]}")
    ready: dict[str, Any] = json.loads(line)
    if not ready.get("ready"):
        raise TestbedUnavailable(f"the link emulator did not start: {ready}")
    return ready


@contextmanager
def testbed_network(peers: int, tag: str, delay_s: float = 0.0,
                    bandwidth_bps: float = 20e6) -> Iterator[TestbedNet]:
    """Namespaces pst<tag>-p<i> (lo up) joined by the link emulator; all removed on exit.

    `tag` keeps concurrent testbeds apart (a few letters/digits: device names are short)."""
    if not 1 <= peers <= MAX_PEERS:
        raise ValueError(f"peers must be in 1..{MAX_PEERS}, got {peers}")
    if not tag.isalnum() or len(tag) > 8:
        raise ValueError(f"tag must be 1..8 letters or digits, got {tag!r}")
    missing = check_support()
    if missing:
        raise TestbedUnavailable(missing)
    namespaces = tuple(f"pst{tag}-p{i}" for i in range(peers))
    made: list[str] = []
    emulator: subprocess.Popen[str] | None = None
    try:
        for ns in namespaces:
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK_PATH, "w") as lock:  # held until the emulator's routes exist
            fcntl.flock(lock, fcntl.LOCK_EX)
            subnet = _free_subnet()
            bandwidth_mbit = "inf" if bandwidth_bps == float("inf") else f"{bandwidth_bps / 1e6:g}"
            emulator = subprocess.Popen(
                [sys.executable, "-m", "bench.testbed.emulator", "--tag", tag,
                 "--subnet", subnet, "--delay-ms", f"{delay_s * 1e3:g}",
                 "--bandwidth-mbit", bandwidth_mbit, *namespaces],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, bufsize=1,
            )
            ready = _wait_ready(emulator)
        yield TestbedNet(
            namespaces=namespaces, peer_ips=tuple(ready["peer_ips"]),
            client_ip=ready["client_ip"], emulator_pid=emulator.pid, _emulator=emulator,
        )
    finally:
        if emulator is not None:
            _stop(emulator)
        for ns in made:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, check=False)


def _stop(emulator: subprocess.Popen[str]) -> None:
    """Close the emulator's stdin (it exits, its TUN devices vanish); kill it if it lingers."""
    if emulator.stdin:
        with suppress(BrokenPipeError):
            emulator.stdin.close()
    try:
        emulator.wait(timeout=5)
    except subprocess.TimeoutExpired:
        emulator.kill()
        emulator.wait()
    for stream in (emulator.stdout, emulator.stderr):
        if stream:
            stream.close()


# -- CPU groups ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuGroups:
    """One CPU group per share: a CFS quota of share x one core (see cpu_groups)."""

    shares: tuple[float, ...]
    cpu_dirs: tuple[Path, ...]  # v1 cpu/ groups, or the v2 groups
    acct_dirs: tuple[Path, ...]  # v1 cpuacct/ groups ((): v2 counts in cpu.stat)

    def join(self, i: int, pid: int) -> None:
        """Move the whole process `pid` (all its threads) into group i."""
        for group in (self.cpu_dirs[i], *self.acct_dirs[i:i + 1]):
            (group / "cgroup.procs").write_text(f"{pid}\n")

    def usage_s(self, i: int) -> float:
        """CPU seconds used so far by the processes in group i."""
        if self.acct_dirs:
            return int((self.acct_dirs[i] / "cpuacct.usage").read_text()) / 1e9
        for line in (self.cpu_dirs[i] / "cpu.stat").read_text().splitlines():
            key, value = line.split()
            if key == "usage_usec":
                return int(value) / 1e6
        raise RuntimeError(f"{self.cpu_dirs[i]}/cpu.stat has no usage_usec")


def _evacuate_and_remove(group: Path, parent: Path, tries: int = 20) -> None:
    """Move what is left in `group` to `parent`, then remove the group. A process that
    is exiting (a zombie) still holds its group for a moment, so removal is retried."""
    for attempt in range(tries):
        if not group.exists():
            return
        for pid in (group / "cgroup.procs").read_text().split():
            with suppress(OSError):  # it exited meanwhile
                (parent / "cgroup.procs").write_text(f"{pid}\n")
        try:
            group.rmdir()
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or attempt == tries - 1:
                raise
            time.sleep(0.05)


def quota_problem(shares: Sequence[float], period_us: int) -> str | None:
    """Why these shares cannot be CFS quotas in a period of `period_us` (None: they can):
    the kernel takes periods of 1 ms to 1 s and quotas of at least 1 ms."""
    if not MIN_CFS_PERIOD_US <= period_us <= MAX_CFS_PERIOD_US:
        return (f"a CFS period must be {MIN_CFS_PERIOD_US / 1000:g} to "
                f"{MAX_CFS_PERIOD_US / 1000:g} ms, got {period_us / 1000:g}")
    for share in shares:
        if not 0 < share <= 64:
            return f"a CPU share must be in (0, 64] cores, got {share:g}"
        if share * period_us < MIN_CFS_QUOTA_US:
            return (f"a share of {share:g} core in a {period_us / 1000:g} ms period is below "
                    f"the kernel's least quota ({MIN_CFS_QUOTA_US / 1000:g} ms)")
    return None


@contextmanager
def cpu_groups(shares: Sequence[float], tag: str,
               period_us: int = CFS_PERIOD_US) -> Iterator[CpuGroups]:
    """Groups pst<tag>-g<i> capped at shares[i] of one core (quota / `period_us`);
    removed on exit (processes still in them move back to the top group)."""
    if (problem := quota_problem(shares, period_us)) is not None:
        raise ValueError(problem)
    names = [f"pst{tag}-g{i}" for i in range(len(shares))]
    v1 = (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists()
    if v1:
        cpu_parent, acct_parent = CGROUP_V1_CPU, CGROUP_V1_CPUACCT
        cpu_dirs = tuple(cpu_parent / n for n in names)
        acct_dirs = tuple(acct_parent / n for n in names) if acct_parent.exists() else ()
    elif _cgroup_v2_cpu():
        cpu_parent = acct_parent = CGROUP_V2
        if "cpu" not in (CGROUP_V2 / "cgroup.subtree_control").read_text().split():
            (CGROUP_V2 / "cgroup.subtree_control").write_text("+cpu\n")
        cpu_dirs, acct_dirs = tuple(CGROUP_V2 / n for n in names), ()
    else:
        raise TestbedUnavailable("no cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2)")
    made: list[tuple[Path, Path]] = []
    try:
        for i, share in enumerate(shares):
            quota = round(share * period_us)
            cpu_dirs[i].mkdir()
            made.append((cpu_dirs[i], cpu_parent))
            if v1:
                (cpu_dirs[i] / "cpu.cfs_period_us").write_text(f"{period_us}\n")
                (cpu_dirs[i] / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            else:
                (cpu_dirs[i] / "cpu.max").write_text(f"{quota} {period_us}\n")
            if acct_dirs:
                acct_dirs[i].mkdir()
                made.append((acct_dirs[i], acct_parent))
        yield CpuGroups(shares=tuple(shares), cpu_dirs=cpu_dirs, acct_dirs=acct_dirs)
    finally:
        for group, parent in reversed(made):
            _evacuate_and_remove(group, parent)
