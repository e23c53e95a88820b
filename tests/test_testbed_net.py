"""The testbed's machines. The emulator's forwarding on pipes, in virtual time; then live
(root and /dev/net/tun, else skipped with the reason): two peer namespaces through the
link emulator show RTT = 2 x the one-way delay and the bandwidth cap, CPU groups cap and
count, the zygote's children serve in a namespace and are reached from the client side,
and nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import trio

from bench.testbed import net as testbed  # the module: pytest would collect test*-names
from bench.testbed import probe
from bench.testbed.emulator import CLIENT, Emulator
from bench.testbed.link import UNLIMITED

MISSING = testbed.check_support()
live = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def ipv4(dst_host: int, size: int, subnet: bytes = bytes([10, 97, 0])) -> bytes:
    """A minimal IPv4 packet (only the fields the emulator reads are real)."""
    return bytes([0x45]) + bytes(15) + subnet + bytes([dst_host]) + bytes(size - 20)


def readable(fd: int) -> list[bytes]:
    packets = []
    while True:
        try:
            packets.append(os.read(fd, 65536))
        except BlockingIOError:
            return packets


@pytest.fixture
def devices():
    """Three pipes standing for peer 0's, peer 1's and the client's TUN device."""
    pipes = [os.pipe() for _ in range(3)]
    for r, _ in pipes:
        os.set_blocking(r, False)
    yield pipes
    for r, w in pipes:
        os.close(r)
        os.close(w)


async def test_peer_packets_wait_serialisation_and_delay_client_packets_do_not(
        devices, autojump_clock):
    (r0, w0), (r1, w1), (rc, wc) = devices
    emulator = Emulator("10.97.0", [w0, w1], wc, delay_s=0.02, bandwidth_bps=8000)  # 1 kB/s
    async with trio.open_nursery() as nursery:
        nursery.start_soon(emulator.deliver)
        first, second = ipv4(2, 1000), ipv4(2, 500)
        emulator.route(0, first, trio.current_time())
        emulator.route(0, second, trio.current_time())
        emulator.route(1, ipv4(254, 60), trio.current_time())  # peer 1 -> client
        emulator.route(CLIENT, ipv4(1, 60), trio.current_time())  # client -> peer 0
        emulator.route(0, bytes([0x60]) + bytes(59), trio.current_time())  # IPv6: ignored
        assert readable(rc) == [ipv4(254, 60)] and readable(r0) == [ipv4(1, 60)]
        await trio.sleep(1.019)  # 1000 bytes at 1 kB/s, then 20 ms (0.5 ms early at most)
        assert readable(r1) == []
        await trio.sleep(0.001)
        assert readable(r1) == [first]
        await trio.sleep(0.5)
        assert readable(r1) == [second]
        stats = emulator.stats()
        assert stats["per_link"]["0->1"] == {"packets": 2, "bytes": 1500, "dropped": 0}
        assert stats["ignored"] == 1 and stats["queued"] == 0
        nursery.cancel_scope.cancel()


def test_control_sets_every_link_and_refuses_nonsense(devices):
    (_, w0), (_, w1), (_, wc) = devices
    emulator = Emulator("10.97.0", [w0, w1], wc, delay_s=0.0, bandwidth_bps=UNLIMITED)
    assert emulator.control('{"op": "set", "delay_ms": 50, "bandwidth_mbit": null}') == {
        "ok": True}
    assert emulator.control('{"op": "set", "delay_ms": -1, "bandwidth_mbit": 20}')["error"]
    assert emulator.control('{"op": "fly"}')["error"]
    assert emulator.control("not json")["error"]
    emulator.route(1, ipv4(1, 100), 0.0)
    assert emulator.stats()["queued"] == 1  # 50 ms from now


def test_check_support_says_root_is_needed(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert testbed.check_support() == (
        "the testbed needs root (network namespaces, TUN devices, cgroups)")
ROOT = Path(__file__).resolve().parent.parent


def tag(name: str) -> str:
    return f"{name}{os.getpid() % 10000}"


def leftovers(t: str) -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                check=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                           check=True).stdout
    return [line for line in (namespaces + links).splitlines() if f"pst{t}" in line]


