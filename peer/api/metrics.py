"""Prometheus metrics of one peer: its own CollectorRegistry, no global state.

HTTP-side counters and histograms (requests, tokens, time to first token, end-to-end
latency, inter-token latency, forwards by outcome) are recorded by the HTTP layer as
requests run; the engine reports each request's queue wait; peer-wide numbers (peers
known, gossip bytes, prefix-cache queries and hits in tokens, pipeline events) are read
from `peer.statistics()` at scrape time, so they are never stale and never
double-counted; process metrics (CPU, memory, open files) come from prometheus_client's
process collector. Another subsystem adds its own families with `add_collector(fn)`:
`fn(statistics_snapshot)` yields Metric families at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from tens of milliseconds (cached prefix, tiny model) to minutes (long prompts
# on a slow CPU); the default buckets stop at 10 s.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# End to end: a few tokens of a cached prompt (tenths of a second) to long answers (minutes).
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
# Between two tokens: ~10 ms (135M model, one CPU request) to seconds (a busy engine).
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Waiting for the engine: zero when idle, up to the whole request deadline under load.
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

SnapshotCollector = Callable[[dict[str, Any]], Iterable[Metric]]


def _total(value: Any) -> float:
    """A number, or the sum of a {reason: count} breakdown."""
    return float(sum(value.values()) if isinstance(value, dict) else value)


class _PeerCollector(Collector):
    """Reads a statistics snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot
        self.extra: list[SnapshotCollector] = []

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot()
        for fn in self.extra:
            yield from fn(stats)
        yield GaugeMetricFamily(
            "prefixswarm_peers_known", "Peers in this peer's table", value=stats["peers_known"]
        )
        yield GaugeMetricFamily(
            "prefixswarm_peers_connected",
            "Peers with an open libp2p connection",
            value=stats["peers_connected"],
        )
        gossip = CounterMetricFamily(
            "prefixswarm_gossip_bytes", "Summary bytes sent and received", labels=["direction"]
        )
        gossip.add_metric(["in"], stats["gossip_bytes_in"])
        gossip.add_metric(["out"], stats["gossip_bytes_out"])
        yield gossip
        summaries = CounterMetricFamily(
            "prefixswarm_summaries", "Cache summaries by fate", labels=["fate"]
        )
        for fate in ("published", "accepted", "rejected"):
            summaries.add_metric([fate], _total(stats[f"summaries_{fate}"]))
        yield summaries
        gate = CounterMetricFamily(
            "prefixswarm_gossip_gate",
            "Received summaries by the gossip gate's verdict, before their signature is checked",
            labels=["verdict"],
        )
        for verdict, count in (stats.get("gossip") or {}).get("gate", {}).items():
            gate.add_metric([verdict], count)
        yield gate
        yield GaugeMetricFamily(
            "prefixswarm_gossip_graylisted",
            "Gossip forwarders graylisted now (their summaries kept being refused)",
            value=(stats.get("gossip") or {}).get("graylisted", 0),
        )
        engine = stats.get("engine") or {}
        # As vLLM's prefix_cache_queries/hits: rate(hits) / rate(queries) is the hit
        # ratio over any window, which a lifetime ratio gauge cannot give.
        yield CounterMetricFamily(
            "prefixswarm_prefix_cache_queries",
            "Prompt tokens this peer's engine looked up in its prefix cache",
            value=engine.get("prompt_tokens", 0),
        )
        yield CounterMetricFamily(
            "prefixswarm_prefix_cache_hits",
            "Prompt tokens this peer's engine found in its prefix cache (not recomputed)",
            value=engine.get("cached_tokens", 0),
        )
        for key, help_text in (
            ("cache_num_blocks", "KV blocks in the prefix cache"),
            ("running_requests", "Requests running on this peer's engine"),
            ("queued_prompt_tokens", "Uncached prompt tokens waiting on this peer's engine"),
        ):
            if key in engine:
                yield GaugeMetricFamily(f"prefixswarm_engine_{key}", help_text, value=engine[key])
        serving = stats.get("serving") or {}
        pipeline = serving.get("pipeline") or {}
        events = CounterMetricFamily(
            "prefixswarm_pipeline_events",
            "Entry-side request path events (requests, served_local, forwards, attempt_*)",
            labels=["event"],
        )
        for key, value in sorted(pipeline.items()):
            if key not in ("entry_in_flight", "verification_available", "shadows_in_flight"):
                events.add_metric([key], _total(value))
        yield events
        reach = stats.get("reach")
        if reach:
            yield from _reach_metrics(reach)


# Reach figures that are levels, not counts of events (peer/net/relay_service.py's statistics()).
REACH_GAUGES = {
    "reservations_held_for_others": "Relay slots this peer holds for peers behind NAT",
    "circuits_open": "Relayed circuits open through this peer now",
}


