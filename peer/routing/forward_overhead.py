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
time from the first token's arrival to its delivery. Only the entry's side is measured,
so a busy remote peer (a queue the model misjudged) does not count: that is the load
estimate's error, not a forward's. The router adds `extra_s` to every remote candidate's
cost. It moves with requests, not with a clock.
"""

from __future__ import annotations

from peer.routing.cost import ROUND_TRIPS_PER_FORWARD

OVERHEAD_WEIGHT = 0.05  # each forward's share of the moving mean: about the last 20 count
OVERHEAD_BOUND_S = 2.0  # one forward counts at most this much: a verification that waited
#   on a busy engine, or a GC pause, must not swing the mean by seconds
FORGET_PER_LOCAL = 0.01  # each request served here shrinks the mean by 1%: when forwards
#   stop because they were slow, it halves in ~70 local requests and a forward is tried
#   again, so a figure measured while this peer was overloaded cannot stop routing for good


class ForwardOverhead:
    """A moving mean of the entry's own time on a forward beyond the modelled round trip."""

    __slots__ = ("_mean", "_seen", "weight")

    def __init__(self, weight: float = OVERHEAD_WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._mean = 0.0
        self._seen = 0

    def forwarded(self, before_sent_s: float, rtt_s: float, after_first_s: float) -> None:
        """One forward to a peer `rtt_s` away: `before_sent_s` from its attempt's start until
        the request went out, of which the model counts the round trips before the request
        (ROUND_TRIPS_PER_FORWARD less the request's own), and `after_first_s` from its
        first token's arrival until that token was delivered."""
        for name, value in (("before_sent_s", before_sent_s), ("rtt_s", rtt_s),
                            ("after_first_s", after_first_s)):
            if not value >= 0:  # NaN too
                raise ValueError(f"{name} must be >= 0, got {value}")
        modelled = (ROUND_TRIPS_PER_FORWARD - 1) * rtt_s
        sample = before_sent_s - modelled + after_first_s
        sample = min(max(sample, 0.0), OVERHEAD_BOUND_S)
        self._seen += 1
        w = max(self.weight, 1.0 / self._seen)  # a plain mean of the first ones
        self._mean += w * (sample - self._mean)

    def served_here(self) -> None:
        """A request was served by this peer's own engine (FORGET_PER_LOCAL)."""
        self._mean -= FORGET_PER_LOCAL * self._mean

    @property
    def extra_s(self) -> float:
        """Seconds to add to a remote candidate's cost (0 before any forward)."""
        return self._mean

    def statistics(self) -> dict[str, float]:
        return {"forward_extra_s": round(self._mean, 4), "forward_extra_seen": self._seen}
