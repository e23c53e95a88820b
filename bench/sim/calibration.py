"""Service-time calibration of a simulated peer: prefill and decode cost of the real engine.

The default parameter set is fitted to the SmolLM2-135M measurements in the project notes
(torch CPU, fp32, 2 vCPUs): cold prefill of 512 tokens ~1.0 s and of 1024 tokens ~2.2 s;
400 cached + 112 new tokens 3.0-3.8x faster than 512 cold; 896 cached + 112 new 4.7-5.8x
faster than 1008 cold; decode 60-80 ms per token. A least-squares fit of

    prefill_s(new, cached) = fixed + per_token * new + per_token_ctx * new * (cached + new / 2)

(the last term is attention: each new token attends to the cached context and to the new
tokens before it) gives fixed = 0.099 s, per_token = 1.43 ms, per_token_ctx = 1.23 us,
reproducing the four points within 10%. `Calibration.from_engine_json` refits the
same form from a `python -m bench.engine --json` result when one is available.

A step of the batching engine (peer/engine/scheduler.py) decodes every running sequence
and reads prefill chunks; `step_s` prices it as one forward's fixed cost, a share of a
lone decode step per decoding sequence (`batch_step_slope`), and each chunk's prefill
beyond the fixed cost:

    step_s = decode_s_per_token * (1 - slope + slope * decodes)   (decodes >= 1; else the
             + sum(prefill_s(n, cached) - prefill_fixed_s)          fixed part alone)

The slope's default is the cost model's (peer/routing/cost.py BATCH_STEP_SLOPE, fitted to
bench.engine's concurrency sweeps: `batch_slope_from_sweep`), so simulator and router
agree unless a calibration says otherwise.

A whole peer also spends CPU per request outside the engine's steps: the HTTP request and
routing before the first token (`request_overhead_s`) and the end of the stream after it
(`request_tail_s`), both paid by the serving peer, and, for a forwarded request, the
entry's HTTP, routing and relayed stream (`forward_overhead_s`, paid by the entry) and
the serving peer's stream beyond what a request of its own HTTP clients costs it
(`served_overhead_s`: the inference protocol's framing and signed answer); and
for each cache summary, the publisher's CPU (`summary_publish_s`) and every receiver's
(`summary_receive_s`: decrypting, checking and applying it, relaying it on). An engine
measured alone has none (all 0); a calibration measured through a peer's API
(bench/testbed/calibrate.py) has them. Such a calibration also has what a lone request's
wall clock shows beyond its peer's CPU (`client_path_s`: the client's side and the hops
between it and its entry), which every request entering there carries to its client.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from peer.routing.cost import BATCH_STEP_SLOPE

NOMINAL_PROMPT_TOKENS = 512  # the prompt length at which a nominal prefill speed is quoted


@dataclass(frozen=True)
class Calibration:
    """Prefill and decode cost of one peer (all peers share it unless scaled)."""

    name: str = "smollm2-135m-notes"
    prefill_fixed_s: float = 0.099
    prefill_s_per_token: float = 1.43e-3
    prefill_s_per_token_ctx: float = 1.23e-6
    decode_s_per_token: float = 0.070
    source: str = "docs/model.md (SmolLM2-135M, fp32, 2 vCPUs), least-squares fit"
    batch_step_slope: float = BATCH_STEP_SLOPE  # a decode step of b: (1 - s + s b) lone steps
    max_context: int = 8192  # SmolLM2's context window: the warm-up probes up to half of it
    request_overhead_s: float = 0.0  # serving peer's CPU per request before its first token
    request_tail_s: float = 0.0  # ... and after it, outside engine steps
    forward_overhead_s: float = 0.0  # entry's CPU per request it forwards
    forward_tail_s: float = 0.0  # ... and per client request, once its answer is back
    served_overhead_s: float = 0.0  # serving peer's CPU per forwarded request, beyond a local one
    summary_publish_s: float = 0.0  # publisher's CPU per cache summary it sends
    summary_receive_s: float = 0.0  # a receiver's CPU per cache summary it gets
    # CPU after each engine step, as a fraction of the step's work (its overheads
    # included): what a request costs its peer in a running swarm beyond what it costs
    # alone, paid off the path of the step's own requests (before the next step)
    after_step_fraction: float = 0.0
    client_path_s: float = 0.0  # wall time between a client and this entry that uses no
    #   peer's CPU (the client's HTTP stack, a testbed's link emulator): in each request's
    #   reported TTFT and end to end, never in a peer's work; not scaled with its speed

    def __post_init__(self) -> None:
        for name in (
            "request_overhead_s",
            "request_tail_s",
            "forward_overhead_s",
            "forward_tail_s",
            "served_overhead_s",
            "summary_publish_s",
            "summary_receive_s",
            "client_path_s",
            "after_step_fraction",
            "prefill_fixed_s",
            "prefill_s_per_token",
            "prefill_s_per_token_ctx",
            "decode_s_per_token",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefill_s_per_token <= 0 or self.decode_s_per_token <= 0:
            raise ValueError("per-token prefill and decode costs must be > 0")
        if not 0 <= self.batch_step_slope <= 1:
            raise ValueError(f"batch_step_slope must be in [0, 1], got {self.batch_step_slope}")
        if self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to prefill `new_tokens` after `cached_tokens` reused ones."""
        if new_tokens <= 0:
            return 0.0
        return (
            self.prefill_fixed_s
            + self.prefill_s_per_token * new_tokens
            + self.prefill_s_per_token_ctx * new_tokens * (cached_tokens + new_tokens / 2)
        )

    def step_s(self, decodes: int, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds of one batched step: `decodes` sequences decoding one token each and
        prefill `chunks` of (new tokens, tokens before them) (module docstring)."""
        slope = self.batch_step_slope
        seconds = self.decode_s_per_token * (1.0 - slope + slope * decodes)
        for new, before in chunks:
            seconds += self.prefill_s(new, before) - self.prefill_fixed_s
        return seconds

    def decode_s(self, tokens: int) -> float:
        """Seconds to decode `tokens` tokens one after another (batch of one)."""
        return self.decode_s_per_token * max(0, tokens)

    @property
    def prefill_tokens_per_s(self) -> float:
        """Nominal cold prefill speed at NOMINAL_PROMPT_TOKENS, as a peer would advertise it."""
        return NOMINAL_PROMPT_TOKENS / self.prefill_s(NOMINAL_PROMPT_TOKENS, 0)

    @property
    def decode_tokens_per_s(self) -> float:
        """Nominal decode speed, as a peer would advertise it."""
        return 1.0 / self.decode_s_per_token

    def scaled(self, factor: float) -> Calibration:
        """A peer `factor` times slower (factor > 1) or faster (factor < 1)."""
        if factor <= 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        return replace(
            self,
            name=f"{self.name}x{factor:g}",
            prefill_fixed_s=self.prefill_fixed_s * factor,
            prefill_s_per_token=self.prefill_s_per_token * factor,
            prefill_s_per_token_ctx=self.prefill_s_per_token_ctx * factor,
            decode_s_per_token=self.decode_s_per_token * factor,
            request_overhead_s=self.request_overhead_s * factor,
            request_tail_s=self.request_tail_s * factor,
            forward_overhead_s=self.forward_overhead_s * factor,
            forward_tail_s=self.forward_tail_s * factor,
            served_overhead_s=self.served_overhead_s * factor,
            summary_publish_s=self.summary_publish_s * factor,
            summary_receive_s=self.summary_receive_s * factor,
        )

    def as_dict(self) -> dict[str, Any]:
        """The parameter set, for result files."""
        return {
            "name": self.name,
            "prefill_fixed_s": self.prefill_fixed_s,
            "prefill_s_per_token": self.prefill_s_per_token,
            "prefill_s_per_token_ctx": self.prefill_s_per_token_ctx,
            "decode_s_per_token": self.decode_s_per_token,
            "batch_step_slope": self.batch_step_slope,
            "max_context": self.max_context,
            "request_overhead_s": self.request_overhead_s,
            "request_tail_s": self.request_tail_s,
            "forward_overhead_s": self.forward_overhead_s,
            "forward_tail_s": self.forward_tail_s,
            "served_overhead_s": self.served_overhead_s,
            "summary_publish_s": self.summary_publish_s,
            "summary_receive_s": self.summary_receive_s,
            "client_path_s": self.client_path_s,
            "after_step_fraction": self.after_step_fraction,
            "source": self.source,
        }

    @classmethod
    def from_points(
        cls,
        points: list[tuple[int, int, float]],
        decode_s_per_token: float,
        name: str,
        source: str,
    ) -> Calibration:
        """Fit the prefill form to (cached_tokens, new_tokens, seconds) points (>= 3)."""
        if len(points) < 3:
            raise ValueError(f"need >= 3 prefill points to fit 3 parameters, got {len(points)}")
        import numpy as np  # only here: the simulator itself does not need numpy

        rows = [[1.0, n, n * (k + n / 2)] for k, n, _ in points]
        ys = [t for _, _, t in points]
        coef, *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
        fixed, per_tok, per_ctx = (max(0.0, float(c)) for c in coef)
        if per_tok <= 0:
            raise ValueError(f"the fit gave a non-positive per-token prefill cost: {coef}")
        return cls(name, fixed, per_tok, per_ctx, decode_s_per_token, source)

    @classmethod
    def from_engine_json(cls, path: str | Path) -> Calibration:
        """Fit to a bench/engine result. Two shapes are read: bench/engine's own (prompt_tokens,
        ttft_cold_s and ttft_hit50_s / ttft_hit90_s with cached_tokens_hit50 / _hit90: three
        TTFT points; decode stays at this default, which that file does not measure; the batch
        slope from its concurrency sweep when it has one), or
        rows with cached_tokens, new_tokens, prefill_s and a decode_s_per_token."""
        data = json.loads(Path(path).read_text())
        if "ttft_cold_s" in data:
            n = int(data["prompt_tokens"])
            points = [(0, n, float(data["ttft_cold_s"]))]
            for tag in ("hit50", "hit90"):
                if f"ttft_{tag}_s" in data:
                    k = int(data[f"cached_tokens_{tag}"])
                    points.append((k, n - k, float(data[f"ttft_{tag}_s"])))
            decode = float(data.get("decode_s_per_token", cls.decode_s_per_token))
            fitted = cls.from_points(points, decode, f"engine:{Path(path).name}", str(path))
            if "tokens_per_s_by_concurrency" in data:  # a batching engine's sweep
                slope = batch_slope_from_sweep(data["tokens_per_s_by_concurrency"])
                fitted = replace(fitted, batch_step_slope=slope)
            return fitted
        rows = data.get("rows", [])
        points = [
            (int(r["cached_tokens"]), int(r["new_tokens"]), float(r["prefill_s"]))
            for r in rows
            if {"cached_tokens", "new_tokens", "prefill_s"} <= r.keys()
        ]
        decode = data.get("decode_s_per_token")
        if decode is None:
            decodes = sorted(
                float(r["decode_s_per_token"]) for r in rows if "decode_s_per_token" in r
            )
            if not decodes:
                raise ValueError(f"{path}: no decode_s_per_token anywhere")
            decode = decodes[len(decodes) // 2]
        return cls.from_points(points, float(decode), f"engine:{Path(path).name}", str(path))


def batch_slope_from_sweep(tokens_per_s_by_concurrency: Mapping[str, float]) -> float:
    """The batch step slope of a bench.engine concurrency sweep ({"1": tokens/s, "4": ...}).

    At concurrency c the aggregate speed is c / step(c), so step(c) / step(1) is
    c * speed(1) / speed(c), which the model puts at 1 + s (c - 1): a least-squares fit of s
    through that line, clamped to [0, 1]. The sweep's steps also read prompts, so this is
    an upper bound of the decode-only slope."""
    speeds = {int(c): float(v) for c, v in tokens_per_s_by_concurrency.items()}
    if 1 not in speeds or len(speeds) < 2 or speeds[1] <= 0:
        raise ValueError(f"need concurrency 1 and another, got {sorted(speeds)}")
    num = den = 0.0
    for c, v in speeds.items():
        if c > 1 and v > 0:
            x = c - 1
            num += x * (c * speeds[1] / v - 1)
            den += x * x
    if den == 0:
        raise ValueError("no usable concurrency above 1")
    return min(max(num / den, 0.0), 1.0)


NOTES_CALIBRATION = Calibration()
