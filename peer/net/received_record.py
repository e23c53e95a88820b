"""The signed peer record on every received RPC, verified again only when it changed.

Every pubsub RPC carries the sender's signed peer record, and py-libp2p 0.8.1 verifies
and stores it again on each one, twice when the RPC holds control messages (Pubsub's
reader, then GossipSub.handle_rpc): an ed25519 verification, three protobuf parses and a
rewrite of the peer's addresses each time, most of gossip's CPU. A record byte-identical
to the one last accepted from the same peer by the same host within `RECHECK_S` is
accepted as before. The mirror of peer/net/sent_record.py (the record we send).
Installed by peer/net/libp2p_fixes.py (WORKAROUND(signed-record)).
"""

from __future__ import annotations

import inspect
import time
from collections import OrderedDict
from typing import Any

import libp2p.pubsub.gossipsub as _libp2p_gossipsub
import libp2p.pubsub.pubsub as _libp2p_pubsub
from libp2p.abc import IHost
from libp2p.peer.id import ID

__all__ = ["MAX_REMEMBERED", "RECHECK_S", "install", "installed", "problem", "remembering"]

RECHECK_S = 60.0  # an unchanged peer record is verified and stored again this often (its
#   addresses' TTL is 2 h): a peer's record changes only with its addresses
MAX_REMEMBERED = 1024  # (host, peer) pairs remembered: far more than a swarm's peers
MARKER = "_prefixswarm_memo"
MODULES = (_libp2p_pubsub, _libp2p_gossipsub)  # each imported maybe_consume_signed_record


def remembering(consume: Any, clock: Any = time.monotonic) -> Any:
    """`consume(msg, host, peer_id)` (maybe_consume_signed_record's signature), skipped
    for a record byte-identical to the one it last accepted for that (host, peer)
    within RECHECK_S; a rejected record is never remembered."""
    # (our host's id, the sender's id) -> (record bytes, when accepted); LRU-bounded
    accepted: OrderedDict[tuple[ID, ID], tuple[bytes, float]] = OrderedDict()

    def remembered(msg: Any, host: IHost, peer_id: ID) -> bool:
        if not msg.HasField("senderRecord"):
            return True
        record: bytes = msg.senderRecord
        key = (host.get_id(), peer_id)
        now = clock()
        last = accepted.get(key)
        if last is not None and last[0] == record and now - last[1] < RECHECK_S:
            return True
        ok: bool = consume(msg, host, peer_id)
        if ok:
            accepted[key] = (record, now)
            accepted.move_to_end(key)
            while len(accepted) > MAX_REMEMBERED:
                accepted.popitem(last=False)
        return ok

    setattr(remembered, MARKER, True)
    return remembered


def install() -> None:
    memo = remembering(getattr(_libp2p_pubsub, "maybe_consume_signed_record"))  # noqa: B009
    for module in MODULES:
        setattr(module, "maybe_consume_signed_record", memo)  # noqa: B010


def installed() -> bool:
    return all(getattr(getattr(m, "maybe_consume_signed_record", None), MARKER, False)
               for m in MODULES)


def problem() -> str | None:
    """Why the fix cannot go in (a module lost the function or it takes other arguments)."""
    for module in MODULES:
        target = getattr(module, "maybe_consume_signed_record", None)
        if target is None or not callable(target):
            return f"{module.__name__}.maybe_consume_signed_record is missing"
        names = tuple(inspect.signature(target).parameters)
        if names != ("msg", "host", "peer_id"):
            return f"{module.__name__}.maybe_consume_signed_record takes {names}"
    return None
