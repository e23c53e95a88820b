"""What the honest peers' own views say after an attack (bench/adversary.py's rows).

Read over HTTP from each honest peer when a scenario's requests are done: its /v1/swarm
(trust ledger states of the rogue identities, and of each other: a false accusation) and
its /metrics (the gossip gate's verdicts). A peer that does not answer is left out.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import httpx

from peer.processes import PeerProcess

__all__ = ["add_false_accusations", "add_gate_counts", "add_trust_states", "swarm_views"]


async def swarm_views(honest: list[PeerProcess]) -> list[dict[str, Any]]:
    """Each honest peer's /v1/swarm that answered (a peer that did not is left out)."""
    views = []
    async with httpx.AsyncClient(timeout=10) as client:
        for peer in honest:
            try:
                views.append((await client.get(f"{peer.http}/v1/swarm")).json())
            except (httpx.HTTPError, ValueError):
                continue
    return views


async def add_false_accusations(row: dict[str, Any], honest: list[PeerProcess]) -> None:
    """Honest peers that another honest peer's ledger quarantined (/v1/swarm): a verifier
    calling an honest answer a lie. Pairs (accuser, accused), and their reasons."""
    ids = {p.peer_id for p in honest}
    pairs = 0
    reasons: set[str] = set()
    for view in await swarm_views(honest):
        for p in view.get("peers", ()):
            trust = p.get("trust")
            if p["peer_id"] in ids and trust and trust["state"] == "quarantined":
                pairs += 1
                reasons.add(str(trust.get("reason", ""))[:100])
    row["honest_quarantined_by_honest"] = pairs
    row["honest_quarantine_reasons"] = sorted(reasons)


async def add_gate_counts(row: dict[str, Any], honest: list[PeerProcess]) -> None:
    """The honest peers' gossip gate verdicts, summed (/metrics), and how many of them
    graylisted a forwarder."""
    verdicts: Counter[str] = Counter()
    graylisting = 0
    async with httpx.AsyncClient(timeout=10) as client:
        for peer in honest:
            try:
                text = (await client.get(f"{peer.http}/metrics")).text
            except httpx.HTTPError:
                continue
            for verdict, count in re.findall(
                r'^prefixswarm_gossip_gate_total\{verdict="(\w+)"\} (\S+)$', text, re.M
            ):
                verdicts[verdict] += int(float(count))
            graylisted = re.search(r"^prefixswarm_gossip_graylisted (\S+)$", text, re.M)
            graylisting += bool(graylisted and float(graylisted.group(1)) > 0)
    row["honest_gate_verdicts"] = dict(verdicts)
    row["honest_peers_graylisting"] = graylisting


async def add_trust_states(
    row: dict[str, Any], honest: list[PeerProcess], fakes: set[str]
) -> None:
    """What each honest peer's trust ledger says of the rogue identities (/v1/swarm; a
    peer without a ledger says nothing), and requests_until_quarantine from it: the
    forwards all entry peers sent to the liar when at least one ledger quarantined it,
    null when none did."""
    states: Counter[str] = Counter()
    reasons: set[str] = set()
    quarantined_by = verified = lapses = 0
    debt = 0.0
    for view in await swarm_views(honest):
        trusts = [p.get("trust") for p in view.get("peers", ()) if p["peer_id"] in fakes]
        quarantined_by += any(t and t["state"] == "quarantined" for t in trusts)
        for t in filter(None, trusts):
            states[t["state"]] += 1
            verified += int(t.get("verified", 0))
            lapses += int(t.get("lapses", 0))
            debt = max(debt, float(t.get("debt", 0.0)))
            if t["state"] == "quarantined":
                reasons.add(t["reason"][:100])
    row["rogue_trust_states"] = dict(states)
    await add_gate_counts(row, honest)
    # Why a rogue stayed on probation: its matched answers, and lapses charged to it.
    row["rogue_verified_answers"] = verified
    row["rogue_lapses"] = lapses
    row["rogue_debt_max"] = round(debt, 3)
    row["quarantine_reasons"] = sorted(reasons)
    row["quarantined_by_honest_peers"] = quarantined_by
    if "requests_until_quarantine" in row:
        # The forwards all entries sent to the liar, when some ledger quarantined it.
        row["requests_until_quarantine"] = (
            row["attempts_on_rogue_identities"] if quarantined_by else None
        )
