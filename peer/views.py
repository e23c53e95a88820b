"""This peer's state as plain JSON for its faces: the swarm as it sees it (GET /v1/swarm)
and its cache counters (the page's history). Functions of the parts they read, so the
node that owns those parts (peer/node.py) calls them and nothing here knows the node."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from peer.request.request_log import CacheSample
from peer.swarm.gossip import SOFTWARE
from peer.version import is_older

if TYPE_CHECKING:
    from peer.engine.api import EngineView
    from peer.routing.trust import TrustLedger
    from peer.swarm.peer_table import PeerTable


def _no_link(peer_id: str) -> str | None:
    return None


def trust_view(trust: TrustLedger | None, peer_id: str) -> dict[str, Any] | None:
    """What this peer's trust ledger holds about ``peer_id`` (None without a ledger)."""
    if trust is None:
        return None
    t = trust.view(peer_id)
    return {
        "state": t.state.value,
        "reason": t.reason,
        "verified": t.verified,
        "served": t.served,
        "discount": round(t.discount, 4),
        "claims": t.claims.value,
        "debt": round(t.debt, 4),  # reliability debt in failures (peer/routing/reliability.py)
        "lapses": t.lapses,
    }


def swarm_view(
    *,
    now: float,
    engine: Any,
    table: PeerTable,
    peer_id: str,
    addrs: Sequence[str],
    policy: str,
    reachability: str = "unknown",
    invite: str | None = None,
    trust: TrustLedger | None = None,
    holepunch: dict[str, Any] | None = None,
    gossip_counts: dict[str, Any] | None = None,
    link_to: Callable[[str], str | None] = _no_link,
    link_remote: Callable[[str], str | None] = _no_link,
    forward_extra_s: float | None = None,
) -> dict[str, Any]:
    """This peer's view of the swarm, as plain JSON: itself, then every peer in its table.

    `invite` is the string others join with (None while no address is dialable);
    `holepunch` is the hole punch's statistics(); `gossip_counts` is Gossip.gossip_counts()
    (summaries published, and accepted per sender); `link_to` and `link_remote` say how a
    peer is reached ('direct', 'relayed') and the far end of a direct connection;
    `forward_extra_s` what the router adds to a forward's cost for its time here
    (peer/routing/forward_overhead.py), None on a peer that does not route."""
    load = engine.load()
    cache = engine.cache
    peers = []
    for view in table.views(now):
        s = view.summary
        peers.append(
            {
                "peer_id": view.peer_id,
                "addrs": list(view.addrs),
                "rtt_s": view.rtt_s,
                "summary_age_s": round(view.age_s, 3),
                "summary_seq": s.seq,
                "cached_blocks": s.cached_blocks,
                "capacity_blocks": s.capacity_blocks,
                "queued_prompt_tokens": s.queued_prompt_tokens,
                "running_requests": s.running_requests,
                "prefill_tokens_per_s": s.prefill_tokens_per_s,
                "decode_tokens_per_s": s.decode_tokens_per_s,
                "forwards_since_summary": view.forwards_since_summary,
                "trust": trust_view(trust, view.peer_id),
                "link": link_to(view.peer_id),
                "link_remote": link_remote(view.peer_id),
                "software": s.software or None,
                "older_software": is_older(s.software, SOFTWARE),
            }
        )
    return {
        "invite": invite,
        "self": {
            "peer_id": peer_id,
            "addrs": list(addrs),
            "model": engine.model_id,
            "block_size": engine.block_size,
            "cached_blocks": cache.num_blocks,
            "capacity_blocks": cache.capacity_blocks,
            "queued_prompt_tokens": load.queued_prompt_tokens,
            "running_requests": load.running_requests,
            "prefill_tokens_per_s": load.prefill_tokens_per_s,
            "decode_tokens_per_s": load.decode_tokens_per_s,
            "policy": policy,
            "software": SOFTWARE,
            "reachability": reachability,
            "holepunch": holepunch,
            "forward_extra_s": forward_extra_s,
        },
        "peers": sorted(peers, key=lambda p: p["peer_id"]),
        "gossip_counts": gossip_counts,
    }


def peers_report(views: Sequence[Any]) -> dict[str, Any]:
    """`serve --report json`'s peers line: the peers known (a summary of each arrived)
    and those routable (also a measured round trip: what a serving peer's router needs
    before a peer is a candidate)."""
    return {
        "event": "peers",
        "peer_ids": sorted(v.peer_id for v in views),
        "routable": sorted(v.peer_id for v in views if v.rtt_s is not None),
    }


def cache_sample(engine: EngineView, now: float) -> CacheSample:
    generating = engine.generating()  # a cache-only engine counts no prompt tokens
    stats = generating.statistics() if generating is not None else {}
    cache = engine.cache
    return CacheSample(
        now, int(stats.get("prompt_tokens", 0)), int(stats.get("cached_tokens", 0)),
        int(cache.num_blocks), int(cache.capacity_blocks),
    )
