"""Gossip mode ring's lookup beyond the ring: the shell around peer/swarm/providers.py and
peer/swarm/interest.py, on /prefixswarm/roots/1.0.0 (protocols/roots.py).

Three jobs, each decided in a pure core with only the I/O here: a holder announces its
prefix roots to their homes, a home answers announcements and queries, and an entry
peer looks a prompt's root up before ranking (`before_route`, within the lookup budget
and the request's deadline). docs/protocol.md 5.5 has the protocol and its bounds.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from peer.config import DEFAULT_LOOKUP_WAIT_S
from peer.engine.api import EngineView
from peer.net.wire import (
    BoundedAnswers,
    HandlerHost,
    InboundStream,
    PeerUnreachable,
    StreamOpener,
    WireError,
    read_frame_sized,
    reset_quietly,
)
from peer.swarm.interest import DEFAULT_INTEREST_PEERS, Interest, Lookups
from peer.swarm.peer_table import PeerTable, Verdict
from peer.swarm.providers import Announcement, HomeRing, ProviderIndex, RootAnnouncer
from protocols.errors import RemoteProtocolError
from protocols.framing import encode_frame
from protocols.ids import ROOTS_PROTOCOL

if TYPE_CHECKING:  # trio's TaskStatus, as the trio-stubs py-libp2p pulls in type it
    from trio_typing import TaskStatus
from protocols.roots import (
    MAX_MATCH_BLOCKS,
    MAX_PROVIDERS_PER_REPLY,
    MAX_REPLY_FRAME_BYTES,
    MAX_REQUEST_FRAME_BYTES,
    Ack,
    Announce,
    Find,
    Match,
    Matched,
    Providers,
    Request,
    SummaryQuery,
    SummaryReply,
    decode_ack,
    decode_matched,
    decode_providers,
    decode_request,
    decode_summary_reply,
)
from protocols.summary import decode_summary

logger = logging.getLogger(__name__)

__all__ = ["ANNOUNCE_TIMEOUT_S", "ANSWER_TIMEOUT_S", "RootLookup"]

ANSWER_TIMEOUT_S = 2.0  # a request is one small frame sent right after opening
ANNOUNCE_TIMEOUT_S = 5.0  # an announcement waits for nobody: seconds only on a busy home
MAX_ANSWERING = 64  # concurrent answers; each is ~1 ms of work, more is a flood
MAX_ANNOUNCING = 8  # concurrent announcement streams; the rest wait their turn
# Failures that say "this peer did not answer properly", whatever the layer.
_CALL_FAILED = (WireError, BaseLibp2pError, RemoteProtocolError)


class LookupGossip(Protocol):
    """What the lookup needs of peer/swarm/gossip.py's Gossip (ring mode)."""

    @property
    def neighbours(self) -> frozenset[str]: ...

    def ring_peers(self) -> list[str]: ...

    def last_summary(self) -> bytes | None: ...

    def hear(self, extra: frozenset[str]) -> None: ...


class LookupHost(StreamOpener, Protocol):
    """What the lookup uses of peer.net.host's SwarmHost: streams, and who is connected."""

    def is_connected(self, peer_id: ID) -> bool: ...


