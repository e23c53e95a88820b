"""Refused summaries: counted by reason, each (sender, reason) warned of once, within a bound."""

import logging

from peer.swarm.rejections import Rejections


def test_each_sender_and_reason_is_warned_of_once_and_every_refusal_is_counted(caplog):
    log = logging.getLogger("test.rejections")
    rejections = Rejections(log, max_logged=2)
    with caplog.at_level(logging.DEBUG, logger="test.rejections"):
        assert rejections.reject("a", "oversize", "1 byte too many") is False
        rejections.reject("a", "oversize", "again")
        rejections.reject("b", "malformed", "not CBOR")
        rejections.reject("c", "malformed", "past the bound")
        rejections.count("internal_error")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["rejected summary from a: oversize (1 byte too many)",
                      "rejected summary from b: malformed (not CBOR)"]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 2
    assert rejections.counts == {"oversize": 2, "malformed": 2, "internal_error": 1}
    rejections.counts["oversize"] = 99  # a copy: the caller cannot change the counts
    assert rejections.counts["oversize"] == 2
