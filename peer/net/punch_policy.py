"""What a hole punch may dial, the pure part: only where the other side was observed.

A hole punch makes this peer send TCP SYNs to addresses the other side names. Named
addresses are claims; an address is dialled only when its IP is one at which the other
side's authenticated connections were observed (by us, or by the relay that carries the
punch, which holds such a connection), at most PORTS_PER_IP ports per IP and
MAX_PUNCH_DIALS in all. LAN ranges (loopback, RFC 1918, link-local, CGNAT, ULA) are
dialled only when that observed IP lies in one of our own interfaces' networks: the
initiator is on our LAN (or host), where its LAN address is where it really is. Punches
are budgeted per authenticated peer id (`PunchBudget`, a bounded token bucket).

No I/O and no clock: time is a parameter; peer/net/punch_service.py is the trio shell.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from peer.net.keyed_budget import KeyedBudget
from peer.net.punch import dialable_tcp

__all__ = [
    "LAN_NETWORKS",
    "MAX_PUNCH_DIALS",
    "PORTS_PER_IP",
    "DialPlan",
    "PunchBudget",
    "is_lan",
    "on_our_lan",
    "plan_dials",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Ranges that reach into a volunteer's own host or home network: dialled for a peer only
# when it was observed on one of our own interfaces' networks (the same LAN).
LAN_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
        "100.64.0.0/10", "0.0.0.0/8", "::1/128", "fe80::/10", "fc00::/7",
    )
)
PORTS_PER_IP = 1  # a NAT that keeps source ports maps the peer's listen port: one per IP
MAX_PUNCH_DIALS = 2  # addresses dialled per punch (e.g. one IPv4 and one IPv6)
BUDGET_BURST = 4  # punches one authenticated peer may have served back to back
BUDGET_REFILL_S = 30.0  # ...then one more per this long (a real upgrade needs one or two)
MAX_BUDGET_KEYS = 1024  # peer ids tracked (least recently used dropped; see PunchBudget)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def is_lan(ip: str) -> bool:
    """Whether `ip` lies in a LAN range (LAN_NETWORKS); an unparsable IP counts as one."""
    addr = _ip(ip)
    return addr is None or any(addr in net for net in LAN_NETWORKS if net.version == addr.version)


def on_our_lan(ip: str, our_networks: Iterable[IPNetwork]) -> bool:
    """Whether a LAN-range `ip` lies in one of our interfaces' networks (127.0.0.0/8 on
    loopback counts: the peer is on this host)."""
    addr = _ip(ip)
    if addr is None or not is_lan(ip):
        return False
    return any(addr in net for net in our_networks if net.version == addr.version)


@dataclass(frozen=True)
class DialPlan:
    """The (ip, port) pairs to dial, in the order named, and why the others were not."""

    targets: tuple[tuple[str, int], ...]
    refused: Counter[str] = field(default_factory=Counter)


def plan_dials(
    claimed: Sequence[str],
    observed_ips: Iterable[str],
    our_networks: Iterable[IPNetwork],
) -> DialPlan:
    """Which of the other side's named addresses (multiaddrs) to dial.

    Dialled: plain TCP addresses whose IP is among `observed_ips`, LAN ones only when
    that IP is on our LAN, at most PORTS_PER_IP per IP and MAX_PUNCH_DIALS in all.
    Refusal reasons: not_dialable, not_observed, lan_not_ours, ports_per_ip, too_many."""
    observed = {str(a) for ip in observed_ips if (a := _ip(ip)) is not None}
    networks = tuple(our_networks)
    targets: list[tuple[str, int]] = []
    ports: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    for addr in claimed:
        target = dialable_tcp(addr)
        if target is None:
            refused["not_dialable"] += 1
        elif target[0] not in observed:
            refused["not_observed"] += 1
        elif is_lan(target[0]) and not on_our_lan(target[0], networks):
            refused["lan_not_ours"] += 1
        elif target in targets:
            continue  # named twice: dialled once
        elif ports[target[0]] >= PORTS_PER_IP:
            refused["ports_per_ip"] += 1
        elif len(targets) >= MAX_PUNCH_DIALS:
            refused["too_many"] += 1
        else:
            ports[target[0]] += 1
            targets.append(target)
    return DialPlan(tuple(targets), refused)


class PunchBudget(KeyedBudget):
    """Punches served per authenticated peer id: a token bucket of BUDGET_BURST, refilled
    one per BUDGET_REFILL_S, MAX_BUDGET_KEYS ids tracked (see KeyedBudget)."""

    def __init__(self, *, burst: int = BUDGET_BURST, refill_s: float = BUDGET_REFILL_S,
                 max_keys: int = MAX_BUDGET_KEYS) -> None:
        super().__init__(burst=burst, refill_s=refill_s, max_keys=max_keys)