@live
@pytest.mark.serial  # real-time bounds: the other worker's load would stretch them
def test_rtt_is_twice_the_delay_and_bulk_transfer_meets_the_cap():
    t = tag("rt")
    with testbed.testbed_network(peers=2, tag=t) as net:
        a, b = net.namespaces
        for delay_ms in (20, 50):
            net.set_link(delay_ms / 1e3, 20e6)
            rtt = probe.ping_pong_rtt_s(b, net.peer_ips[1], a, rounds=15)
            assert rtt["median_s"] == pytest.approx(2 * delay_ms / 1e3, rel=0.10)
        client = probe.ping_pong_rtt_s(b, net.peer_ips[1], None, rounds=15)
        assert client["median_s"] < 0.01  # client <-> peer crosses no emulated link
        net.set_link(0.0, 20e6)
        before = net.stats()["per_link"].get("0->1", {}).get("bytes", 0)
        payload, span = probe.bulk_transfer(b, net.peer_ips[1], a, seconds=2.0)
        link_bytes = net.stats()["per_link"]["0->1"]["bytes"] - before
        assert link_bytes * 8 / span == pytest.approx(20e6, rel=0.10)
        assert payload * 8 / span < 20e6 * 1.01
    assert leftovers(t) == []


@live
def test_teardown_removes_everything_also_after_an_error():
    t = tag("td")
    with pytest.raises(RuntimeError, match="inside"), \
            testbed.testbed_network(peers=3, tag=t) as net:
        assert len(leftovers(t)) == 4  # 3 namespaces and the client's device
        assert net.stats()["packets"] == 0
        raise RuntimeError("inside")
    assert leftovers(t) == []


@live
def test_set_link_refuses_a_negative_delay():
    with testbed.testbed_network(peers=2, tag=tag("sl")) as net, pytest.raises(ValueError):
        net.set_link(-0.01, 20e6)


@live
def test_cpu_groups_cap_a_busy_process_and_count_its_time():
    t = tag("cg")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with testbed.cpu_groups([0.2], t) as groups:
            groups.join(0, busy.pid)
            start = groups.usage_s(0)
            time.sleep(2.0)
            used = groups.usage_s(0) - start
            assert 0.05 < used < 0.2 * 2.0 * 1.3  # capped at 0.2 of a core
            paths = (*groups.cpu_dirs, *groups.acct_dirs)
        assert not any(p.exists() for p in paths)
    finally:
        busy.kill()
        busy.wait()


@live
def test_cpu_groups_write_the_period_asked_for_and_refuse_a_quota_below_the_kernels():
    t = tag("cp")
    with testbed.cpu_groups([0.2, 0.5], t, period_us=10_000) as groups:
        for group, quota in zip(groups.cpu_dirs, (2_000, 5_000), strict=True):
            if (group / "cpu.cfs_quota_us").exists():  # v1
                assert int((group / "cpu.cfs_period_us").read_text()) == 10_000
                assert int((group / "cpu.cfs_quota_us").read_text()) == quota
            else:
                assert (group / "cpu.max").read_text().split() == [str(quota), "10000"]
    with pytest.raises(ValueError, match="least quota"), testbed.cpu_groups([0.05], t, 10_000):
        pass


@live
@pytest.mark.slow  # the zygote's imports and a model load: tens of seconds
def test_zygote_child_serves_in_its_namespace_and_drains_on_sigterm(tmp_path):
    with testbed.testbed_network(peers=1, tag=tag("zy")) as net:
        ip = net.peer_ips[0]
        zygote = subprocess.Popen([sys.executable, "-m", "bench.testbed.zygote"], cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert zygote.stdin is not None and zygote.stdout is not None
        try:
            assert json.loads(zygote.stdout.readline())["ready"]
            argv = ["serve", "--model", "tiny-random", "--listen", f"/ip4/{ip}/tcp/4101",
                    "--http", f"{ip}:8101", "--report", "json", "--insecure-no-api-key",
                    "--identity", "none"]
            out = tmp_path / "peer.out"
            zygote.stdin.write(json.dumps({"op": "spawn", "argv": argv, "stdout": str(out),
                                           "stderr": str(tmp_path / "peer.err"),
                                           "netns": net.namespaces[0]}) + "\n")
            zygote.stdin.flush()
            pid = json.loads(zygote.stdout.readline())["pid"]
            deadline = time.monotonic() + 120
            while '"event":"up"' not in (out.read_text() if out.exists() else ""):
                assert time.monotonic() < deadline, (tmp_path / "peer.err").read_text()
                time.sleep(0.2)
            with urllib.request.urlopen(f"http://{ip}:8101/health", timeout=10) as reply:
                assert json.loads(reply.read())["status"] == "ok"
            os.kill(pid, 15)
            exited: list[dict[str, int]] = []
            while not exited:
                assert time.monotonic() < deadline + 30
                zygote.stdin.write('{"op": "reap"}\n')
                zygote.stdin.flush()
                exited = json.loads(zygote.stdout.readline())["exited"]
                time.sleep(0.1)
            assert exited == [{"pid": pid, "code": 0}]
            assert json.loads(out.read_text().splitlines()[-1])["event"] == "down"  # drained
        finally:
            zygote.stdin.close()
            zygote.wait(timeout=30)
