"""What an operator sees over HTTP: /version, /v1/models with the context length and the
served names, OpenAI-style JSON errors for unknown routes and models, and /metrics
(prefix-cache query/hit counters, latency histograms, queue wait, process metrics)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from prometheus_client.core import GaugeMetricFamily

from peer.api.metrics import Metrics
from peer.version import version
from tests.test_http import MODEL, PROMPT, client, start_api


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


async def test_version_models_and_json_errors(nursery, tiny_engine_factory):
    engine = tiny_engine_factory()
    _peer, url = await start_api(nursery, engine, served_model_names=("smol", "default"))
    api = client(url)
    models = await api.models.list()
    assert [m.id for m in models.data] == [MODEL, engine.model_id, "smol", "default"]
    entry: Any = models.data[2]
    assert entry.max_model_len == engine.max_context == 2048
    assert entry.context_length == 2048 and entry.root == engine.model_id
    answer = await api.completions.create(model="smol", prompt="hi", max_tokens=2)
    assert answer.model == "smol"

    with pytest.raises(openai.NotFoundError) as info:
        await api.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                    "content": "hi"}])
    assert info.value.status_code == 404 and info.value.code == "model_not_found"

    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/version")).json() == {"version": version()}
        r = await http.get("/v1/embeddings")
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["code"] == "not_found" and "/v1/embeddings" in error["message"]
        assert error["type"] == "invalid_request_error"
        r = await http.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()
        assert r.headers["content-type"] == "application/json"


async def test_metrics_for_operators(nursery, tiny_engine_factory):
    peer, url = await start_api(nursery, tiny_engine_factory())
    api = client(url)
    for _ in range(2):  # the second request finds the prompt's 3 full blocks cached
        stream = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                              stream=True)
        async for _chunk in stream:
            pass
    seen = []

    def reach(stats: dict[str, Any]) -> Any:
        seen.append(stats["peers_known"])
        yield GaugeMetricFamily("prefixswarm_test_extra", "an added family", value=7)

    async with httpx.AsyncClient(base_url=url) as http:
        lines = _samples((await http.get("/metrics")).text)
    peer_metrics = Metrics(peer.statistics)
    peer_metrics.add_collector(reach)
    extra = _samples(peer_metrics.render().decode())
    assert extra["prefixswarm_test_extra"] == 7 and seen == [0]

    assert lines["prefixswarm_prefix_cache_queries_total"] == 2 * 61
    assert lines["prefixswarm_prefix_cache_hits_total"] == 48  # 3 blocks of 16
    assert "prefixswarm_prefix_hit_ratio" not in lines
    assert lines["prefixswarm_e2e_request_latency_seconds_count"] == 2
    assert lines["prefixswarm_e2e_request_latency_seconds_sum"] > 0
    assert lines["prefixswarm_inter_token_latency_seconds_count"] == 2 * 4  # 5 tokens, 4 gaps
    assert lines["prefixswarm_request_queue_seconds_count"] == 2
    assert lines["process_resident_memory_bytes"] > 10e6
    assert lines["process_cpu_seconds_total"] > 0


def test_add_collector_needs_a_snapshot():
    with pytest.raises(ValueError, match="snapshot"):
        Metrics().add_collector(lambda stats: [])
