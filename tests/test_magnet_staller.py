"""The magnet_staller rogue (bench/rogues/magnet_staller.py): its summaries pass an honest
table's validation yet are priced no faster than the entry peer, its streams stall where
it says, and bench.adversary's measure of it counts what it should."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import trio

from bench.rogues.magnet_staller import (
    CLAIMS,
    STALL_MAX_S,
    _StallingStream,
    magnet_summary,
    tried_first,
)
from peer.config import Policy
from peer.routing.router import Router
from peer.routing.trust import TrustLedger
from protocols.summary import decode_summary, encode_summary
from tests.test_router import BS, chain_of, me, summary, table_with


@pytest.mark.parametrize("seq", range(len(CLAIMS)))
def test_its_summaries_are_accepted_and_priced_no_faster_than_ours(seq):
    chain = chain_of(40)
    magnet = magnet_summary(summary("magnet", chain[:10], seq=seq + 1), seq)
    assert decode_summary(encode_summary(magnet)) == magnet  # valid on the wire
    table = table_with(magnet)
    table.record_rtt("magnet", 0.002, 0.0)
    ledger = TrustLedger(probation_requests=0)
    r = Router(Policy.COST, random.Random(0), block_size=BS, trust=ledger, require_rtt=True)
    local = me()
    candidate = next(c for c in r.rank(chain, 40 * BS, 16, local, table, 0.0)
                     if c.peer_id == "magnet")
    assert candidate.estimate.prefill_tokens_per_s <= local.prefill_tokens_per_s
    assert candidate.estimate.decode_tokens_per_s <= local.decode_tokens_per_s


class _Recorder:
    def __init__(self):
        self.written = []
        self.muxed_conn = SimpleNamespace(peer_id="x")

    async def write(self, data):
        self.written.append((trio.current_time(), data))


@pytest.mark.parametrize("stall_at", [0, 1])
async def test_a_stream_stalls_from_its_nth_write(stall_at, autojump_clock):
    inner = _Recorder()
    stream = _StallingStream(inner, stall_at)
    with trio.move_on_after(1.0):
        await stream.write(b"a")
        await stream.write(b"b")
    assert [d for _, d in inner.written] == [b"a", b"b"][:stall_at]
    assert stream.muxed_conn is inner.muxed_conn
    assert STALL_MAX_S > 30.0  # longer than any forward's first-token deadline


def test_tried_first_counts_routes_after_each_entry_charged_the_rogue():
    def outcome(index, entry, *steps):
        return SimpleNamespace(index=index, entry=entry, route=[
            {"peer_id": p, "charged": c, "waited_s": w} for p, c, w in steps])

    outcomes = [
        outcome(0, "e1", ("rogue", 0.5, 0.1), ("h", 0.0, 0.0)),
        outcome(1, "e2", ("h", 0.0, 0.0)),
        outcome(2, "e1", ("rogue", 0.5, 0.2), ("h", 0.0, 0.0)),  # after e1 charged it
        outcome(3, "e2", ("rogue", 0.0, 0.0)),  # e2 never charged it
    ]
    row = tried_first(outcomes, {"rogue"})
    assert row == {"rogue_tried_first": 3, "rogue_tried_first_after_charged": 1,
                   "entries_that_charged_the_rogue": 1, "client_seconds_lost_on_rogue": 0.3}
