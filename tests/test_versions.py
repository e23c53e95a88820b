"""Software versions in summaries: which peers run older software, and a leaving peer."""

from __future__ import annotations

import pytest

from peer.swarm.peer_table import PeerTable, Verdict
from peer.version import is_older, release
from tests.test_summary import make_summary


@pytest.mark.parametrize(
    "software,numbers",
    [("prefixswarm/0.1.0", (0, 1, 0)), ("prefixswarm/1.12.3+local.abc", (1, 12, 3)),
     ("prefixswarm/0+unknown", (0,)), ("prefixswarm/2.0rc1", (2, 0)), ("", ())],
)
def test_release(software: str, numbers: tuple[int, ...]) -> None:
    assert release(software) == numbers


def test_older() -> None:
    assert is_older("prefixswarm/0.1.0", "prefixswarm/0.2.0")
    assert is_older("prefixswarm/0.9.9", "prefixswarm/0.10.0")  # numbers, not text
    assert is_older("", "prefixswarm/0.1.0")  # a peer that does not say
    assert not is_older("prefixswarm/0.2.0", "prefixswarm/0.2.0")
    assert not is_older("prefixswarm/0.3.0", "prefixswarm/0.2.0")


def test_a_leaving_summary_drops_the_peer_at_once() -> None:
    table = PeerTable("self", model_id="HuggingFaceTB/SmolLM2-135M-Instruct", block_size=16,
                      expiry_s=6.0)
    first = make_summary(seq=1)
    peer = first.peer_id
    assert table.apply(first, peer, 0.0).reason is Verdict.NEW_PEER
    stale = make_summary(seq=1, leaving=True)  # a replay of an old seq changes nothing
    assert table.apply(stale, peer, 0.5).reason is Verdict.STALE_SEQ
    assert table.get(peer, 0.5) is not None
    result = table.apply(make_summary(seq=2, leaving=True, software="prefixswarm/0.1.0"),
                         peer, 1.0)
    assert result.accepted and result.reason is Verdict.LEFT
    assert table.get(peer, 1.0) is None and len(table) == 0
    assert table.apply(make_summary(seq=3), peer, 2.0).reason is Verdict.NEW_PEER  # back
