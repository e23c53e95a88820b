"""Prometheus metrics of one peer: its own CollectorRegistry, no global state.

HTTP-side counters (requests, tokens, time to first token, forwards by outcome) are
recorded by the HTTP layer as requests finish; peer-wide numbers (peers known, gossip
bytes, engine cache hit ratio, pipeline events) are read from `peer.statistics()` at
scrape time, so they are never stale and never double-counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from tens of milliseconds (cached prefix, tiny model) to minutes (long prompts
# on a slow CPU); the default buckets stop at 10 s.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _total(value: Any) -> float:
    """A number, or the sum of a {reason: count} breakdown."""
    return float(sum(value.values()) if isinstance(value, dict) else value)


class _PeerCollector(Collector):
    """Reads a statistics snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot()
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
        engine = stats.get("engine") or {}
        prompt = engine.get("prompt_tokens", 0)
        yield GaugeMetricFamily(
            "prefixswarm_prefix_hit_ratio",
            "Prompt tokens this peer's engine reused from its cache / prompt tokens it served",
            value=(engine.get("cached_tokens", 0) / prompt) if prompt else 0.0,
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
            if key not in ("entry_in_flight", "verification_available"):  # gauges, not events
                events.add_metric([key], _total(value))
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
        self.served = Counter(
            "prefixswarm_served",
            "HTTP requests by where they were served: local or remote",
            ["where"],
            registry=self.registry,
        )
        self.unexpected = Counter(
            "prefixswarm_http_unexpected_errors",
            "HTTP requests that failed on a bug (answered 500), by endpoint and exception type",
            ["endpoint", "error"],
            registry=self.registry,
        )
        if snapshot is not None:
            self.registry.register(_PeerCollector(snapshot))

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
        self.served.labels("local" if result.served_by == self_id else "remote").inc()
        self.record_route(result.route)

    def record_route(self, attempts: Any) -> None:
        """Count the remote attempts of a route (a GenerationResult's or a failure's)."""
        for attempt in attempts:
            if not attempt.is_local:
                self.forwards.labels(attempt.outcome.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
