"""One testbed run: a fresh swarm of a policy (bench/testbed/beds.py), the workload
replayed open loop (each request at its arrival time, to a seeded random entry peer),
every streamed completion timed at the client, and the measured half of a row.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from bench.stats import percentile
from bench.swarm import Outcome, completion_body, stream_completion
from bench.testbed.beds import (
    MAX_IN_FLIGHT,
    REQUEST_TIMEOUT_S,
    Bed,
    SwarmPeer,
)
from bench.workloads import TokenRequest


@dataclass
class Timed(Outcome):
    arrival_s: float = 0.0
    index: int = 0


@dataclass
class RunMeasurement:
    """What one policy run measured (before predictions are added)."""

    outcomes: list[Timed]
    wall_s: float
    utilization: list[float]
    gossip_delivered_fraction: float | None
    setup_s: float
    up_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    peer_ids: tuple[str, ...] = ()  # in the bed's order (utilization's too)


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
    )


def gossip_delivered(views: Sequence[dict[str, Any] | None],
                     peer_ids: Sequence[str]) -> float | None:
    """Summaries delivered over summaries sent to everyone else (full gossip), from each
    peer's /v1/swarm `gossip_counts`; None when any peer does not report them."""
    counts = [v.get("gossip_counts") if v else None for v in views]
    if any(not isinstance(c, dict) for c in counts):
        return None
    n = len(peer_ids)
    published = sum(int(c["published"]) for c in counts if c)
    if n < 2 or published == 0:
        return None
    delivered = 0
    for me, c in zip(peer_ids, counts, strict=True):
        accepted = (c or {}).get("accepted", {})
        delivered += sum(int(v) for sender, v in accepted.items() if sender != me)
    return delivered / (published * (n - 1))


async def _views(client: httpx.AsyncClient, peers: Sequence[SwarmPeer]) -> list[
        dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for p in peers:
        try:
            r = await client.get(f"{p.http}/v1/swarm", timeout=10.0)
            out.append(r.json())
        except (httpx.HTTPError, ValueError):
            out.append(None)
    return out


async def run_policy(bed: Bed, policy: str, workload: Sequence[TokenRequest], model: str,
                     seed: int, warmup: int = 0) -> RunMeasurement:
    """A fresh swarm of `policy`, the workload sent open loop, every request timed; the
    first `warmup` requests are served but not measured, and utilisation is the peers'
    CPU from the first measured request's arrival to the last arrival."""
    rng = random.Random(f"{seed}/entries")  # the same entries for every policy
    entries = [rng.randrange(len(bed.shares)) for _ in workload]
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
            views = await _views(client, swarm.peers)
        delivered = gossip_delivered(views, [p.peer_id for p in swarm.peers])
    outcomes = sorted((o for o in outcomes if o.index >= warmup), key=lambda o: o.index)
    return RunMeasurement(outcomes, wall, utilization, delivered, setup_s, swarm.up_s,
                          peer_ids=tuple(p.peer_id for p in swarm.peers))


def summarise(measured: RunMeasurement) -> dict[str, Any]:
    """The measured half of a row."""
    ok = [o for o in measured.outcomes if o.ok]
    ttft = [o.ttft_s for o in ok]
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
        "gossip_delivered_fraction": measured.gossip_delivered_fraction,
        "wall_s": measured.wall_s,
        "setup_s": measured.setup_s,  # start until every peer knows every other
        "setup_up_s": measured.up_s,  # ... of which until every peer was up
    }
