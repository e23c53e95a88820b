"""One testbed run: a fresh swarm of a policy (bench/testbed/beds.py), the workload
replayed open loop (each request at its arrival time, to a seeded random entry peer),
every streamed completion timed at the client, and the measured half of a row.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.stats import percentile
from bench.swarm import Outcome, completion_body, stream_completion
from bench.testbed.beds import (
    MAX_IN_FLIGHT,
    REQUEST_TIMEOUT_S,
    Bed,
    SwarmPeer,
)
from bench.testbed.routes import UNKNOWN_SERVER, Routed, by_entry
from bench.testbed.workload import entry_peers
from bench.workloads import TokenRequest

T = TypeVar("T")


@dataclass
class Timed(Outcome):
    arrival_s: float = 0.0
    index: int = 0
    # the entry's own TTFT (admission to first token, x_prefixswarm's ttft_s): the
    # client's TTFT less this is the path outside the entry (HTTP, links to the client)
    entry_ttft_s: float = math.nan


@dataclass
class RunMeasurement:
    """What one policy run measured (before predictions are added)."""

    outcomes: list[Timed]
    wall_s: float
    utilization: list[float]
    gossip: GossipDelivery | None
    setup_s: float
    up_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    peer_ids: tuple[str, ...] = ()  # in the bed's order (utilization's too)
    events: dict[str, float] = field(default_factory=dict)  # pipeline events, all peers
    trusted_pair_fraction: float | None = None
    forward_extra_s: list[float | None] = field(default_factory=list)  # bed order
    # each peer's own advertised (prefill, decode) tokens/s at the end (bed order): what
    # the routers priced it at, next to what the calibration measured
    advertised: list[tuple[float, float] | None] = field(default_factory=list)
    # each peer's recent requests as its page lists them (GET /v1/requests `recent`: the
    # router's reason for every candidate tried), read at the end; None where it failed
    request_logs: list[list[dict[str, Any]] | None] = field(default_factory=list)


async def _send(client: httpx.AsyncClient, peer: SwarmPeer, request: TokenRequest,
                model: str, index: int) -> Timed:
    url = peer.http or ""
    got = await stream_completion(client, url, completion_body(request, model),
                                  REQUEST_TIMEOUT_S)
    if got.error or got.first is None:
        return Timed(False, peer.peer_id, error=got.error, arrival_s=request.arrival_s,
                     index=index)
    served_by = got.extension.get("served_by", "")
    return Timed(
        True, peer.peer_id, served_by=served_by, ttft_s=got.first - got.start,
        e2e_s=got.end - got.start, prompt_tokens=got.usage["prompt_tokens"],
        cached_tokens=got.usage["prompt_tokens_details"]["cached_tokens"],
        forwarded=served_by != peer.peer_id, arrival_s=request.arrival_s, index=index,
        entry_ttft_s=_seconds(got.extension.get("ttft_s")),
        route=list(got.extension.get("route", ())),
    )


def _seconds(value: Any) -> float:
    """A duration a peer reported, or NaN where it sent none or not a number."""
    return float(value) if isinstance(value, int | float) and value >= 0 else math.nan


@dataclass(frozen=True)
class GossipDelivery:
    """Summaries delivered among the peers of a run (full gossip), from each peer's
    /v1/swarm `gossip_counts` (peer/swarm/delivery_counts.py). A (receiver, sender) pair
    expects the sender's summaries up to the newest one the receiver applied; the newer
    ones are on their way when the counts are read (`in_flight`), not lost."""

    delivered_fraction: float  # arrived (applied or late) over expected
    late_fraction: float  # arrived after a newer one, over expected
    in_flight_max: int  # the most summaries of one sender newer than a receiver's newest


def gossip_delivery(views: Sequence[dict[str, Any] | None],
                    peer_ids: Sequence[str]) -> GossipDelivery | None:
    """GossipDelivery of one run's views (bed order); None when any peer does not
    report its counts or nothing was published."""
    counts = [v.get("gossip_counts") if v else None for v in views]
    if len(peer_ids) < 2 or any(not isinstance(c, dict) or c.get("first_seq") is None
                                for c in counts):
        return None
    expected = arrived = late = 0
    in_flight_max = 0
    for sender, sent in zip(peer_ids, counts, strict=True):
        assert sent is not None
        first, last_sent = int(sent["first_seq"]), int(sent["seq"])
        failures = int(sent.get("publish_failures", 0))
        for receiver, got in zip(peer_ids, counts, strict=True):
            if receiver == sender or got is None:
                continue
            came = int(got["accepted"].get(sender, 0))
            out_of_order = int(got.get("late", {}).get(sender, 0))
            newest = got.get("last_seq", {}).get(sender)
            upto = last_sent if newest is None else int(newest)
            expected += max(came + out_of_order, upto - first + 1 - failures)
            arrived += came + out_of_order
            late += out_of_order
            in_flight_max = max(in_flight_max, last_sent - upto)
    if expected == 0:
        return None
    return GossipDelivery(arrived / expected, late / expected, in_flight_max)


async def _ask_each(client: httpx.AsyncClient, peers: Sequence[SwarmPeer], path: str,
                    read: Callable[[httpx.Response], T]) -> list[T | None]:
    """GET `path` of every peer at once: `read` of each answer in bed order, None where
    asking fails or the answer does not read."""
    out: list[T | None] = [None] * len(peers)

    async def one(i: int, p: SwarmPeer) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            out[i] = read(await client.get(f"{p.http}{path}", timeout=10.0))

    async with trio.open_nursery() as nursery:
        for i, p in enumerate(peers):
            nursery.start_soon(one, i, p)
    return out


def _recent(answer: httpx.Response) -> list[dict[str, Any]]:
    """A peer's recent requests from its GET /v1/requests (the routes and the reasons
    behind them, for the run's traces); TypeError when it is not a list of records."""
    recent = answer.json()["recent"]
    if not isinstance(recent, list) or not all(isinstance(r, dict) for r in recent):
        raise TypeError("recent is not a list of records")
    return recent


