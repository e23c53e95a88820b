"""Upgrading a relayed peer to a direct connection: the trio shell around peer/net/punch.py.

`/prefixswarm/holepunch/1.0.0` runs on a stream through our relay (peer/net/relay_service.py carries
it). When this peer opens a relayed stream to a peer (SwarmHost.new_stream calls
`note_relayed`), it starts one upgrade in the background, bounded per peer by
punch.Attempts: reversal when we are publicly dialable (the other side dials us),
simultaneous open when both are behind NAT (both dial at once from their listen ports;
py-libp2p 0.8.1's TCP listener and `dial_addr(source=...)` set SO_REUSEPORT, and
`Swarm.dial_addr_as_responder` upgrades a dialled socket as the listener). A new
connection lands in libp2p's swarm, whose `new_stream` reuses any connection to a peer id:
the next stream to that peer goes direct and the relay is no longer used.

Either side dials only where the other was observed (peer/net/punch_policy.py): the relay
carrying the punch says where it sees the other side (peer/net/observed.py). A responder
serves punches only when they arrive through a relay it reserved a slot on, within a
budget per relay (`PunchBudget`, the relay's id being the one its connection proves).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from peer.net.observed import (
    OBSERVED_PROTOCOL,
    ask_observed,
    connection_ips,
    interface_networks,
    read_control,
    serve_observed,
)
from peer.net.punch import (
    MAX_ADDRS,
    MAX_SYNC_DELAY_S,
    Attempts,
    Connect,
    Mechanism,
    Result,
    Role,
    Sync,
    choose_mechanism,
    dialable_tcp,
    parse_message,
    role_of,
    sync_delay,
)
from peer.net.punch_policy import MAX_PUNCH_DIALS, DialPlan, PunchBudget, plan_dials
from peer.net.reachability import Reachability, relay_of
from protocols.errors import RemoteProtocolError

logger = logging.getLogger(__name__)

HOLEPUNCH_PROTOCOL = "/prefixswarm/holepunch/1.0.0"
CONTROL_TIMEOUT_S = 5.0  # one control message each way through a relay
DIAL_TIMEOUT_S = 5.0  # one direct dial and its upgrade (a dropped SYN is resent at 1 s, 3 s)
UPGRADE_TIMEOUT_S = 30.0  # one whole upgrade: control round trips and its dials
UPGRADES_AT_ONCE = 4  # upgrades we run, as initiator and as responder together
MAX_UPGRADED_REMEMBERED = 256  # last upgrade per peer, for statistics and /v1/swarm


async def _read(stream: Any) -> object:
    return parse_message(await read_control(stream))


async def _close(stream: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.close()
        except Exception as exc:  # reset, EOF, closed: muxers vary
            logger.debug("closing hole-punch stream: %r", exc)


def tcp_source(listen_addrs: Sequence[str]) -> tuple[str, int] | None:
    """(ip, port) of the first IPv4 TCP listen address: where punching dials come from."""
    for addr in listen_addrs:
        parts = str(addr).split("/")
        if len(parts) >= 5 and parts[1:4:2] == ["ip4", "tcp"] and parts[4].isdigit():
            port = int(parts[4])
            if port:
                return parts[2], port
    return None


def carrier_of(stream: Any) -> ID:
    """The peer at the far end of the connection a stream runs on: the relay for a
    relayed (end-to-end secured) stream, else the remote itself."""
    relay: ID | None = getattr(stream, "relay", None)
    return relay if relay is not None else stream.muxed_conn.peer_id


def direct_remote(host: Any, peer_id: ID) -> str | None:
    """'ip:port' of a direct connection to the peer (what the socket says), else None."""
    for conn in host.libp2p.get_network().get_connections(peer_id):
        try:
            remote = conn.muxed_conn.get_remote_address()
        except (AttributeError, OSError):  # a connection closing under us
            continue
        if remote:
            return f"{remote[0]}:{remote[1]}"
    return None


class HolePunch:
    """Direct-connection upgrades for peers we reach through a relay."""

    def __init__(self, host: Any, *, listen_addrs: Sequence[str]) -> None:
        self._host = host  # peer.net.host.SwarmHost
        self._source = tcp_source(listen_addrs)
        self._attempts = Attempts()  # as initiator
        self._served = Attempts()  # as responder: one at a time per claimed initiator
        self._budget = PunchBudget()  # as responder: punches per relay that carried them
        self._slots = trio.Semaphore(UPGRADES_AT_ONCE)
        self._observed: OrderedDict[str, frozenset[str]] = OrderedDict()  # the last plan's IPs
        self._nursery: trio.Nursery | None = None
        self.stats: Counter[str] = Counter()
        self.upgraded: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def statistics(self) -> dict[str, Any]:
        return {
            "source": f"{self._source[0]}:{self._source[1]}" if self._source else None,
            **{f"holepunch_{k}": v for k, v in sorted(self.stats.items())},
            "upgraded": dict(self.upgraded),
        }

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._host.libp2p.set_stream_handler(TProtocol(HOLEPUNCH_PROTOCOL), self._handle)
        self._host.libp2p.set_stream_handler(TProtocol(OBSERVED_PROTOCOL), self._handle_observed)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def note_relayed(self, peer_id: ID) -> None:
        """A relayed stream to `peer_id` just opened: try to upgrade, if the budget allows."""
        if self._nursery is None or self._host.is_connected(peer_id):
            return
        if self._attempts.try_start(peer_id.to_base58(), trio.current_time()):
            self._nursery.start_soon(self._upgrade, peer_id)

    # -- initiator -------------------------------------------------------------------------

    async def _upgrade(self, peer_id: ID) -> None:
        key, ok = peer_id.to_base58(), False
        try:
            async with self._slots:
                with trio.move_on_after(UPGRADE_TIMEOUT_S):
                    ok = await self._initiate(peer_id)
        except (RemoteProtocolError, trio.TooSlowError, LookupError) as exc:
            logger.debug("upgrade to %s: %s", peer_id, exc)
        except Exception as exc:  # a relayed stream that broke: muxers raise many types
            logger.debug("upgrade to %s: %r", peer_id, exc)
        finally:
            self._attempts.finished(key, ok=ok, now=trio.current_time())
        if not ok:
            self.stats["upgrades_failed"] += 1

    def _my_addrs(self, public: bool) -> list[str]:
        reach = self._host.reach
        now = trio.current_time()
        addrs = reach.tracker.confirmed_addrs(now) if public else reach.tracker.observed_addrs(now)
        return [a for a in addrs if dialable_tcp(a)][:MAX_ADDRS]

    async def _initiate(self, peer_id: ID) -> bool:
        reach = self._host.reach
        public = reach.verdict() is Reachability.PUBLIC
        wanted = Mechanism.REVERSAL if public else Mechanism.SIMULTANEOUS_OPEN
        if wanted is Mechanism.SIMULTANEOUS_OPEN and self._source is None:
            self.stats["skipped_no_listen_port"] += 1
            return False
        self.stats[f"{wanted}_tried"] += 1
        stream = await reach.open_relayed(peer_id, HOLEPUNCH_PROTOCOL, timeout_s=CONTROL_TIMEOUT_S)
        try:
            with trio.fail_after(CONTROL_TIMEOUT_S):
                sent_at = trio.current_time()
                me = self._host.peer_id.to_base58()
                hello = Connect(tuple(self._my_addrs(public)), wanted, me)
                await stream.write(hello.encode())
                answer = await _read(stream)
                rtt = trio.current_time() - sent_at
            if not isinstance(answer, Connect) or answer.mechanism is not None:
                raise RemoteProtocolError(f"expected the responder's Connect, got {answer!r}")
            plan = DialPlan(())
            if not public:  # we dial too: only where our relay sees the responder
                plan = await self._plan(carrier_of(stream), peer_id, answer.addrs)
            mechanism = choose_mechanism(initiator_public=public, responder_addrs=len(plan.targets))
            if mechanism is None:
                self.stats["skipped_no_addrs"] += 1
                return False
            if mechanism is Mechanism.REVERSAL:
                with trio.fail_after(CONTROL_TIMEOUT_S + DIAL_TIMEOUT_S * MAX_PUNCH_DIALS):
                    result = await _read(stream)
                if not isinstance(result, Result):
                    raise RemoteProtocolError(f"expected a Result, got {result!r}")
                ok = result.ok and self._host.is_connected(peer_id)
            else:
                with trio.fail_after(CONTROL_TIMEOUT_S):
                    await stream.write(Sync().encode())
                await trio.sleep(sync_delay(rtt))
                ok = await self._dial(peer_id, plan, role_of(initiator=True))
        finally:
            await _close(stream)
        self._record(peer_id, mechanism, ok)
        return ok

    # -- responder -------------------------------------------------------------------------

    def _our_relays(self) -> set[str]:
        """Relays we hold a reservation on: the only carriers whose punches we serve."""
        return {r for a in self._host.reach.relayed_addrs() if (r := relay_of(a)) is not None}

    def _admit(self, carrier: ID, initiator: ID) -> str | None:
        """Why a punch carried by `carrier` for `initiator` is refused, or None."""
        if carrier == initiator or self._host.is_connected(initiator):
            return "already_direct"  # a direct connection exists: nothing to dial
        if carrier.to_base58() not in self._our_relays():
            return "not_our_relay"  # only our relays carry punches to us
        if not self._budget.try_take(carrier.to_base58(), trio.current_time()):
            return "budget"
        return None

    async def _handle(self, stream: Any) -> None:
        initiator: str | None = None
        try:
            with trio.fail_after(CONTROL_TIMEOUT_S):
                hello = await _read(stream)
            if not isinstance(hello, Connect) or hello.mechanism is None:
                raise RemoteProtocolError(f"expected the initiator's Connect, got {hello!r}")
            try:
                peer_id = ID.from_base58(hello.peer_id)
            except Exception as exc:  # base58/multihash raise assorted types
                raise RemoteProtocolError(f"not a peer id: {hello.peer_id!r}") from exc
            if peer_id == self._host.peer_id:
                raise RemoteProtocolError("a hole punch to ourselves")
            if getattr(stream, "relay", None) is not None and stream.muxed_conn.peer_id != peer_id:
                raise RemoteProtocolError("the Connect names another peer than the one proven")
            refusal = self._admit(carrier_of(stream), peer_id)
            if refusal is not None:
                self.stats[f"refused_{refusal}"] += 1
                return
            initiator = hello.peer_id
            if not self._served.try_start(initiator, trio.current_time()):
                self.stats["refused_budget"] += 1
                initiator = None
                return
            ok = False
            try:
                async with self._slots:
                    ok = await self._respond(stream, peer_id, hello, hello.mechanism)
            finally:
                self._served.finished(initiator, ok=ok, now=trio.current_time())
        except (RemoteProtocolError, trio.TooSlowError) as exc:
            self.stats["bad_requests"] += 1
            logger.debug("hole punch from %s: %s", initiator or "a peer", exc)
        except Exception as exc:  # the relayed stream broke under us: muxers raise many types
            logger.debug("hole punch from %s: %r", initiator or "a peer", exc)
        finally:
            await _close(stream)

    async def _respond(
        self, stream: Any, peer_id: ID, hello: Connect, mechanism: Mechanism
    ) -> bool:
        public = self._host.reach.verdict() is Reachability.PUBLIC
        with trio.fail_after(CONTROL_TIMEOUT_S):
            await stream.write(Connect(tuple(self._my_addrs(public))).encode())
        plan = await self._plan(carrier_of(stream), peer_id, hello.addrs)
        if mechanism is Mechanism.REVERSAL:
            ok = await self._dial(peer_id, plan, None)
            with trio.fail_after(CONTROL_TIMEOUT_S):
                await stream.write(Result(ok, "" if ok else "no direct dial succeeded").encode())
        else:
            if self._source is None:
                return False  # the initiator's Sync never comes or finds a closed stream
            with trio.fail_after(CONTROL_TIMEOUT_S + MAX_SYNC_DELAY_S):
                sync = await _read(stream)
            if not isinstance(sync, Sync):
                raise RemoteProtocolError(f"expected Sync, got {sync!r}")
            ok = await self._dial(peer_id, plan, role_of(initiator=False))
        self._record(peer_id, mechanism, ok, responder=True)
        return ok

    # -- dialling ----------------------------------------------------------------------------

    async def _plan(self, carrier: ID, peer_id: ID, claimed: Sequence[str]) -> DialPlan:
        """What to dial of the addresses `peer_id` named: only at IPs where we or the relay
        carrying the punch (`carrier`) see it connected (punch_policy.plan_dials)."""
        observed = connection_ips(self._host, peer_id)
        if carrier != peer_id:
            observed += await ask_observed(self._host, carrier, peer_id)
        plan = plan_dials(claimed, observed, interface_networks())
        self._observed[peer_id.to_base58()] = frozenset(observed)
        while len(self._observed) > MAX_UPGRADED_REMEMBERED:
            self._observed.popitem(last=False)
        for reason, n in plan.refused.items():
            self.stats[f"addrs_refused_{reason}"] += n
        return plan

    async def _dial(self, peer_id: ID, plan: DialPlan, role: Role | None) -> bool:
        """Dial the planned addresses in turn until a connection to the peer exists.

        role None: an ordinary dial (reversal). DIALER/LISTENER: from our listen port,
        upgraded as that role (simultaneous open). The other side's SYN may also reach
        our listener first; any connection to the peer afterwards counts. Every dial is
        counted as aimed at an observed IP or not (`dials_to_unobserved` must stay 0)."""
        network = self._host.libp2p.get_network()
        observed = self._observed.get(peer_id.to_base58(), frozenset())
        for ip, port in plan.targets:
            if self._host.is_connected(peer_id):
                return True
            self.stats["dials_to_observed" if ip in observed else "dials_to_unobserved"] += 1
            family = "ip6" if ":" in ip else "ip4"
            maddr = multiaddr.Multiaddr(f"/{family}/{ip}/tcp/{port}")
            with trio.move_on_after(DIAL_TIMEOUT_S):
                try:
                    if role is None:
                        await network.dial_addr(maddr, peer_id)
                    elif role is Role.DIALER:
                        await network.dial_addr(maddr, peer_id, source=self._source)
                    else:
                        await network.dial_addr_as_responder(maddr, peer_id, source=self._source)
                except Exception as exc:  # refused, timed out, wrong peer: the next address
                    logger.debug("direct dial to %s at %s: %r", peer_id, maddr, exc)
        return bool(self._host.is_connected(peer_id))

    async def _handle_observed(self, stream: Any) -> None:
        await serve_observed(self._host, stream)

    def _record(
        self, peer_id: ID, mechanism: Mechanism, ok: bool, *, responder: bool = False
    ) -> None:
        side = "served_" if responder else ""
        self.stats[f"{side}{mechanism}_{'ok' if ok else 'failed'}"] += 1
        if not ok:
            return
        key = peer_id.to_base58()
        self.upgraded.pop(key, None)
        self.upgraded[key] = {
            "mechanism": mechanism.value,
            "remote": direct_remote(self._host, peer_id),
            "role": "initiator" if not responder else "responder",
            "at": round(trio.current_time(), 3),
        }
        while len(self.upgraded) > MAX_UPGRADED_REMEMBERED:
            self.upgraded.popitem(last=False)
        logger.info(
            "direct connection to %s by %s (%s)",
            peer_id,
            mechanism.value,
            self.upgraded[key]["remote"],
        )
