"""Where each entry peer's requests went, measured or simulated: the per-entry view of a run.

A policy's mean TTFT hides which entries it helped and which it hurt: on the testbed the
0.2-core peer's clients wait several times longer than the others', and a router that
sends all of that peer's work to one fast peer can win there and lose at that peer's own
cache. `by_entry` reduces one run's requests, as the client saw them (bench/testbed/runner.py)
or as the simulator served them (bench/testbed/predict.py), to the same figures, so the
row puts measured and predicted side by side per entry. Pure: no trio, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

UNKNOWN_SERVER = -1  # served by no peer of the bed (a failed request, or an id not known)


@dataclass(frozen=True)
class Routed:
    """One measured request: where it entered and was served (bed order), what of its
    prompt was cached there, and its time to first token."""

    entry: int
    server: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


def by_entry(routed: Sequence[Routed], peers: int) -> dict[str, Any]:
    """Per entry peer (bed order): `served_matrix[i][j]`, the requests entering at i that
    j served; and of those entering at i, the hit ratio (cached over prompt tokens), the
    fraction served elsewhere and the mean TTFT (None where none entered there). A
    request of an unknown server counts in its entry's figures but in no matrix cell."""
    if peers < 1:
        raise ValueError(f"peers must be >= 1, got {peers}")
    matrix = [[0] * peers for _ in range(peers)]
    groups: list[list[Routed]] = [[] for _ in range(peers)]
    for r in routed:
        if not 0 <= r.entry < peers:
            raise ValueError(f"entry {r.entry} is not a peer of {peers}")
        groups[r.entry].append(r)
        if 0 <= r.server < peers:
            matrix[r.entry][r.server] += 1
    hit: list[float | None] = []
    forwarded: list[float | None] = []
    ttft: list[float | None] = []
    for entry, group in enumerate(groups):
        prompt = sum(r.prompt_tokens for r in group)
        hit.append(sum(r.cached_tokens for r in group) / prompt if prompt else None)
        forwarded.append(sum(r.server != entry for r in group) / len(group) if group else None)
        times = [r.ttft_s for r in group if not math.isnan(r.ttft_s)]
        ttft.append(statistics.fmean(times) if times else None)
    return {"served_matrix": matrix, "hit_ratio_per_entry": hit,
            "forwarded_fraction_per_entry": forwarded, "ttft_mean_per_entry_s": ttft}