def _reach_metrics(reach: dict[str, Any]) -> Iterator[Metric]:
    """Reachability verdict, relay slots and circuits, and relay/dial-back events."""
    verdict = GaugeMetricFamily(
        "prefixswarm_reachability",
        "1 for this peer's reachability verdict (public: others dial it; private: behind NAT)",
        labels=["verdict"],
    )
    for state in ("public", "private", "unknown"):
        verdict.add_metric([state], float(reach.get("reachability") == state))
    yield verdict
    yield GaugeMetricFamily(
        "prefixswarm_relays_reserved", "Relays this peer reserved a slot on (behind NAT)",
        value=len(reach.get("relays") or ()),
    )
    for key, help_text in REACH_GAUGES.items():
        if key in reach:
            yield GaugeMetricFamily(f"prefixswarm_relay_{key}", help_text, value=reach[key])
    events = CounterMetricFamily(
        "prefixswarm_relay_events",
        "Relay and dial-back events (circuits, reservations, relayed streams, bytes moved, ...)",
        labels=["event"],
    )
    for key, value in sorted(reach.items()):
        if key not in REACH_GAUGES and isinstance(value, int) and not isinstance(value, bool):
            events.add_metric([key], value)
    yield events


class Metrics:
    """The metrics of one peer's HTTP API."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "prefixswarm_http_requests",
            "HTTP API requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "prefixswarm_tokens",
            "Tokens of finished HTTP requests: prompt, cached (part of prompt), completion",
            ["kind"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "prefixswarm_time_to_first_token_seconds",
            "Time to first token at the entry peer, queueing and routing included",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.forwards = Counter(
            "prefixswarm_forwards",
            "Attempts to serve HTTP requests on other peers, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.forward_wait = Counter(
            "prefixswarm_forward_wait_seconds",
            "Seconds clients waited on attempts on other peers that did not serve them, by outcome"
            " (stalled, hedge races lost, failures)",
            ["outcome"],
            registry=self.registry,
        )
        self.forward_charges = Counter(
            "prefixswarm_forward_charges",
            "What the trust ledger charged other peers for attempts that cost clients time, in"
            " failures (peer/routing/reliability.py), by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.served = Counter(
            "prefixswarm_served",
            "HTTP requests by where they were served: local or remote",
            ["where"],
            registry=self.registry,
        )
        self.e2e = Histogram(
            "prefixswarm_e2e_request_latency_seconds",
            "End-to-end time of finished requests at the entry peer, admission to last token",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "prefixswarm_inter_token_latency_seconds",
            "Time between consecutive tokens streamed to clients at the entry peer",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "prefixswarm_request_queue_seconds",
            "Time requests waited for this peer's engine before their first step ran",
            buckets=QUEUE_BUCKETS,
            registry=self.registry,
        )
        ProcessCollector(namespace="", registry=self.registry)  # process_cpu_seconds etc.
        self._collector: _PeerCollector | None = None
        self.unexpected = Counter(
            "prefixswarm_http_unexpected_errors",
            "HTTP requests that failed on a bug (answered 500), by endpoint and exception type",
            ["endpoint", "error"],
            registry=self.registry,
        )
        if snapshot is not None:
            self._collector = _PeerCollector(snapshot)
            self.registry.register(self._collector)

    def add_collector(self, fn: SnapshotCollector) -> None:
        """Also yield `fn(statistics snapshot)`'s metric families at every scrape."""
        if self._collector is None:
            raise ValueError("add_collector needs Metrics built with a snapshot")
        self._collector.extra.append(fn)

    def record_token_gap(self, gap_s: float, tokens: int) -> None:
        """`tokens` arrived `gap_s` after the previous ones: that many inter-token gaps."""
        for _ in range(tokens):
            self.itl.observe(gap_s / tokens)

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def record_unexpected(self, endpoint: str, exc: BaseException) -> None:
        """Count a request that failed on an error no handler names (a 500)."""
        self.unexpected.labels(endpoint, type(exc).__name__).inc()

    def record_result(self, result: Any, self_id: str) -> None:
        """Count a finished GenerationResult."""
        self.tokens.labels("prompt").inc(result.prompt_tokens)
        self.tokens.labels("cached").inc(result.cached_tokens)
        self.tokens.labels("completion").inc(result.completion_tokens)
        self.ttft.observe(result.ttft_s)
        self.e2e.observe(result.total_s)
        self.served.labels("local" if result.served_by == self_id else "remote").inc()
        self.record_route(result.route)

    def record_route(self, attempts: Any) -> None:
        """Count the remote attempts of a route (a GenerationResult's or a failure's)."""
        for attempt in attempts:
            if not attempt.is_local:
                outcome = attempt.outcome.value
                self.forwards.labels(outcome).inc()
                if attempt.waited_s > 0:
                    self.forward_wait.labels(outcome).inc(attempt.waited_s)
                if attempt.charged > 0:
                    self.forward_charges.labels(outcome).inc(attempt.charged)

    def render(self) -> bytes:
        return generate_latest(self.registry)
