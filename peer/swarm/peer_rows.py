"""What the peer table hands out (peer/swarm/peer_table.py): immutable records of one
peer each, for the shells, the router and the simulator; the table's own constants
(RTT_WINDOW, QUEUE_MEAN_WEIGHT) say how their figures are kept."""

from __future__ import annotations

from typing import NamedTuple

from protocols.summary import CacheSummary

__all__ = ["ForwardCharge", "PeerView", "RoutingRow"]


class PeerView(NamedTuple):
    """A snapshot of one live peer (immutable; taken by `views` / `get`)."""

    peer_id: str
    summary: CacheSummary
    received_at: float  # when the summary was accepted
    age_s: float  # now - received_at
    rtt_s: float | None  # least of the last RTT_WINDOW round trips, None until measured
    forwards_since_summary: int  # requests this peer forwarded there since the summary
    forwarded_prompt_tokens: int  # their prompt tokens
    addrs: tuple[str, ...]  # listen addresses the shell noted, if any
    queue_mean: float  # the peer's reported queues, averaged (QUEUE_MEAN_WEIGHT)


class RoutingRow(NamedTuple):
    """What a routing decision reads about one live peer (built by `routing_rows`)."""

    peer_id: str
    summary: CacheSummary
    rtt_s: float | None  # least of the last RTT_WINDOW round trips, None until measured
    forwards_since_summary: int
    forwarded_prompt_tokens: int
    match_blocks: int  # estimate_match for the chain; 0 without a chain
    summary_age_s: float  # seconds since the summary was accepted
    queue_mean: float  # the peer's reported queues, averaged (QUEUE_MEAN_WEIGHT)


class ForwardCharge(NamedTuple):
    """A forward as `record_forward` counted it: against which summary, and how much."""

    peer_id: str
    summary_seq: int  # given back only while this summary is current: a newer one
    #   reports the peer's load itself, forwards included
    prompt_tokens: int
