"""magnet_staller: advertise speeds that escape naive caps, pass probation, then stall.

Its summaries are its honest ones (true Bloom filter and load) with speed claims that a
cap applied before a derivation, or only when both speeds are positive, lets through:
alternately decode ~0 with a batch decode of 1e9 in one slot (the batch ratio would make
a lone stream 1.2e8 tokens/s), and prefill 1e9 with decode 0. Its first
HONEST_STREAMS_PER_ENTRY inference streams from each entry peer are served honestly (the
shadow copies of probation among them); every later stream stalls, alternately before
its first token (what a hedge races against) and after an honest first token (what only
the token gap catches, and what a verified response holds back from its client).
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from collections import Counter
from typing import Any

import trio

from peer.node import Peer
from peer.swarm.local_summary import build_summary
from protocols.ids import INFER_PROTOCOL
from protocols.summary import MAX_TOKENS_PER_S, CacheSummary, encode_summary

HONEST_STREAMS_PER_ENTRY = 3  # DEFAULT_PROBATION_REQUESTS: enough to pass probation
TINY_DECODE = 1e-3  # "decode ~0": positive, so a cap that needs both speeds applies it
STALL_MAX_S = 600.0  # a stalled stream is held at most this long (or the request's deadline)

# The two claims it alternates between (on top of its honest summary).
CLAIMS: tuple[dict[str, Any], ...] = (
    {"decode_tokens_per_s": TINY_DECODE, "batch_decode_tokens_per_s": MAX_TOKENS_PER_S,
     "batch_slots": 1},
    {"prefill_tokens_per_s": MAX_TOKENS_PER_S, "decode_tokens_per_s": 0.0,
     "batch_decode_tokens_per_s": 0.0},
)


def magnet_summary(honest: CacheSummary, seq: int) -> CacheSummary:
    """``honest`` with the speed claims of CLAIMS[seq % 2]."""
    return dataclasses.replace(honest, **CLAIMS[seq % len(CLAIMS)])


class _StallingStream:
    """An inbound stream whose writes stall from the ``stall_at``-th on (0: the first,
    before any token; 1: after the first token chunk), until the stream is reset."""

    def __init__(self, stream: Any, stall_at: int) -> None:
        self._stream = stream
        self._stall_at = stall_at
        self._writes = 0
        self.muxed_conn = stream.muxed_conn

    async def write(self, data: bytes) -> None:
        if self._writes >= self._stall_at:
            await trio.sleep(STALL_MAX_S)  # the entry gives up and resets the stream
        self._writes += 1
        await self._stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def install(peer: Peer, received: Counter[str], answered: Counter[str]) -> None:
    """Replace ``peer``'s summary publisher and inference handler with the attack's."""
    gossip = peer.gossip
    honest_publish = gossip._publish

    async def publish(self: Any, *, early: bool, leaving: bool = False) -> None:
        if leaving:
            await honest_publish(early=early, leaving=leaving)
            return
        self._seq += 1
        honest = build_summary(
            self._engine, peer_id=self._peer_id_str, seq=self._seq, fp_rate=self._fp_rate,
            bloom=self._current_bloom(),
        )
        with trio.move_on_after(5.0):
            await self._pubsub.publish(self._topic, encode_summary(magnet_summary(honest,
                                                                                 self._seq)))
            self._stats["published"] += 1

    gossip._publish = types.MethodType(publish, gossip)  # type: ignore[method-assign]

    assert peer.serving is not None
    honest_handler = peer.serving.inference.handle_stream
    per_entry: Counter[str] = Counter()
    turns = itertools.cycle((0, 1))

    async def handle(stream: Any) -> None:
        remote = stream.muxed_conn.peer_id.to_base58()
        received[peer.peer_id] += 1
        per_entry[remote] += 1
        if per_entry[remote] <= HONEST_STREAMS_PER_ENTRY:
            answered["honest"] += 1
            await honest_handler(stream)
            return
        stall_at = next(turns)
        answered["stalled_before_first_token" if stall_at == 0 else "stalled_after_first"] += 1
        await honest_handler(_StallingStream(stream, stall_at))

    peer.host.libp2p.set_stream_handler(INFER_PROTOCOL, handle)


def tried_first(outcomes: Any, rogue_ids: set[str]) -> dict[str, Any]:
    """bench.adversary's measure of this attack over its requests' routes (each outcome's
    ``index``, ``entry`` and ``route``): routes that tried the rogue first, those of them
    after the rogue was first charged by that same entry, and the client time its
    attempts cost (the route's waited_s)."""
    first = after_charge = 0
    charged_at: dict[str, int] = {}
    waited = 0.0
    for o in sorted(outcomes, key=lambda o: o.index):
        route = o.route
        rogue_steps = [a for a in route if a["peer_id"] in rogue_ids]
        waited += sum(a.get("waited_s", 0.0) for a in rogue_steps)
        if route and route[0]["peer_id"] in rogue_ids:
            first += 1
            if o.entry in charged_at:
                after_charge += 1
        if any(a.get("charged", 0.0) > 0 for a in rogue_steps):
            charged_at.setdefault(o.entry, o.index)
    return {
        "rogue_tried_first": first,
        "rogue_tried_first_after_charged": after_charge,
        "entries_that_charged_the_rogue": len(charged_at),
        "client_seconds_lost_on_rogue": round(waited, 3),
    }