EVENTS_SAMPLE = "prefixswarm_pipeline_events_total"  # peer/api/metrics.py's counter


def pipeline_events(text: str) -> dict[str, float]:
    """The entry-side pipeline events of one peer's /metrics text, by event."""
    return {s.labels["event"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == EVENTS_SAMPLE and "event" in s.labels}


def summed_events(per_peer: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """The entry-side pipeline events (requests, forwards, hedges, shadow_*, audits...)
    of every peer, summed: what the swarm did besides serving its clients. A peer that
    did not answer, or answered what does not parse (None), is left out."""
    total: Counter[str] = Counter()
    for events in per_peer:
        if events is not None:
            total.update(events)
    return dict(sorted(total.items()))


def trusted_pair_fraction(views: Sequence[dict[str, Any] | None]) -> float | None:
    """Of the (peer, other peer) pairs the peers' views list, the fraction where the peer
    trusts the other (its probation over); None when no view lists a peer."""
    states = [(p.get("trust") or {}).get("state") for v in views if v
              for p in v.get("peers", [])]
    return sum(s == "trusted" for s in states) / len(states) if states else None


async def run_policy(bed: Bed, policy: str, workload: Sequence[TokenRequest], model: str,
                     seed: int, warmup: int = 0) -> RunMeasurement:
    """A fresh swarm of `policy`, the workload sent open loop, every request timed; the
    first `warmup` requests are served but not measured, and utilisation is the peers'
    CPU from the first measured request's arrival to the last arrival."""
    entries = entry_peers(seed, len(workload), len(bed.shares))
    setup_start = time.perf_counter()
    async with bed.swarm(policy) as swarm:
        setup_s = time.perf_counter() - setup_start
        outcomes: list[Timed] = []
        limits = httpx.Limits(max_connections=MAX_IN_FLIGHT,
                              max_keepalive_connections=MAX_IN_FLIGHT)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            cpu0 = [swarm.cpu_seconds(i) for i in range(len(swarm.peers))]
            start = window_start = trio.current_time()
            async with trio.open_nursery() as nursery:
                for index, (request, entry) in enumerate(zip(workload, entries, strict=True)):
                    await trio.sleep_until(start + request.arrival_s)
                    if index == warmup:
                        window_start = trio.current_time()
                        cpu0 = [swarm.cpu_seconds(i) for i in range(len(swarm.peers))]

                    async def one(request: TokenRequest = request, entry: int = entry,
                                  index: int = index) -> None:
                        outcomes.append(await _send(client, swarm.peers[entry], request,
                                                    model, index))

                    nursery.start_soon(one)
                window = max(trio.current_time() - window_start, 1e-9)
                cpu1 = [swarm.cpu_seconds(i) for i in range(len(swarm.peers))]
            wall = trio.current_time() - start
            utilization = [(b - a) / (share * window)
                           for a, b, share in zip(cpu0, cpu1, swarm.shares, strict=True)]
            views: list[dict[str, Any] | None] = []
            events: dict[str, float] = {}
            request_logs: list[list[dict[str, Any]] | None] = []

            async def read_views() -> None:
                views.extend(await _ask_each(client, swarm.peers, "/v1/swarm",
                                             lambda r: dict(r.json())))

            async def read_events() -> None:
                events.update(summed_events(await _ask_each(
                    client, swarm.peers, "/metrics", lambda r: pipeline_events(r.text))))

            async def read_request_logs() -> None:
                request_logs.extend(await _ask_each(client, swarm.peers, "/v1/requests",
                                                    _recent))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_views)
                nursery.start_soon(read_events)
                nursery.start_soon(read_request_logs)
        delivery = gossip_delivery(views, [p.peer_id for p in swarm.peers])
    outcomes = sorted((o for o in outcomes if o.index >= warmup), key=lambda o: o.index)
    return RunMeasurement(outcomes, wall, utilization, delivery, setup_s, swarm.up_s,
                          peer_ids=tuple(p.peer_id for p in swarm.peers), events=events,
                          trusted_pair_fraction=trusted_pair_fraction(views),
                          forward_extra_s=[(v or {}).get("self", {}).get("forward_extra_s")
                                           for v in views],
                          advertised=[advertised(v) for v in views],
                          request_logs=request_logs)


def advertised(view: dict[str, Any] | None) -> tuple[float, float] | None:
    """A peer's own (prefill, decode) tokens/s from its /v1/swarm view; None without."""
    me = (view or {}).get("self") or {}
    prefill, decode = me.get("prefill_tokens_per_s"), me.get("decode_tokens_per_s")
    if not isinstance(prefill, int | float) or not isinstance(decode, int | float):
        return None
    return (round(float(prefill), 1), round(float(decode), 1))


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def routed(measured: RunMeasurement) -> list[Routed]:
    """The run's answered requests as `by_entry` reads them (peers in bed order)."""
    index = {pid: i for i, pid in enumerate(measured.peer_ids)}
    return [Routed(index[o.entry], index.get(o.served_by, UNKNOWN_SERVER), o.prompt_tokens,
                   o.cached_tokens, o.ttft_s)
            for o in measured.outcomes if o.ok and o.entry in index]


def trace(measured: RunMeasurement) -> dict[str, Any]:
    """The run's traces (`--traces`): every measured request as the client saw it, peers
    by their index in the bed, and each peer's recent requests with the router's reasons
    (its page's list: the last 50 it entered, so the end of a longer run)."""
    index = {pid: i for i, pid in enumerate(measured.peer_ids)}

    def peer(pid: str) -> int | str:
        return index.get(pid, pid)

    requests = [{
        "index": o.index, "arrival_s": round(o.arrival_s, 6), "entry": peer(o.entry),
        "ok": o.ok, "served_by": peer(o.served_by) if o.served_by else None,
        "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens,
        "ttft_s": round(o.ttft_s, 6) if o.ok else None,
        "entry_ttft_s": None if math.isnan(o.entry_ttft_s) else round(o.entry_ttft_s, 6),
        "route": [{**a, "peer_id": peer(str(a.get("peer_id", "")))} for a in o.route
                  if isinstance(a, dict)],
        "error": o.error,
    } for o in measured.outcomes]
    return {"peers": list(measured.peer_ids), "requests": requests,
            "request_logs": measured.request_logs}


def summarise(measured: RunMeasurement) -> dict[str, Any]:
    """The measured half of a row."""
    ok = [o for o in measured.outcomes if o.ok]
    ttft = [o.ttft_s for o in ok]
    gossip = measured.gossip
    errors = Counter(o.error.split(":")[0] for o in measured.outcomes if not o.ok)
    return {
        "requests": len(measured.outcomes),
        "failed": len(measured.outcomes) - len(ok),
        "errors": dict(errors),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else math.nan,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "e2e_mean_s": statistics.fmean(o.e2e_s for o in ok) if ok else math.nan,
        "hit_ratio": sum(o.cached_tokens for o in ok) / max(1, sum(o.prompt_tokens for o in ok)),
        "forwarded_fraction": sum(o.forwarded for o in ok) / max(1, len(ok)),
        "busiest_peer_utilization": max(measured.utilization),
        "peer_utilization": [round(u, 4) for u in measured.utilization],
        # measured requests each peer served (bed order): where the policy sent the work
        "served_per_peer": [sum(1 for o in ok if o.served_by == pid)
                            for pid in measured.peer_ids],
        # per entry peer (bed order): where its requests went, its hit ratio, forwarded
        # fraction and mean TTFT (bench/testbed/routes.py)
        **by_entry(routed(measured), len(measured.peer_ids)),
        # where the time went: TTFT by where it was served
        "ttft_mean_forwarded_s": _mean([o.ttft_s for o in ok if o.forwarded]),
        "ttft_mean_served_at_entry_s": _mean([o.ttft_s for o in ok if not o.forwarded]),
        # the client's TTFT less the entry's own (from admission): outside the entry
        "ttft_mean_outside_entry_s": _mean([o.ttft_s - o.entry_ttft_s for o in ok
                                            if not math.isnan(o.entry_ttft_s)]),
        # summaries delivered of those that could have arrived (GossipDelivery)
        "gossip_delivered_fraction": gossip.delivered_fraction if gossip else None,
        "gossip_late_fraction": gossip.late_fraction if gossip else None,
        "gossip_in_flight_max": gossip.in_flight_max if gossip else None,
        # what the swarm did besides serving (warm-up included): shadows, hedges, audits
        "pipeline_events": measured.events,
        # what each entry's router added to a forward's cost at the end (forward_overhead.py)
        "forward_extra_s": measured.forward_extra_s,
        "advertised_tokens_per_s": measured.advertised,  # per peer: (prefill, decode)
        "trusted_pair_fraction": measured.trusted_pair_fraction,
        "wall_s": measured.wall_s,
        "setup_s": measured.setup_s,  # start until every peer knows every other
        "setup_up_s": measured.up_s,  # ... of which until every peer was up
    }
