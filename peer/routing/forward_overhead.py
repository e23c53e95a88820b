"""What a forward costs its entry beyond the cost model, learned from its own forwards (pure).

The cost model prices a forward's network as ROUND_TRIPS_PER_FORWARD round trips (the
request and its first token; the stream's negotiation travels with the request, so none
is spent opening it before). A real forward also waits on
the entry itself: its work before the request goes out (opening the stream, encoding the
prompt, on a fifth of a core tens of milliseconds) and after the first token is back
(relaying it; for the share of answers verified before delivery, the rest of the answer
and its re-scoring). On a testbed of small CPU peers these came to 50-150 ms a forward,
and `cost` forwarded where serving locally was faster (docs/testbed.md).

`ForwardOverhead` keeps a moving mean of those waits, measured by the entry's own clock on
the forwards it made: the time from an attempt's start to its request being sent, less
the round trips the model counts before the request (none for a lazy stream), plus the
time from the first token's arrival to its delivery. It also keeps, per serving peer, a
moving mean of the wait for that peer's first token beyond the round trip and its
engine's own time to it (the time its signed answer reports): its stream's handling at
both ends, its CPU spent outside its engine (a small share throttled between periods).
The serving engine's time (its queue, its prefill) never counts, so a busy remote peer
(a queue the model misjudged) does not: that is the load estimate's error, not a
forward's; a peer that overstates its engine's time can only take its own part away,
never the entry's. The router adds `extra_for(peer)` to each remote candidate's cost.
It moves with requests, not with a clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from peer.routing.cost import ROUND_TRIPS_PER_FORWARD

OVERHEAD_WEIGHT = 0.05  # each forward's share of the moving mean: about the last 20 count
OVERHEAD_BOUND_S = 2.0  # one forward counts at most this much: a verification that waited
#   on a busy engine, or a GC pause, must not swing the mean by seconds
FORGET_PER_LOCAL = 0.01  # each request served here shrinks the mean by 1%: when forwards
#   stop because they were slow, it halves in ~70 local requests and a forward is tried
#   again, so a figure measured while this peer was overloaded cannot stop routing for good


PEER_WEIGHT = 0.2  # a serving peer's share of its own mean: few forwards go to any one peer
MAX_PEERS = 1024  # serving peers remembered (the least recently forwarded to go first)


class ForwardOverhead:
    """A moving mean of the entry's own time on a forward beyond the modelled round trip,
    and per serving peer, of the wait for its first token beyond the round trip and its
    engine's own time."""

    __slots__ = ("_mean", "_peers", "_seen", "weight")

    def __init__(self, weight: float = OVERHEAD_WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._mean = 0.0
        self._seen = 0
        self._peers: OrderedDict[str, tuple[float, int]] = OrderedDict()  # (mean, seen)

    def forwarded(self, before_sent_s: float, rtt_s: float, after_first_s: float, *,
                  peer_id: str | None = None, first_wait_s: float | None = None,
                  server_ttft_s: float | None = None) -> None:
        """One forward to a peer `rtt_s` away: `before_sent_s` from its attempt's start until
        the request went out, of which the model counts the round trips before the request
        (ROUND_TRIPS_PER_FORWARD less the request's own), and `after_first_s` from its
        first token's arrival until that token was delivered. With the serving `peer_id`,
        `first_wait_s` (from the request sent to its first token's arrival) and the
        serving peer's reported `server_ttft_s` (its engine's time to that token), that
        peer's own mean learns the wait beyond the round trip and that time."""
        for name, value in (("before_sent_s", before_sent_s), ("rtt_s", rtt_s),
                            ("after_first_s", after_first_s)):
            if not value >= 0:  # NaN too
                raise ValueError(f"{name} must be >= 0, got {value}")
        modelled = (ROUND_TRIPS_PER_FORWARD - 1) * rtt_s
        sample = min(max(before_sent_s - modelled + after_first_s, 0.0), OVERHEAD_BOUND_S)
        self._seen += 1
        w = max(self.weight, 1.0 / self._seen)  # a plain mean of the first ones
        self._mean += w * (sample - self._mean)
        wait = unexplained_wait(first_wait_s, rtt_s, server_ttft_s)
        if peer_id is None or wait is None:
            return
        wait = min(max(wait, -OVERHEAD_BOUND_S), OVERHEAD_BOUND_S)
        mean, seen = self._peers.pop(peer_id, (0.0, 0))
        seen += 1
        mean += max(PEER_WEIGHT, 1.0 / seen) * (wait - mean)
        self._peers[peer_id] = (mean, seen)
        if len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)

    def served_here(self) -> None:
        """A request was served by this peer's own engine (FORGET_PER_LOCAL), every mean."""
        self._mean -= FORGET_PER_LOCAL * self._mean
        for peer_id, (mean, seen) in self._peers.items():
            self._peers[peer_id] = (mean - FORGET_PER_LOCAL * mean, seen)

    @property
    def extra_s(self) -> float:
        """Seconds to add to every remote candidate's cost (0 before any forward)."""
        return self._mean

    def extra_for(self, peer_id: str) -> float:
        """Seconds to add to `peer_id`'s cost as a remote candidate: `extra_s` and what
        forwards to it waited beyond their round trip and its engine, on the mean (0 if
        none went, or they came no later than priced)."""
        got = self._peers.get(peer_id)
        return self._mean if got is None or got[0] <= 0.0 else self._mean + got[0]

    def statistics(self) -> dict[str, float]:
        waits = [max(0.0, mean) for mean, _ in self._peers.values()]
        return {"forward_extra_s": round(self._mean, 4), "forward_extra_seen": self._seen,
                "forward_peer_wait_max_s": round(max(waits, default=0.0), 4)}


def unexplained_wait(first_wait_s: float | None, rtt_s: float,
                     server_ttft_s: float | None) -> float | None:
    """The part of a forward's wait for its first token (`first_wait_s`, from the request
    sent) that is neither the round trip the model prices (ROUND_TRIPS_PER_FORWARD of
    `rtt_s`) nor the serving engine's own time to that token (`server_ttft_s`, as the
    serving peer reported it, counted at most as the whole wait). Negative where the
    token came sooner than that (a round trip's jitter): a mean of these is not biased
    up by noise. None where either time is unknown or not a time."""
    if first_wait_s is None or server_ttft_s is None:
        return None
    if not (first_wait_s >= 0 and server_ttft_s >= 0 and math.isfinite(first_wait_s)
            and math.isfinite(server_ttft_s)):
        return None
    return first_wait_s - ROUND_TRIPS_PER_FORWARD * rtt_s - min(server_ttft_s, first_wait_s)