class RootLookup:
    """Announces our roots, answers as a home, and looks roots up for our requests."""

    def __init__(
        self,
        host: LookupHost,
        table: PeerTable,
        engine: EngineView,
        gossip: LookupGossip,
        *,
        self_id: str,
        interval_s: float,
        rng: random.Random,
        budget_s: float = DEFAULT_LOOKUP_WAIT_S,
        interest_peers: int = DEFAULT_INTEREST_PEERS,
    ) -> None:
        self._host = host
        self._table = table
        self._engine = engine
        self._gossip = gossip
        self._self_id = self_id
        self._budget_s = budget_s
        self.ring = HomeRing(self_id)
        self.index = ProviderIndex()
        self.announcer = RootAnnouncer()
        self.lookups = Lookups(Interest(interest_peers, interval_s), rng)
        self._roots: list[int] = []
        self._published = trio.Event()
        self._announcing = trio.CapacityLimiter(MAX_ANNOUNCING)
        self.stats: Counter[str] = Counter()
        self._answers = BoundedAnswers("requests", MAX_ANSWERING, ANSWER_TIMEOUT_S, self.stats)

    def serve(self, libp2p_host: HandlerHost) -> None:
        """Register the handler on the libp2p host."""
        libp2p_host.set_stream_handler(TProtocol(ROOTS_PROTOCOL), self.handle_stream)

    def statistics(self) -> dict[str, Any]:
        return {
            **self.stats,
            "interest": sorted(self.lookups.interest.members),
            "roots_held": len(self.announcer.held),
            "roots_indexed": len(self.index),
        }

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Send announcements after each publish until cancelled."""
        task_status.started()
        while True:
            await self._published.wait()
            self._published = trio.Event()
            await self._announce_once()

    # -- holder ---------------------------------------------------------------------

    def on_published(self, roots: list[int]) -> None:
        """Gossip published a summary covering `roots` (the root listener)."""
        self._roots = roots
        self._published.set()

    async def _announce_once(self) -> None:
        now = trio.current_time()
        self.ring.update(self._gossip.ring_peers())
        self.index.expire(now)
        messages = self.announcer.sync(self._roots, self.ring, now)
        async with trio.open_nursery() as nursery:
            for msg in messages:
                if msg.home == self._self_id:
                    self._record(Announce(msg.add, msg.drop), self._self_id, now)
                else:
                    nursery.start_soon(self._send, msg)

    async def _send(self, msg: Announcement) -> None:
        async with self._announcing:
            self.stats["announcements_sent"] += 1
            try:
                with trio.fail_after(ANNOUNCE_TIMEOUT_S):
                    reply, _ = await self._call(msg.home, Announce(msg.add, msg.drop))
                    ack = decode_ack(reply)
            except (*_CALL_FAILED, trio.TooSlowError) as exc:
                self.stats["announcements_failed"] += 1
                logger.debug("announcement to %s failed: %s", msg.home, exc)
                self.ring.refuse(msg.home, trio.current_time())
                self.announcer.failed(msg.home)  # its roots go to the next homes
                return
            if ack.kept < len(msg.add):
                self.stats["announced_roots_refused"] += len(msg.add) - ack.kept

    # -- home -----------------------------------------------------------------------

    def _record(self, msg: Announce, peer_id: str, now: float) -> int:
        for root in msg.drop:
            self.index.withdraw(root, peer_id)
        return sum(self.index.announce(root, peer_id, now) for root in msg.add)

    def _reply(self, request: Request, remote: str) -> Ack | Providers | Matched | SummaryReply:
        now = trio.current_time()
        if isinstance(request, Announce):
            self.stats["announcements_answered"] += 1
            return Ack(self._record(request, remote, now))
        if isinstance(request, Find):
            self.stats["finds_answered"] += 1
            live = self._live_providers(request.root, now)
            return Providers(request.root, tuple(live[:MAX_PROVIDERS_PER_REPLY]))
        if isinstance(request, Match):
            self.stats["matches_answered"] += 1
            return Matched(self._engine.cache.match_hashes(request.chain))
        self.stats["summary_queries_answered"] += 1
        return SummaryReply(self._gossip.last_summary() or b"")

    def _live_providers(self, root: int, now: float) -> list[str]:
        """The root's live records, less holders we hold no connection to (probably gone)."""
        return [
            p for p in self.index.providers(root, now)
            if p == self._self_id or self._host.is_connected(ID.from_base58(p))
        ]

    async def handle_stream(self, stream: InboundStream) -> None:
        """libp2p's stream handler: one request, one reply, within ANSWER_TIMEOUT_S."""
        await self._answers.answer(stream, self._respond)

    async def _respond(self, stream: InboundStream) -> None:
        remote = stream.muxed_conn.peer_id.to_base58()
        frame, size = await read_frame_sized(stream, MAX_REQUEST_FRAME_BYTES)
        self.stats["bytes_in"] += size
        reply = self._reply(decode_request(frame), remote)
        data = encode_frame(reply.to_wire(), MAX_REPLY_FRAME_BYTES)
        await stream.write(data)
        self.stats["bytes_out"] += len(data)

    # -- entry ----------------------------------------------------------------------

    async def before_route(
        self, tokens: Sequence[int], chain: Sequence[int], deadline: float
    ) -> None:
        """Look the prompt's root up unless we hold it or a peer we hear holds the whole
        prompt (`chain`: its block hashes); at most `budget_s` (and never past
        `deadline`). What arrived is in the table when this returns."""
        if not chain:
            return  # no full block: no root
        local = self._engine.local_match_tokens(tokens) // self._engine.block_size
        if local:
            return
        now = trio.current_time()
        root = chain[0]
        rows = self._table.routing_rows(chain, now)
        heard = max((row.match_blocks for row in rows), default=0)
        if not self.lookups.wanted(root, local, heard, len(chain), now):
            return
        self.stats["lookups"] += 1
        with trio.move_on_at(min(deadline, now + self._budget_s)) as scope:
            await self._lookup(root, chain, heard)
        if scope.cancelled_caught:
            self.stats["lookups_out_of_time"] += 1

    async def _providers(self, root: int) -> list[str]:
        """The root's providers from the first of its homes that answers."""
        now = trio.current_time()
        self.ring.update(self._gossip.ring_peers())
        for home in self.ring.homes(root, now):
            if home == self._self_id:
                return self._live_providers(root, now)
            try:
                with trio.fail_after(self._budget_s):
                    reply, _ = await self._call(home, Find(root))
                    return list(decode_providers(reply, root).peers)
            except _CALL_FAILED as exc:
                self.stats["finds_failed"] += 1
                logger.debug("find at %s failed: %s", home, exc)
                self.ring.refuse(home, trio.current_time())
            except trio.TooSlowError:  # the budget is spent: no time for the next home
                self.stats["finds_failed"] += 1
                break
        return []

    async def _lookup(self, root: int, chain: Sequence[int], heard: int) -> None:
        providers = await self._providers(root)
        self.stats["lookups_with_providers"] += bool(providers)
        hood = self._gossip.neighbours
        probed = self.lookups.holders_to_probe(providers, {self._self_id, *hood})
        match = Match(tuple(chain[:MAX_MATCH_BLOCKS]))
        matches: dict[str, int] = {}
        async with trio.open_nursery() as nursery:
            for peer_id in probed:
                nursery.start_soon(self._match, peer_id, match, matches)
        asked = self.lookups.holders_to_ask(matches, heard)
        answered: list[str] = []
        try:
            async with trio.open_nursery() as nursery:
                for peer_id in asked:
                    nursery.start_soon(self._fetch_summary, peer_id, answered)
        finally:  # also when out of time: keep what arrived
            change = self.lookups.admit(
                answered, lambda p: self._table.estimate_match(p, [root]) >= 1, exclude=hood
            )
            if change.added or change.removed:
                self.stats["interest_joined"] += len(change.added)
                self._gossip.hear(self.lookups.interest.members)

    async def _match(self, peer_id: str, match: Match, matches: dict[str, int]) -> None:
        """How much of the chain a holder says it holds (checked by its summary later)."""
        try:
            with trio.fail_after(self._budget_s):
                reply, _ = await self._call(peer_id, match)
            matches[peer_id] = decode_matched(reply, match).blocks
        except (*_CALL_FAILED, trio.TooSlowError) as exc:
            self.stats["matches_failed"] += 1
            logger.debug("match query to %s failed: %s", peer_id, exc)

    async def _fetch_summary(self, peer_id: str, answered: list[str]) -> None:
        """Ask a holder for its summary; apply it as if gossiped by `peer_id` (the
        stream's authenticated peer), with the query's round trip as its RTT."""
        try:
            with trio.fail_after(self._budget_s):
                obj, rtt = await self._call(peer_id, SummaryQuery())
            reply = decode_summary_reply(obj)
            summary = decode_summary(reply.data) if reply.data else None
        except (*_CALL_FAILED, trio.TooSlowError) as exc:
            self.stats["summary_queries_failed"] += 1
            logger.debug("summary query to %s failed: %s", peer_id, exc)
            return
        if summary is None:
            return
        now = trio.current_time()
        result = self._table.apply(summary, peer_id, now, reachable=True)  # it answered
        if not (result.accepted or result.reason is Verdict.STALE_SEQ):
            self.stats[f"summaries_rejected_{result.reason}"] += 1
            return
        self.stats["summaries_fetched"] += 1
        self._table.record_rtt(peer_id, rtt, now)
        answered.append(peer_id)

    # -- the wire -------------------------------------------------------------------

    async def _call(self, peer_id: str, request: Request) -> tuple[object, float]:
        """One request on a new stream: its reply's decoded frame, and the seconds from
        sending to the reply (a round trip, the stream's negotiation left out). The
        caller's deadline bounds it; a WireError, RemoteProtocolError or a libp2p error
        otherwise."""
        try:
            remote = ID.from_base58(peer_id)
        except ValueError as exc:
            raise PeerUnreachable(f"not a peer id: {peer_id!r}") from exc
        left = trio.current_effective_deadline() - trio.current_time()
        stream = await self._host.new_stream(
            remote, [ROOTS_PROTOCOL], timeout_s=max(0.0, min(left, ANNOUNCE_TIMEOUT_S))
        )
        self.stats["requests_sent"] += 1
        try:
            sent = trio.current_time()
            data = encode_frame(request.to_wire(), MAX_REQUEST_FRAME_BYTES)
            await stream.write(data)
            self.stats["bytes_out"] += len(data)
            reply, size = await read_frame_sized(stream, MAX_REPLY_FRAME_BYTES)
            self.stats["bytes_in"] += size
            return reply, trio.current_time() - sent
        finally:
            await reset_quietly(stream)
