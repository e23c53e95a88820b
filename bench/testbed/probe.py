"""Measurements of the link emulator: TCP round trips and a bulk transfer between two peer
namespaces, and the emulator's CPU per packet. `python -m bench.testbed.emulator --selftest`
prints them as JSON; tests/test_testbed_net.py asserts them.

Sockets are opened inside a namespace by switching this thread into it (setns) for the
socket() call only: a socket stays in the namespace it was created in.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

CLONE_NEWNET = 0x40000000
PING_BYTES = 64
PORT = 5201


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


@contextlib.contextmanager
def in_netns(name: str | None) -> Iterator[None]:
    """This thread inside network namespace `name` (None: stay) for the block."""
    if name is None:
        yield
        return
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


def tcp_socket(netns: str | None) -> socket.socket:
    with in_netns(netns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed early")
        data += chunk
    return data


def _serve_one(listener: socket.socket, mode: str, result: dict[str, Any]) -> None:
    """Accept one connection: echo PING_BYTES messages ("echo") or count bytes ("sink")."""
    with listener:
        conn, _ = listener.accept()
    with conn:
        if mode == "echo":
            while True:
                try:
                    conn.sendall(_recv_exactly(conn, PING_BYTES))
                except ConnectionError:
                    return
        received, first, last = 0, None, None
        while chunk := conn.recv(1 << 16):
            now = time.perf_counter()
            first = now if first is None else first
            received += len(chunk)
            last = now
        result.update(bytes=received, first=first, last=last)


def _pair(server_ns: str | None, server_ip: str, client_ns: str | None, mode: str,
          ) -> tuple[socket.socket, threading.Thread, dict[str, Any]]:
    listener = tcp_socket(server_ns)
    listener.bind((server_ip, PORT))
    listener.listen(1)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=_serve_one, args=(listener, mode, result), daemon=True)
    thread.start()
    client = tcp_socket(client_ns)
    client.settimeout(10)
    client.connect((server_ip, PORT))
    return client, thread, result


def ping_pong_rtt_s(server_ns: str | None, server_ip: str, client_ns: str | None,
                    rounds: int) -> dict[str, float]:
    """Median and min of `rounds` TCP round trips of PING_BYTES (after the handshake)."""
    client, thread, _ = _pair(server_ns, server_ip, client_ns, "echo")
    samples = []
    with client:
        for _ in range(rounds):
            started = time.perf_counter()
            client.sendall(b"x" * PING_BYTES)
            _recv_exactly(client, PING_BYTES)
            samples.append(time.perf_counter() - started)
    thread.join(5)
    return {"median_s": statistics.median(samples), "min_s": min(samples)}


def bulk_transfer(server_ns: str, server_ip: str, client_ns: str, seconds: float,
                  ) -> tuple[int, float]:
    """The TCP payload bytes received while the client sends for `seconds`, and the time
    from the first to the last byte."""
    client, thread, result = _pair(server_ns, server_ip, client_ns, "sink")
    block = b"\0" * (1 << 16)
    deadline = time.perf_counter() + seconds
    with client:
        while time.perf_counter() < deadline:
            client.sendall(block)
    thread.join(30)
    return int(result["bytes"]), float(result["last"] - result["first"])


def selftest(quick: bool = False, delays_ms: tuple[float, ...] = (0, 20, 50),
             bandwidth_mbit: float = 20.0) -> dict[str, Any]:
    """RTT at each delay, goodput at the cap and the emulator's CPU per packet (JSON)."""
    from bench.testbed.net import testbed_network

    rounds = 10 if quick else 30
    seconds = 2.0 if quick else 5.0
    tag = f"st{os.getpid() % 100000}"
    out: dict[str, Any] = {"bandwidth_mbit": bandwidth_mbit, "rtt": [], "load": os.getloadavg()}
    with testbed_network(peers=2, tag=tag) as net:
        a, b = net.namespaces
        ip_b = net.peer_ips[1]
        base = ping_pong_rtt_s(b, "127.0.0.1", b, rounds)  # the kernel's own, no emulator
        out["loopback_rtt_ms"] = round(base["median_s"] * 1e3, 3)
        for delay_ms in delays_ms:
            net.set_link(delay_ms / 1e3, bandwidth_mbit * 1e6)
            rtt = ping_pong_rtt_s(b, ip_b, a, rounds)
            stats = net.stats()
            out["rtt"].append({
                "delay_ms": delay_ms, "expected_ms": 2 * delay_ms,
                "median_ms": round(rtt["median_s"] * 1e3, 3),
                "min_ms": round(rtt["min_s"] * 1e3, 3),
                "emulator_late_mean_ms": stats["late_mean_ms"],
                "emulator_late_max_ms": stats["late_max_ms"],
            })
        client = ping_pong_rtt_s(b, ip_b, None, rounds)  # client <-> peer: no link delay
        out["client_rtt_ms"] = round(client["median_s"] * 1e3, 3)
        net.set_link(0.0, bandwidth_mbit * 1e6)
        before = net.stats()
        payload, span = bulk_transfer(b, ip_b, a, seconds)
        after = net.stats()
        link_bytes = (after["per_link"]["0->1"]["bytes"]
                      - before["per_link"].get("0->1", {}).get("bytes", 0))
        packets = after["packets"] - before["packets"]
        out["bulk"] = {
            "seconds": round(span, 3), "goodput_mbit": round(payload * 8 / span / 1e6, 3),
            "link_mbit": round(link_bytes * 8 / span / 1e6, 3),  # IP packets, headers and all
            "dropped": after["dropped"] - before["dropped"], "packets": packets,
            "emulator_cpu_s": round(after["cpu_s"] - before["cpu_s"], 3),
            "emulator_cpu_us_per_packet": round(
                (after["cpu_s"] - before["cpu_s"]) / max(packets, 1) * 1e6, 1),
        }
    return out
