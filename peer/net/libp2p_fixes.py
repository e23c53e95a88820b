"""Process-wide fixes to py-libp2p 0.8.1, applied by `peer.net.host.open_host`, not on import.

Each fix is marked `WORKAROUND(n)` with n the number of the problem in docs/libp2p.md,
or a name for problems found in this project. `apply()` is idempotent. It applies a fix
only when the installed py-libp2p is the pinned version and the fix's target exists
with the expected signature; otherwise it logs one warning line saying which fix it
skipped and why, and the peer runs on unpatched py-libp2p. An application embedding a
peer keeps its own logging configuration: only py-libp2p's own loggers are touched.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import libp2p.network.connection.swarm_connection as _libp2p_swarm_connection
import libp2p.network.swarm as _libp2p_swarm
import trio
from google.protobuf.message import DecodeError
from libp2p.abc import INetStream
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID
from libp2p.protocol_muxer.multiselect_client import MultiselectClient
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.stream_muxer.yamux.yamux import YamuxStream

from peer.net import (
    cancel_safe,
    gossipsub_fixes,
    pipelined_select,
    pubsub_hello,
    received_record,
    sent_record,
)

__all__ = [
    "PINNED_LIBP2P_VERSION",
    "WINDOW_GIVE_BACK_FRACTION",
    "Fix",
    "apply",
    "fixes",
]

logger = logging.getLogger(__name__)

PINNED_LIBP2P_VERSION = "0.8.1"  # pyproject.toml pins it; every fix was written against it
RESET_TIMEOUT_S = 5.0  # resetting a stream is local work plus a best-effort frame
NURSERY_CLOSED = "Nursery is closed to new arrivals"  # trio's RuntimeError once a nursery exits
WINDOW_GIVE_BACK_FRACTION = 0.25  # of a yamux stream's window, consumed before it is given
#   back in one update: at least 192 kB stay open to the sender, 4x our largest message
#   (a writer that ran out of window mid-message could interleave with another's frames)


@dataclass(frozen=True)
class Fix:
    """One patch: `problem()` says why it cannot apply here (None: it can), `applied()`
    whether it already is, `patch()` applies it."""

    name: str
    problem: Callable[[], str | None]
    applied: Callable[[], bool]
    patch: Callable[[], None]


def installed_libp2p_version() -> str:
    try:
        return importlib.metadata.version("libp2p")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def apply(version: str | None = None) -> list[str]:
    """Apply every fix not yet applied whose target is as expected; idempotent.

    Returns the names of the fixes now in force. With a py-libp2p other than
    PINNED_LIBP2P_VERSION (`version` defaults to the installed one) nothing is patched
    and one warning line says so."""
    version = installed_libp2p_version() if version is None else version
    if version != PINNED_LIBP2P_VERSION:
        logger.warning(
            "py-libp2p %s is installed; prefixswarm's fixes were written for %s and are "
            "skipped (%s): expect slower dials, log noise and less robust pubsub",
            version, PINNED_LIBP2P_VERSION, ", ".join(f.name for f in fixes()),
        )
        return []
    in_force = []
    for fix in fixes():
        if not fix.applied():
            problem = fix.problem()
            if problem is not None:
                logger.warning("py-libp2p fix %s skipped: %s", fix.name, problem)
                continue
            fix.patch()
        in_force.append(fix.name)
    return in_force


def fixes() -> list[Fix]:
    """Every fix, in the order `apply()` tries them."""
    return [
        # WORKAROUND(1): every dial waits the full 250 ms happy-eyeballs head start even
        # when it succeeds (swarm.dial_peer uses this module global); 0 gives ~10 ms dials.
        Fix(
            "happy-eyeballs-delay",
            lambda: _expect_attribute(_libp2p_swarm, "_HAPPY_EYEBALLS_DELAY", float),
            lambda: getattr(_libp2p_swarm, "_HAPPY_EYEBALLS_DELAY", None) == 0.0,
            _no_happy_eyeballs_delay,
        ),
        # WORKAROUND(logging): `import libp2p` sets propagate=False on the "libp2p" logger
        # with no handler, so its warnings go to Python's last-resort stderr handler and
        # bypass the application's logging configuration. Let them propagate instead;
        # LIBP2P_DEBUG (libp2p's own switch) keeps its handlers when set.
        Fix(
            "logger-propagation",
            lambda: None,
            lambda: logging.getLogger("libp2p").propagate or bool(os.environ.get("LIBP2P_DEBUG")),
            _propagate_libp2p_logs,
        ),
        # WORKAROUND(logging): the auto-connector forces its logger to INFO at import and
        # then logs "initiating 200 new dials" every 10 s while a swarm has < 50
        # connections. Reset to NOTSET (inherit "libp2p"'s level) while it is still INFO.
        Fix(
            "auto-connector-log-level",
            lambda: None,
            lambda: _auto_connector_logger().level != logging.INFO,
            lambda: _auto_connector_logger().setLevel(logging.NOTSET),
        ),
        # WORKAROUND(logging): swarm_connection calls module-level `logging.debug(...)`,
        # which runs logging.basicConfig() on the root logger as a side effect (a stderr
        # handler appears in every program that uses us). Route it to a named logger.
        Fix(
            "swarm-connection-root-logging",
            lambda: _expect_attribute(_libp2p_swarm_connection, "logging", type(logging)),
            lambda: isinstance(getattr(_libp2p_swarm_connection, "logging", None), _NamedLogging),
            _named_swarm_connection_logging,
        ),
        # WORKAROUND(pubsub-decode): Pubsub.continuously_read_stream parses every inbound
        # RPC with protobuf but does not catch DecodeError. One undecodable RPC from any
        # remote peer escapes the stream handler, fails the connection's task group and
        # tears down the whole host (seen: a peer's host dying mid-test). Reset that
        # stream instead. The same reader, stopping with pubsub, raises trio's "closed
        # nursery" RuntimeError the same way: that one ends the reader quietly.
        Fix(
            "pubsub-decode",
            lambda: _expect_parameters(Pubsub, "continuously_read_stream", ("self", "stream")),
            lambda: _marked(Pubsub.continuously_read_stream, "_prefixswarm_guarded"),
            _guard_pubsub_decode,
        ),
        # WORKAROUND(blacklist-teardown): blacklisting a connected peer runs
        # Pubsub._teardown_if_connected, which resets the peer's stream (a wait) and then
        # deletes it from `peers` by key. When the connection's own death removed it
        # meanwhile, that `del` raises KeyError, the Pubsub service fails and the whole
        # host with it (seen: an honest peer dying as it graylisted a flooding stranger,
        # tests/test_gossip_gate_swarm.py). Forget the peer whether or not it is there.
        Fix(
            "blacklist-teardown",
            lambda: _expect_parameters(Pubsub, "_teardown_if_connected", ("self", "peer_id")),
            lambda: _marked(Pubsub._teardown_if_connected, "_prefixswarm"),
            _teardown_whether_or_not_connected,
        ),
        # WORKAROUND(yamux-window): py-libp2p's yamux answers nearly every read with a
        # WINDOW_UPDATE frame (window auto-tuning, "release on read"): one more encrypted
        # frame and socket write per message received, a large share of a gossiping
        # peer's CPU. go-yamux gives the window back once half of it was consumed; we do
        # at a quarter (WINDOW_GIVE_BACK_FRACTION) and keep the 256 kB window (no
        # auto-tuning: our frames are small).
        Fix(
            "yamux-window",
            _yamux_window_problem,
            lambda: _marked(YamuxStream._auto_tune_and_send_window_update, "_prefixswarm"),
            _give_back_window_in_batches,
        ),
        # WORKAROUND(signed-record): every pubsub RPC carries the sender's signed peer
        # record, and py-libp2p verifies and stores it again on every RPC, twice when the
        # RPC holds control messages (Pubsub's reader, then GossipSub.handle_rpc): an
        # ed25519 verification, three protobuf parses and a rewrite of the peer's
        # addresses each time, most of gossip's CPU. A record byte-identical to the one
        # last accepted from the same peer within a minute is accepted as before
        # (peer/net/received_record.py).
        Fix(
            "signed-record",
            received_record.problem,
            received_record.installed,
            received_record.install,
        ),
        # WORKAROUND(hello-race): a topic joined or left while a pubsub stream is being
        # opened is missing from that peer's hello and from the announcement, which goes
        # only to peers registered already: the peer never learns it, so our meshes
        # never form (peer/net/pubsub_hello.py).
        Fix("hello-race", pubsub_hello.problem, pubsub_hello.installed, pubsub_hello.install),
        # WORKAROUND(prune-backoff): a peer that sends a PRUNE does not put the pruned
        # peer in back-off on its own side (go-libp2p does): neither the heartbeat that
        # trims a mesh over D_high nor the PRUNE answering an unwanted GRAFT. Its next
        # heartbeat may graft the same peer again within seconds; that peer, in back-off
        # for us since our PRUNE, takes the GRAFT for a flood and prunes us back, again
        # without a back-off of its own: PRUNE/GRAFT ping-pong until every peer is in
        # back-off, meshes empty or split into cliques (a triangle is stable at D_low 2)
        # and summaries stop crossing. Every PRUNE we send now backs us off too. Both
        # sides then graft only after the back-off plus a slack but accept a GRAFT once
        # the back-off itself is over: a side holding out longer than the other waits
        # refuses each GRAFT with a PRUNE that renews both back-offs, and that pair
        # never meshes again (seen: 2 of 6 loopback hosts left with empty meshes).
        Fix(
            "prune-backoff",
            _prune_backoff_problem,
            lambda: all(
                _marked(m, "_prefixswarm")
                for m in (
                    GossipSub.mesh_heartbeat,
                    GossipSub.emit_prune,
                    GossipSub.handle_prune,
                    GossipSub.handle_graft,
                )
            ),
            gossipsub_fixes.back_off_from_peers_we_prune,
        ),
        # WORKAROUND(opportunistic-graft): GossipSub grafts up to 2 more peers at every
        # heartbeat that finds the mesh at D_low or more, choosing peers whose score is at
        # least the mesh's (go-libp2p: strictly above the median, once a minute, only
        # when the median is low). Our score weights are 0, every score is 0, so every
        # heartbeat grafts 2 and the next prunes back to D: the mesh never settles. We do
        # not score peers, so opportunistic grafting has nothing to go by: it is off.
        Fix(
            "opportunistic-graft",
            lambda: _expect_parameters(
                GossipSub, "_perform_opportunistic_grafting", ("self", "topic", "peers_to_graft")
            ),
            lambda: _marked(GossipSub._perform_opportunistic_grafting, "_prefixswarm"),
            gossipsub_fixes.no_opportunistic_grafting,
        ),
        # WORKAROUND(gossip-backoff): IHAVE gossip (what lets a peer outside our mesh
        # fetch a message it missed) skips every peer in prune back-off. After mesh churn
        # those are exactly the peers on the other side of a split, so the split is not
        # healed by gossip either. Offer IHAVE to every gossipsub peer of the topic
        # outside the mesh, back-off or not (as go-libp2p's emitGossip).
        Fix(
            "gossip-backoff",
            lambda: _expect_parameters(GossipSub, "gossip_heartbeat", ("self",)),
            lambda: _marked(GossipSub.gossip_heartbeat, "_prefixswarm"),
            gossipsub_fixes.gossip_to_backed_off_peers,
        ),
        # WORKAROUND(sent-record): every RPC carries our signed peer record, and py-libp2p
        # rebuilds and compares it on each one (our addresses, a parse of the record's,
        # the envelope serialised again): several times per summary received. Rebuilt
        # at most once per RECHECK_S (peer/net/sent_record.py).
        Fix("sent-record", sent_record.problem, sent_record.installed, sent_record.install),
        # WORKAROUND(noise-write): a Noise write encrypts (the nonce moves on) and then
        # awaits the socket; cancelled there, it has sent nothing, the peer cannot
        # authenticate the next message and drops the connection with all its streams.
        # Encrypt and send shielded, or not at all (peer/net/cancel_safe.py).
        Fix(
            "noise-write",
            cancel_safe.noise_write_problem,
            cancel_safe.noise_write_installed,
            cancel_safe.install_noise_write,
        ),
        # WORKAROUND(yamux-open): Yamux.open_stream gives its backlog slot back when the
        # SYN fails with an Exception, not when it is cancelled: each cancelled open leaks
        # one of the connection's 256 slots, and then no stream opens on it. Reset the
        # stream (or give the slot back) on any failure (peer/net/cancel_safe.py).
        Fix(
            "yamux-open",
            cancel_safe.open_stream_problem,
            cancel_safe.open_stream_installed,
            cancel_safe.install_open_stream,
        ),
        # WORKAROUND(select-rtt): protocol negotiation waits for the multistream header's
        # echo before proposing a protocol: two round trips before every new stream
        # carries a byte. Send both at once (peer/net/pipelined_select.py).
        Fix(
            "select-rtt",
            lambda: _expect_parameters(
                MultiselectClient, "select_one_of",
                ("self", "protocols", "communicator", "negotiate_timeout")),
            pipelined_select.installed,
            pipelined_select.install,
        ),
    ]


# -- checks ------------------------------------------------------------------------------


def _expect_attribute(module: Any, name: str, kind: type) -> str | None:
    value = getattr(module, name, None)
    if not isinstance(value, kind):
        return f"{module.__name__}.{name} is {type(value).__name__}, expected {kind.__name__}"
    return None


def _parameters(function: Any) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None


def _expect_parameters(owner: Any, name: str, expected: tuple[str, ...]) -> str | None:
    target = getattr(owner, name, None)
    if target is None:
        return f"{owner.__name__}.{name} is missing"
    found = _parameters(target)
    if found != expected:
        return f"{owner.__name__}.{name} takes {found}, expected {expected}"
    return None


def _marked(function: Any, marker: str) -> bool:
    return bool(getattr(function, marker, False))


def _yamux_window_problem() -> str | None:
    problem = _expect_parameters(
        YamuxStream, "_auto_tune_and_send_window_update", ("self", "bytes_read")
    )
    if problem is None and "skip_lock" not in (_parameters(YamuxStream.send_window_update) or ()):
        problem = "YamuxStream.send_window_update takes no skip_lock"
    return problem


def _prune_backoff_problem() -> str | None:
    return (
        _expect_parameters(GossipSub, "mesh_heartbeat", ("self",))
        or _expect_parameters(
            GossipSub, "emit_prune", ("self", "topic", "to_peer", "do_px", "is_unsubscribe")
        )
        or _expect_parameters(GossipSub, "handle_prune", ("self", "prune_msg", "sender_peer_id"))
        or _expect_parameters(GossipSub, "handle_graft", ("self", "graft_msg", "sender_peer_id"))
        or _expect_parameters(
            GossipSub,
            "_add_back_off",
            ("self", "peer", "topic", "is_unsubscribe", "backoff_duration"),
        )
    )


# -- patches -----------------------------------------------------------------------------


def _no_happy_eyeballs_delay() -> None:
    _libp2p_swarm._HAPPY_EYEBALLS_DELAY = 0.0


def _propagate_libp2p_logs() -> None:
    logging.getLogger("libp2p").propagate = True


def _auto_connector_logger() -> logging.Logger:
    return logging.getLogger("libp2p.network.auto_connector")


def _named_swarm_connection_logging() -> None:
    _libp2p_swarm_connection.logging = _NamedLogging(  # type: ignore[attr-defined,assignment]
        logging.getLogger(_libp2p_swarm_connection.__name__)
    )


def _guard_pubsub_decode() -> None:
    Pubsub.continuously_read_stream = _guard_pubsub_reader(  # type: ignore[method-assign]
        Pubsub.continuously_read_stream
    )


def _teardown_whether_or_not_connected() -> None:
    Pubsub._teardown_if_connected = _teardown_if_connected  # type: ignore[method-assign]


async def _teardown_if_connected(self: Pubsub, peer_id: ID) -> None:
    """Pubsub._teardown_if_connected, with the peer's entry gone by the time the reset
    returns taken as done rather than raised."""
    stream = self.peers.get(peer_id)
    if stream is not None:
        with trio.move_on_after(RESET_TIMEOUT_S):
            try:
                await stream.reset()
            except Exception as exc:
                logger.debug("resetting %s's pubsub stream: %s", peer_id, exc)
        self.peers.pop(peer_id, None)
    self._forget_all_subscriptions(peer_id)


_teardown_if_connected._prefixswarm = True  # type: ignore[attr-defined]


def _give_back_window_in_batches() -> None:
    YamuxStream._auto_tune_and_send_window_update = (  # type: ignore[method-assign]
        _window_update_at_half
    )


async def _window_update_at_half(self: YamuxStream, *, bytes_read: int = 0) -> None:
    async with self.window_lock:
        self._pending_recv_release += bytes_read
        pending: int = self._pending_recv_release
        if pending < self.target_recv_window * WINDOW_GIVE_BACK_FRACTION:
            return
        self._pending_recv_release = 0
        self.recv_window += pending
    await self.send_window_update(pending, skip_lock=True)


_window_update_at_half._prefixswarm = True  # type: ignore[attr-defined]


def _guard_pubsub_reader(read_stream: Any) -> Any:
    async def guarded(self: Pubsub, stream: INetStream) -> None:
        # py-libp2p refuses to open streams to a blacklisted peer but reads the streams
        # it opens to us: refuse those too (peer/swarm/gossip_gate.py graylists)
        if self.is_peer_blacklisted(stream.muxed_conn.peer_id):
            with trio.move_on_after(RESET_TIMEOUT_S):
                await _reset_quietly(stream)
            return
        try:
            await read_stream(self, stream)
        except (DecodeError, ValueError) as exc:
            peer = stream.muxed_conn.peer_id
            logger.warning("pubsub: undecodable RPC from %s (%s); resetting its stream", peer, exc)
            with trio.move_on_after(RESET_TIMEOUT_S):
                await _reset_quietly(stream)
        except RuntimeError as exc:
            # A message read while pubsub stops: its service's task nursery has closed,
            # and scheduling the message's handling there raised through the connection
            # and out of the host (seen once, a peer stopping in tests/test_mdns.py)
            if str(exc) != NURSERY_CLOSED:
                raise
            logger.debug("pubsub: stopping; a message from %s left unhandled",
                         stream.muxed_conn.peer_id)

    guarded._prefixswarm_guarded = True  # type: ignore[attr-defined]
    return guarded


async def _reset_quietly(stream: INetStream) -> None:
    try:
        await stream.reset()
    except BaseLibp2pError as exc:  # already reset or closed by the other side
        logger.debug("resetting stream: %s", exc)


class _NamedLogging:
    """Stands in for the `logging` module inside one libp2p module."""

    def __init__(self, named: logging.Logger) -> None:
        self.debug = named.debug
        self.info = named.info
        self.warning = named.warning
        self.error = named.error
        self.exception = named.exception

    def __getattr__(self, name: str) -> object:
        return getattr(logging, name)
