"""A real NAT on one machine: network namespaces, veth pairs and an iptables masquerade.

    with home_behind_nat(tag) as net:
        Nat.run_in(net.public[0], [...])   # argv for a process on public host 0
        net.public_ips, net.home_ip, net.home2_ip

Topology (every address lives only inside the namespaces built here; 198.18.0.0/15 is the
benchmarking range, 10.77.0.0/24 and 10.78.0.0/24 two private home networks):

    [psr-a-T] 198.18.0.1 --+
    [psr-b-T] 198.18.0.3 --+-- bridge in [psr-sw-T] --+-- 198.18.0.2 [psr-rtr-T] 10.77.0.1
                                                      |                 |
                                                      |  10.77.0.2 [psr-home-T] (a volunteer)
                                                      |
                                                      +-- 198.18.0.4 [psr-rtr2-T] 10.78.0.1
                                                                        |
                                                 10.78.0.2 [psr-home2-T] (another volunteer)

Each router masquerades its home network onto the public segment, forwards only replies
inbound (conntrack ESTABLISHED,RELATED) and drops unsolicited TCP addressed to itself, as
a home router without port forwarding does: nobody on the public segment can open a
connection to a home peer. Masquerade keeps a connection's source port when it is free,
so a home peer that dials out from its listen port is seen at <router>:<listen port>
(what a hole punch relies on).
Needs root and iptables; `NetnsUnavailable` says why when the machine cannot do it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

PUBLIC_IPS = ("198.18.0.1", "198.18.0.3")
ROUTER_PUBLIC_IP = "198.18.0.2"
ROUTER_HOME_IP = "10.77.0.1"
HOME_IP = "10.77.0.2"
ROUTER2_PUBLIC_IP = "198.18.0.4"
ROUTER2_HOME_IP = "10.78.0.1"
HOME2_IP = "10.78.0.2"


class NetnsUnavailable(Exception):
    """This machine cannot build the namespaces (not root, no `ip`/`iptables`, ...)."""


@dataclass(frozen=True)
class Nat:
    public: tuple[str, ...]  # one namespace per public host, in PUBLIC_IPS order
    switch: str
    router: str
    home: str
    router2: str
    home2: str
    public_ips: tuple[str, ...] = PUBLIC_IPS
    home_ip: str = HOME_IP
    router_public_ip: str = ROUTER_PUBLIC_IP
    home2_ip: str = HOME2_IP
    router2_public_ip: str = ROUTER2_PUBLIC_IP

    @staticmethod
    def run_in(namespace: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", namespace, *argv]


def _sh(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def check_netns_possible() -> None:
    """Raise NetnsUnavailable with the reason when namespaces cannot be built here."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("building network namespaces needs root")
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"`{tool}` is missing (apt-get install -y iproute2 iptables)")


def _veth(ns: str, switch: str, port: str, ip: str) -> None:
    """A veth from `ns` (eth0 there, address `ip`/24) to the bridge in `switch`."""
    tmp = f"{port}x"
    _sh("ip", "link", "add", tmp, "netns", ns, "type", "veth", "peer", "name", port,
        "netns", switch)
    _sh("ip", "-n", ns, "link", "set", tmp, "name", "eth0")
    _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
    _sh("ip", "-n", ns, "link", "set", "eth0", "up")
    _sh("ip", "-n", switch, "link", "set", port, "master", "br0")
    _sh("ip", "-n", switch, "link", "set", port, "up")


def _home_router(router: str, switch: str, port: str, public_ip: str, home: str,
                 router_home_ip: str, home_ip: str) -> None:
    """A masquerading router: wan0 on the bridge at `public_ip`, lan0 to `home`."""
    _veth(router, switch, port, public_ip)
    _sh("ip", "-n", router, "link", "set", "eth0", "name", "wan0")
    _sh("ip", "link", "add", "lan0x", "netns", home, "type", "veth",
        "peer", "name", "lan0", "netns", router)
    _sh("ip", "-n", home, "link", "set", "lan0x", "name", "eth0")
    _sh("ip", "-n", home, "addr", "add", f"{home_ip}/24", "dev", "eth0")
    _sh("ip", "-n", home, "link", "set", "eth0", "up")
    _sh("ip", "-n", home, "route", "add", "default", "via", router_home_ip)
    _sh("ip", "-n", router, "addr", "add", f"{router_home_ip}/24", "dev", "lan0")
    _sh("ip", "-n", router, "link", "set", "lan0", "up")
    # the NAT: masquerade home -> public, forward only replies back in
    r = ["ip", "netns", "exec", router]
    _sh(*r, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
    _sh(*r, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE")
    _sh(*r, "iptables", "-P", "FORWARD", "DROP")
    _sh(*r, "iptables", "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT")
    _sh(*r, "iptables", "-A", "FORWARD", "-i", "wan0", "-o", "lan0", "-m", "conntrack",
        "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
    # unsolicited TCP to the router itself is dropped, not answered with a reset: a SYN
    # that arrives before the home peer's own SYN left is then resent, not refused
    _sh(*r, "iptables", "-A", "INPUT", "-i", "wan0", "-p", "tcp", "-m", "conntrack",
        "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
    _sh(*r, "iptables", "-A", "INPUT", "-i", "wan0", "-p", "tcp", "-j", "DROP")


@contextmanager
def home_behind_nat(tag: str) -> Iterator[Nat]:
    """Build the topology above; everything is deleted on exit, also after a failure."""
    check_netns_possible()
    nat = Nat(
        public=tuple(f"psr-{c}-{tag}" for c in "ab"),
        switch=f"psr-sw-{tag}",
        router=f"psr-rtr-{tag}",
        home=f"psr-home-{tag}",
        router2=f"psr-rtr2-{tag}",
        home2=f"psr-home2-{tag}",
    )
    namespaces = (*nat.public, nat.switch, nat.router, nat.home, nat.router2, nat.home2)
    try:
        for ns in namespaces:
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", nat.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", nat.switch, "link", "set", "br0", "up")
        for i, (ns, ip) in enumerate(zip(nat.public, PUBLIC_IPS, strict=True)):
            _veth(ns, nat.switch, f"pub{i}", ip)
        _home_router(nat.router, nat.switch, "rtr", ROUTER_PUBLIC_IP, nat.home, ROUTER_HOME_IP,
                     HOME_IP)
        _home_router(nat.router2, nat.switch, "rtr2", ROUTER2_PUBLIC_IP, nat.home2,
                     ROUTER2_HOME_IP, HOME2_IP)
        yield nat
    finally:
        for ns in reversed(namespaces):  # deleting a namespace deletes its veths
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
