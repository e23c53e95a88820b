"""PeerTable: what this peer believes about every other peer, with ages and expiry (pure).

Fed by method calls with `now`, it keeps gossiped summaries that pass their own checks
(peer/swarm/summary_checks.py; `apply` answers an `ApplyResult` with a stable reason),
admits newcomers to a full table proven peers first (peer/swarm/admission.py), expires
silent peers, estimates each peer's match for a block-hash chain from its Bloom filter
(`routing_rows`: all peers at once, through a numpy `BloomBank`), keeps round trips and
counts this peer's own forwards on top of each summary's load. It never does I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from peer.swarm.admission import UNPROVEN_SHARE, Admission, decide
from peer.swarm.peer_rows import ForwardCharge, PeerView, RoutingRow
from peer.swarm.summary_checks import ApplyResult, Verdict, bloom_verdict, header_verdict
from protocols.bloom import BloomFilter, ProbeCache, Probes
from protocols.bloom_bank import BloomBank, KeyChain
from protocols.summary import CacheSummary

__all__ = [
    "MAX_ADDRS_PER_PEER", "MAX_ADDR_CHARS", "MAX_BANK_BYTES", "MAX_PEERS", "RTT_WINDOW",
    "ApplyResult", "ForwardCharge", "PeerTable", "PeerView", "RoutingRow", "Verdict",
]  # fmt: skip

# A routing decision scans every peer, and a decoded filter of MAX_BLOOM_BITS takes
# ~0.75 MB plus 0.5 MB in its BloomBank: 256 peers bound both (~0.3 GB worst case; gossip
# caps filters at 48 KiB, ~30 MB) and far exceed one model's swarm.
MAX_PEERS = 256
# The BloomBanks store 64 filter columns per shape even for one peer, so a swarm of many
# odd shapes could cost 64x its filters; past this budget a peer's match is walked in
# Python instead (same answer, slower). Honest peers use a few shapes: 64 peers of 160k
# bits take 1.3 MB a shape, 256 peers of 325k bits 10 MB.
MAX_BANK_BYTES = 64 << 20
RTT_WINDOW = 6  # round trips whose minimum is the path's delay: ~30 s of 5 s liveness
#   pings, so a path that got slower is followed within that, and 5 of 6 pings may be late
MAX_ADDRS_PER_PEER = 16  # libp2p peers announce a handful; the rest is noise
MAX_ADDR_CHARS = 256  # a multiaddr with DNS name, port, /p2p/ id fits easily
# Weight of each new report in a peer's mean reported queue: about its last ten reports.
# A stale report is believed less as it ages and this mean more (cost.aged_queue); the
# mean is the peer's own, so a peer's reports move only its own estimate.
QUEUE_MEAN_WEIGHT = 0.1


_new_row = tuple.__new__  # NamedTuple's __new__ is a Python function; this is ~2x cheaper


@dataclass
class _Entry:
    summary: CacheSummary
    received_at: float
    shape: tuple[int, int]  # (bloom_bits, bloom_hashes): which BloomBank holds the filter
    slot: int  # its slot there; -1 when over MAX_BANK_BYTES (walked in Python instead)
    rtt_s: float | None = None
    rtt_samples: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_WINDOW))
    forwards: int = 0
    forwarded_tokens: int = 0
    addrs: tuple[str, ...] = field(default=())
    decoded: BloomFilter | None = None  # summary.bloom_filter(), made on first use
    proven: bool = False  # reached: a connection seen by the shell, or a round trip
    queue_mean: float = 0.0  # moving mean of the queues its summaries reported

    @property
    def bloom(self) -> BloomFilter:
        if self.decoded is None:
            self.decoded = self.summary.bloom_filter()
        return self.decoded


def _check_time(now: float) -> None:
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now}")


class PeerTable:
    """The newest accepted summary of every live peer, plus RTTs, forwards and addresses."""

    def __init__(
        self,
        self_id: str,
        model_id: str,
        block_size: int,
        expiry_s: float,
        probe_cache: ProbeCache | None = None,
        *,
        max_bank_bytes: int = MAX_BANK_BYTES,
        max_peers: int = MAX_PEERS,
        max_unproven: int | None = None,
    ) -> None:
        """`max_unproven`: entries of peers never reached that the table holds at once
        (default UNPROVEN_SHARE of `max_peers`)."""
        if not self_id:
            raise ValueError("self_id must be this peer's id")
        if not (math.isfinite(expiry_s) and expiry_s > 0):
            raise ValueError(f"expiry_s must be finite and > 0, got {expiry_s}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 1 <= max_peers <= MAX_PEERS:
            raise ValueError(f"max_peers must be in [1, {MAX_PEERS}], got {max_peers}")
        if max_unproven is None:
            max_unproven = int(max_peers * UNPROVEN_SHARE)
        if not 0 <= max_unproven <= max_peers:
            raise ValueError(f"max_unproven must be in [0, {max_peers}], got {max_unproven}")
        self._max_peers = max_peers
        self._max_unproven = max_unproven
        # Entries of peers not reached yet -> when their last summary arrived
        self._unproven: dict[str, float] = {}
        self._evicted_unproven = 0
        self._self_id = self_id
        self._model_id = model_id
        self._block_size = block_size
        self._expiry_s = float(expiry_s)
        self._entries: dict[str, _Entry] = {}
        self._reaped: dict[str, None] = {}  # dropped by apply() when full, for expire()
        # At most the oldest entry's received_at: while now is within the expiry of it,
        # nothing can be reaped and the scan is skipped (a full table refusing newcomers)
        self._oldest = math.inf
        self._probe_cache = probe_cache if probe_cache is not None else ProbeCache()
        self._counts: dict[str, int] = {}
        self._banks: dict[tuple[int, int], BloomBank] = {}  # entries' filters, by shape
        self._max_bank_bytes = max_bank_bytes
        self._order: list[str] | None = None  # entry ids sorted; None after a change

    @property
    def expiry_s(self) -> float:
        return self._expiry_s

    @property
    def self_id(self) -> str:
        return self._self_id

    def __len__(self) -> int:
        """Entries held, including silent ones that `expire` has not dropped yet."""
        return len(self._entries)

    def holds(self, peer_id: str) -> bool:
        """Whether `peer_id` has an entry, live or silent but not dropped yet: its next
        summary is applied without asking for a slot."""
        return peer_id in self._entries

    def is_proven(self, peer_id: str) -> bool:
        """Whether `peer_id` has an entry that was reached (a connection or a round trip)."""
        entry = self._entries.get(peer_id)
        return entry is not None and entry.proven

    def room_for_unproven(self, now: float) -> bool:
        """Whether a first summary from a peer never reached could be admitted now: False
        only when the unproven share or the whole table is taken by live entries (what
        `apply` would refuse as UNPROVEN_FULL or TABLE_FULL). Asked by the gossip gate
        before a summary's signature is checked."""
        if len(self._entries) < self._max_peers and len(self._unproven) < self._max_unproven:
            return True
        return now - self._oldest >= self._expiry_s  # a silent entry could be reaped

    def _live(self, entry: _Entry, now: float) -> bool:
        return now - entry.received_at < self._expiry_s

    def _result(self, accepted: bool, reason: Verdict, detail: str = "") -> ApplyResult:
        self._counts[reason.value] = self._counts.get(reason.value, 0) + 1
        return ApplyResult(accepted, reason, detail)

    # -- summaries ---------------------------------------------------------------------

    def apply(
        self, summary: CacheSummary, source_peer_id: str, now: float, *, reachable: bool = False
    ) -> ApplyResult:
        """Validate `summary`, received from `source_peer_id`, and keep it if acceptable.

        `reachable`: the shell holds a connection to the peer (or just got the summary
        from it over a stream), which proves the entry; otherwise only a round trip
        (`record_rtt`) does. A newcomer is admitted by `admission.decide`."""
        _check_time(now)
        peer_id = summary.peer_id
        refused = header_verdict(summary, source_peer_id, self._self_id, self._model_id,
                                 self._block_size)
        if refused is not None:
            return self._result(False, *refused)
        old = self._entries.get(peer_id)
        live_old = old is not None and self._live(old, now)
        if old is not None and live_old and summary.seq <= old.summary.seq:
            return self._result(
                False, Verdict.STALE_SEQ, f"seq {summary.seq} <= current {old.summary.seq}"
            )
        if summary.leaving:
            if old is not None:
                self._drop(peer_id)
            return self._result(True, Verdict.LEFT, f"seq {summary.seq}")
        implausible = bloom_verdict(summary)
        if implausible is not None:
            return self._result(False, *implausible)
        proven = reachable or (old is not None and old.proven)
        if old is None:
            not_admitted = self._admit(peer_id, proven, now)
            if not_admitted is not None:
                return not_admitted
        shape = (summary.bloom_bits, summary.bloom_hashes)
        if old is not None and old.shape == shape and old.slot >= 0:
            slot = old.slot
        else:
            if old is not None:
                self._release(old)
            slot = self._acquire(shape)
        if slot >= 0:
            self._banks[shape].put(slot, summary.bloom)
        queued = float(summary.queued_prompt_tokens)
        entry = _Entry(summary=summary, received_at=now, shape=shape, slot=slot,
                       queue_mean=queued if old is None
                       else old.queue_mean + QUEUE_MEAN_WEIGHT * (queued - old.queue_mean))
        if old is not None:  # keep what we measured; forwards start again from zero
            entry.rtt_s = old.rtt_s
            entry.rtt_samples = old.rtt_samples
            entry.addrs = old.addrs
        else:
            self._order = None
        entry.proven = proven
        if proven:
            self._unproven.pop(peer_id, None)
        else:
            self._unproven[peer_id] = now
        self._entries[peer_id] = entry
        self._oldest = min(self._oldest, now)
        self._reaped.pop(peer_id, None)
        if live_old:
            return self._result(True, Verdict.UPDATED, f"seq {summary.seq}")
        return self._result(True, Verdict.NEW_PEER, f"seq {summary.seq}")

    def _admit(self, peer_id: str, proven: bool, now: float) -> ApplyResult | None:
        """Make room for a newcomer (None) or say why not (the refusal)."""
        if len(self._entries) >= self._max_peers or (
            not proven and len(self._unproven) >= self._max_unproven
        ):
            self._reap(now)  # silent entries go first
        decision = decide(
            proven=proven, size=len(self._entries), max_peers=self._max_peers,
            unproven=self._unproven, max_unproven=self._max_unproven,
        )
        if decision.action is Admission.TABLE_FULL:
            return self._result(False, Verdict.TABLE_FULL, f"{len(self._entries)} live peers")
        if decision.action is Admission.UNPROVEN_FULL:
            return self._result(
                False, Verdict.UNPROVEN_FULL,
                f"{len(self._unproven)} peers never reached hold the unproven share",
            )
        if decision.victim is not None:  # the stalest unproven entry makes way
            self._drop(decision.victim)
            self._reaped[decision.victim] = None  # reported by expire()
            self._evicted_unproven += 1
        return None

    def _acquire(self, shape: tuple[int, int]) -> int:
        """A slot in the bank of `shape`, or -1 if that would exceed the bank budget."""
        bank = self._banks.get(shape)
        if bank is None:
            bank = self._banks[shape] = BloomBank(*shape)
        slot = bank.acquire()
        if sum(b.nbytes for b in self._banks.values()) > self._max_bank_bytes:
            self._release_slot(shape, slot)
            return -1
        return slot

    def _release_slot(self, shape: tuple[int, int], slot: int) -> None:
        bank = self._banks[shape]
        bank.release(slot)
        if not len(bank):
            del self._banks[shape]

    def _release(self, entry: _Entry) -> None:
        if entry.slot >= 0:
            self._release_slot(entry.shape, entry.slot)

    def _drop(self, peer_id: str) -> None:
        self._release(self._entries.pop(peer_id))
        self._unproven.pop(peer_id, None)
        self._order = None

    def _reap(self, now: float) -> None:
        if now - self._oldest < self._expiry_s:
            return  # every entry is live
        for peer_id in [p for p, e in self._entries.items() if not self._live(e, now)]:
            self._drop(peer_id)
            self._reaped[peer_id] = None
        while len(self._reaped) > MAX_PEERS:  # only if expire() is never called
            del self._reaped[next(iter(self._reaped))]
        self._oldest = min((e.received_at for e in self._entries.values()), default=math.inf)

    def expire(self, now: float) -> list[str]:
        """Drop peers silent for `expiry_s` or longer; return their ids (sorted), with
        those whose unproven entries made way for proven peers since the last call."""
        _check_time(now)
        self._reap(now)
        expired = sorted(self._reaped)
        self._reaped.clear()
        return expired

    def remove(self, peer_id: str) -> None:
        """Forget a peer now (e.g. the shell saw it disconnect for good)."""
        if peer_id in self._entries:
            self._drop(peer_id)

    # -- observations from the shell ----------------------------------------------------

    def record_rtt(self, peer_id: str, rtt_s: float, now: float) -> bool:
        """Add a measured round trip to the peer's window; False (ignored) if unknown.

        The window's minimum is the path's own delay: a ping answered late by a busy
        event loop measures that peer's load, which the cost model takes from its summary
        (on loopback, pings of 2 to 17 ms over a path whose forwards cost ~2 ms)."""
        _check_time(now)
        if not (math.isfinite(rtt_s) and rtt_s >= 0.0):
            raise ValueError(f"rtt_s must be finite and >= 0, got {rtt_s}")
        entry = self._entries.get(peer_id)
        if entry is None:
            return False
        entry.rtt_samples.append(rtt_s)
        entry.rtt_s = min(entry.rtt_samples)
        entry.proven = True
        self._unproven.pop(peer_id, None)
        return True

    def record_forward(self, peer_id: str, prompt_tokens: int, now: float) -> ForwardCharge | None:
        """Count a request forwarded to the peer; None (nothing counted) for an unknown peer.

        Give the charge back with `forward_prefilled` and `forward_ended`.
        """
        _check_time(now)
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        entry = self._entries.get(peer_id)
        if entry is None:
            return None
        entry.forwards += 1
        entry.forwarded_tokens += prompt_tokens
        return ForwardCharge(peer_id, entry.summary.seq, prompt_tokens)

    def _charged(self, charge: ForwardCharge) -> _Entry | None:
        entry = self._entries.get(charge.peer_id)
        if entry is None or entry.summary.seq != charge.summary_seq:
            return None  # gone, or a newer summary replaced the counts
        return entry

    def forward_prefilled(self, charge: ForwardCharge) -> None:
        """The forward's first token arrived: its prompt is no longer queued there."""
        entry = self._charged(charge)
        if entry is not None:
            entry.forwarded_tokens = max(0, entry.forwarded_tokens - charge.prompt_tokens)

    def forward_ended(self, charge: ForwardCharge, *, prefilled: bool) -> None:
        """The forward is over (done, failed or abandoned): it no longer runs there.

        ``prefilled``: whether `forward_prefilled` was called for it already.
        """
        entry = self._charged(charge)
        if entry is None:
            return
        entry.forwards = max(0, entry.forwards - 1)
        if not prefilled:
            entry.forwarded_tokens = max(0, entry.forwarded_tokens - charge.prompt_tokens)

    def note_addrs(self, peer_id: str, addrs: Iterable[str]) -> None:
        """Remember the peer's listen addresses (the first MAX_ADDRS_PER_PEER sane ones)."""
        entry = self._entries.get(peer_id)
        if entry is None:
            return
        kept: list[str] = []
        for addr in addrs:
            if len(kept) == MAX_ADDRS_PER_PEER:
                break
            if addr.startswith("/") and len(addr) <= MAX_ADDR_CHARS and addr not in kept:
                kept.append(addr)
        entry.addrs = tuple(kept)

    # -- queries ---------------------------------------------------------------------------

    def _view(self, peer_id: str, entry: _Entry, now: float) -> PeerView:
        return PeerView(
            peer_id,
            entry.summary,
            entry.received_at,
            now - entry.received_at,
            entry.rtt_s,
            entry.forwards,
            entry.forwarded_tokens,
            entry.addrs,
            entry.queue_mean,
        )

    def get(self, peer_id: str, now: float) -> PeerView | None:
        """The live peer's view, or None if unknown or silent for `expiry_s`."""
        entry = self._entries.get(peer_id)
        if entry is None or not self._live(entry, now):
            return None
        return self._view(peer_id, entry, now)

    def views(self, now: float) -> list[PeerView]:
        """Every live peer, ordered by peer id (deterministic for the simulator)."""
        return [
            self._view(peer_id, entry, now)
            for peer_id, entry in sorted(self._entries.items())
            if self._live(entry, now)
        ]

    def probes(self, chain: Sequence[int]) -> Probes:
        """The chain prepared once for `estimate_match` against many peers."""
        return self._probe_cache.probes(chain)

    def estimate_match(self, peer_id: str, chain: Sequence[int] | Probes) -> int:
        """Leading blocks of `chain` the peer's filter holds (0 for an unknown peer).

        Pass `probes(chain)` when asking about several peers. A stale entry still
        answers; `views(now)` says which peers are live.
        """
        entry = self._entries.get(peer_id)
        if entry is None:
            return 0
        probes = chain if isinstance(chain, Probes) else self._probe_cache.probes(chain)
        return entry.bloom.count_prefix(probes)

    def estimate_matches(self, chain: Sequence[int] | Probes, now: float) -> dict[str, int]:
        """`estimate_match` for every live peer, computed for all of them at once."""
        keys = chain.keys if isinstance(chain, Probes) else chain
        return {row[0]: row[5] for row in self.routing_rows(keys, now)}

    def routing_rows(self, chain: Sequence[int] | None, now: float) -> list[RoutingRow]:
        """Every live peer, ordered by peer id, with what a routing decision reads.

        ``match_blocks`` is `estimate_match(peer_id, chain)` (the walk until the first
        Bloom miss), computed for all peers at once; 0 when `chain` is None or empty.
        ValueError if a key of `chain` is not a 64-bit unsigned int.
        """
        counts: dict[tuple[int, int], list[int]] = {}
        probes: Probes | None = None  # for peers outside the banks, made on first need
        if chain:
            keys = KeyChain(chain)
            counts = {shape: bank.prefix_counts(keys) for shape, bank in self._banks.items()}
        order = self._order
        if order is None:
            order = self._order = sorted(self._entries)
        entries = self._entries
        expiry = self._expiry_s
        out: list[RoutingRow] = []
        for peer_id in order:
            e = entries[peer_id]
            if now - e.received_at >= expiry:  # not _live(e, now), inlined
                continue
            if not chain:
                match = 0
            elif e.slot >= 0:
                match = counts[e.shape][e.slot]
            else:
                if probes is None:
                    probes = self._probe_cache.probes(chain)
                match = e.bloom.count_prefix(probes)
            row = (peer_id, e.summary, e.rtt_s, e.forwards, e.forwarded_tokens, match,
                   now - e.received_at, e.queue_mean)
            out.append(_new_row(RoutingRow, row))
        return out

    def statistics(self) -> dict[str, int]:
        """Entries held (unproven ones apart), outcomes of `apply` by verdict, unproven
        entries evicted for proven ones, probe cache counters."""
        stats = {
            "peers": len(self._entries),
            "unproven": len(self._unproven),
            "evicted_unproven": self._evicted_unproven,
        }
        stats.update({f"apply_{reason}": count for reason, count in sorted(self._counts.items())})
        stats.update({f"probe_cache_{k}": v for k, v in self._probe_cache.statistics().items()})
        return stats
