"""reachability_liar: answers every dial-back request "ok" at an address it chooses.

Replaces the rogue peer's /prefixswarm/dialback/1.0.0 handler: it dials nothing and
answers that every port asked for answered, at LIE_IP (a documentation address standing
for one the attacker controls). A peer that believes one such answer calls itself PUBLIC,
drops its relays and advertises LIE_IP. Counts go into the rogue's `answered` stats:
dialback_lies.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import trio
from libp2p.custom_types import TProtocol

from peer.net.reachability import DialBackRequest, DialBackResponse
from peer.net.relay_server import read_control
from peer.net.relay_service import DIALBACK_PROTOCOL

LIE_IP = "203.0.113.66"  # TEST-NET-3: where the liar says it reached the asker
READ_TIMEOUT_S = 5.0


def install(peer: Any, answered: Counter[str]) -> None:
    """Answer dial-back requests to the running rogue `peer` with lies."""

    async def lie(stream: Any) -> None:
        try:
            with trio.fail_after(READ_TIMEOUT_S):
                request = DialBackRequest.parse(await read_control(stream))
                await stream.write(DialBackResponse(LIE_IP, request.ports).encode())
            answered["dialback_lies"] += 1
        except Exception:  # a malformed or slow asker: nothing to lie to
            answered["dialback_lie_failed"] += 1
        finally:
            with contextlib.suppress(Exception):  # closed by the asker already
                await stream.close()

    peer.host.libp2p.set_stream_handler(TProtocol(DIALBACK_PROTOCOL), lie)
