"""This peer's state as plain JSON for its faces: the swarm as it sees it (GET /v1/swarm)
and its cache counters (the page's history). Read-only views of a running `Peer`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from peer.request.request_log import CacheSample

if TYPE_CHECKING:
    from peer.engine.api import EngineView
    from peer.node import Peer
    from peer.routing.trust import TrustLedger


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
    }


def swarm_view(peer: Peer) -> dict[str, Any]:
    """This peer's view of the swarm, as plain JSON: itself, then every peer in its table."""
    now = trio.current_time()
    engine = peer.engine
    load = engine.load()
    cache = engine.cache
    peers = []
    serving = getattr(peer, "serving", None)
    trust = serving.trust if serving is not None else None
    holepunch = getattr(getattr(peer, "host", None), "holepunch", None)
    for view in peer.table.views(now):
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
                "link": peer.link_to(view.peer_id) if hasattr(peer, "link_to") else None,
                "link_remote": (
                    peer.link_remote(view.peer_id) if hasattr(peer, "link_remote") else None
                ),
            }
        )
    return {
        "self": {
            "peer_id": peer.peer_id,
            "addrs": list(peer.multiaddrs),
            "model": engine.model_id,
            "block_size": engine.block_size,
            "cached_blocks": cache.num_blocks,
            "capacity_blocks": cache.capacity_blocks,
            "queued_prompt_tokens": load.queued_prompt_tokens,
            "running_requests": load.running_requests,
            "prefill_tokens_per_s": load.prefill_tokens_per_s,
            "decode_tokens_per_s": load.decode_tokens_per_s,
            "policy": peer.config.policy.value,
            "reachability": getattr(peer, "reachability", "unknown"),
            "holepunch": None if holepunch is None else holepunch.statistics(),
        },
        "peers": sorted(peers, key=lambda p: p["peer_id"]),
    }


def cache_sample(engine: EngineView, now: float) -> CacheSample:
    generating = engine.generating()  # a cache-only engine counts no prompt tokens
    stats = generating.statistics() if generating is not None else {}
    cache = engine.cache
    return CacheSample(
        now, int(stats.get("prompt_tokens", 0)), int(stats.get("cached_tokens", 0)),
        int(cache.num_blocks), int(cache.capacity_blocks),
    )
