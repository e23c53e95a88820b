"""What the surface rogues (punch_scanner, reachability_liar) did to the honest peers, as
the honest peers themselves report it: their /v1/swarm "self" (reachability verdict,
advertised addresses, hole-punch counters), sampled every SAMPLE_INTERVAL_S while the
requests run, next to what the rogue counted from its side (`answered`).

Targets: punch_scanner: holepunch_dials_to_unobserved summed over the honest peers is 0,
and the rogue's listeners (the addresses it named) accepted 0 connections;
reachability_liar: each honest peer's verdicts while under attack are the baseline's,
it never advertises the liar's address, and it keeps its relayed addresses.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from bench.rogues.reachability_liar import LIE_IP

SURFACE_SCENARIOS = frozenset({"baseline", "punch_scanner", "reachability_liar"})
SAMPLE_INTERVAL_S = 1.0
# Before the requests, the attack must have reached every honest peer: this many of the
# rogue's actions (a Connect per peer and claim each round; a lie per honest peer's
# check, every 5 s while its verdict is unknown), or ATTACK_WAIT_S.
ATTACK_SEEN = {"punch_scanner": ("punch_connects_sent", 24),
               "reachability_liar": ("dialback_lies", 6)}
ATTACK_WAIT_S = 60.0


@dataclass
class SurfaceWatch:
    """Samples of each honest peer's own account of itself."""

    verdicts: dict[str, Counter[str]] = field(default_factory=dict)
    lie_advertised: Counter[str] = field(default_factory=Counter)
    relayed_addrs: dict[str, list[int]] = field(default_factory=dict)
    holepunch: dict[str, dict[str, Any]] = field(default_factory=dict)  # the last sample
    samples: int = 0
    attack_wait_s: float = 0.0  # waited for the attack to reach the peers before requests

    def add(self, peer_id: str, me: dict[str, Any]) -> None:
        self.verdicts.setdefault(peer_id, Counter())[str(me.get("reachability"))] += 1
        addrs = [str(a) for a in me.get("addrs") or ()]
        self.lie_advertised[peer_id] += any(f"/{LIE_IP}/" in a for a in addrs)
        self.relayed_addrs.setdefault(peer_id, []).append(
            sum("/p2p-circuit" in a for a in addrs)
        )
        self.holepunch[peer_id] = me.get("holepunch") or {}

    def row(self, name: str, answered: dict[str, int] | None) -> dict[str, Any]:
        answered = answered or {}
        counters: Counter[str] = Counter()
        for stats in self.holepunch.values():
            counters.update({k: v for k, v in stats.items()
                             if k.startswith("holepunch_") and isinstance(v, int)})
        row: dict[str, Any] = {
            "surface_samples": self.samples,
            "attack_wait_s": self.attack_wait_s,
            "reachability_seen": {p[-6:]: dict(c) for p, c in self.verdicts.items()},
        }
        if name in ("baseline", "punch_scanner"):
            row["punch_dials_to_unobserved"] = counters["holepunch_dials_to_unobserved"]
            row["punch_dials_to_observed"] = counters["holepunch_dials_to_observed"]
            row["punch_refused"] = {k.removeprefix("holepunch_"): v for k, v in counters.items()
                                    if "refused" in k}
        if name == "punch_scanner":
            for key in ("punch_connects_sent", "punch_relayed_streams", "scan_connections",
                        "scan_ports_hit"):
                row[key] = answered.get(key, 0)
        if name in ("baseline", "reachability_liar"):
            row["liar_address_advertised_samples"] = sum(self.lie_advertised.values())
            row["relayed_addrs_min_max"] = {
                p[-6:]: [min(v), max(v)] for p, v in self.relayed_addrs.items() if v
            }
        if name == "reachability_liar":
            row["dialback_lies_told"] = answered.get("dialback_lies", 0)
        return row


@contextlib.asynccontextmanager
async def watch_surface(
    name: str, honest: Sequence[Any], rogue: Any
) -> AsyncIterator[SurfaceWatch]:
    """Sample every honest peer's /v1/swarm "self" while the block runs (only for the
    scenarios above: polling costs the others nothing), once the rogue's attack reached
    the honest peers (ATTACK_SEEN)."""
    watch = SurfaceWatch()
    if name not in SURFACE_SCENARIOS:
        yield watch
        return

    async def sample_forever(client: httpx.AsyncClient) -> None:
        while True:
            for peer in honest:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    me = (await client.get(f"{peer.http}/v1/swarm")).json()["self"]
                    watch.add(peer.peer_id, me)
            watch.samples += 1
            await trio.sleep(SAMPLE_INTERVAL_S)

    async with httpx.AsyncClient(timeout=10) as client, trio.open_nursery() as nursery:
        nursery.start_soon(sample_forever, client)
        if name in ATTACK_SEEN and rogue is not None:
            key, wanted = ATTACK_SEEN[name]
            started = trio.current_time()
            with trio.move_on_after(ATTACK_WAIT_S):
                while rogue.answered.get(key, 0) < wanted:
                    await trio.sleep(0.2)
            watch.attack_wait_s = round(trio.current_time() - started, 1)
        yield watch
        nursery.cancel_scope.cancel()
