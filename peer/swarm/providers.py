"""Pure: provider records of prefix roots at their home peers (gossip mode `ring`).

A prompt's prefix root (the chain hash of its first block) has PROVIDER_HOMES home peers,
the nearest on the ring of peer positions; holders announce their roots to the homes
(`RootAnnouncer`), homes keep bounded, expiring records (`ProviderIndex`), and `HomeRing`
finds a root's homes among the known peers. All take `now`; none does I/O. The live shell
(peer/swarm/lookup.py) and the simulator drive the same objects (docs/protocol.md 5.5).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from peer.swarm.neighbourhood import ring_position
from protocols.roots import MAX_PROVIDERS_PER_REPLY, MAX_ROOTS_PER_ANNOUNCE

__all__ = [
    "ANNOUNCE_REFRESH_S",
    "MAX_HELD_ROOTS",
    "MAX_PROVIDERS_PER_ROOT",
    "MAX_ROOTS",
    "MAX_ROOTS_PER_PROVIDER",
    "PROVIDER_HOMES",
    "RECORD_TTL_S",
    "REFUSAL_S",
    "Announcement",
    "HomeRing",
    "ProviderIndex",
    "RootAnnouncer",
]

PROVIDER_HOMES = 2  # a root's records live on its 2 nearest peers: one may be gone
MAX_PROVIDERS_PER_ROOT = MAX_PROVIDERS_PER_REPLY  # the most recent announcers; more only
#   adds choice, not hits (an entry asks 2)
MAX_ROOTS = 65536  # roots indexed per home peer: ~1 MB of records at 16 providers each
MAX_ROOTS_PER_PROVIDER = 4096  # records one announcer may hold at one home: far above the
#   roots of a 1 GiB cache (1,456 blocks), and one peer cannot crowd out the others
MAX_HELD_ROOTS = 65536  # roots an announcer tracks: a cache has no more roots than blocks
# A record lives 2 minutes unless announced again; holders refresh every 40 s, so two
# refreshes may be lost before a held root's record lapses. A vanished holder's records
# are filtered by the home (connected peers only) and, beyond that, verified by the
# entry peer against the holder's own summary.
RECORD_TTL_S = 120.0
ANNOUNCE_REFRESH_S = RECORD_TTL_S / 3
REFUSAL_S = 60.0  # a home that refused or failed is skipped this long (then tried again)
MAX_REFUSED = 4096  # refusals remembered; beyond, the oldest is forgotten
_RING = 1 << 64


class ProviderIndex:
    """Provider records: prefix root -> the peers that announced holding it, newest last."""

    def __init__(
        self,
        ttl_s: float = RECORD_TTL_S,
        max_per_root: int = MAX_PROVIDERS_PER_ROOT,
        *,
        max_roots: int = MAX_ROOTS,
        max_per_provider: int = MAX_ROOTS_PER_PROVIDER,
    ) -> None:
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be finite and > 0, got {ttl_s}")
        if min(max_per_root, max_roots, max_per_provider) < 1:
            raise ValueError("max_per_root, max_roots and max_per_provider must be >= 1")
        self._ttl_s = ttl_s
        self._max_per_root = max_per_root
        self._max_roots = max_roots
        self._max_per_provider = max_per_provider
        # root -> peer id -> when announced (both in announcement order: oldest first)
        self._records: OrderedDict[int, OrderedDict[str, float]] = OrderedDict()
        self._count: dict[str, int] = {}  # records per announcer

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def __len__(self) -> int:
        """Roots indexed (some of whose records may have lapsed)."""
        return len(self._records)

    def records_of(self, peer_id: str) -> int:
        return self._count.get(peer_id, 0)

    def _uncount(self, peer_id: str) -> None:
        left = self._count[peer_id] - 1
        if left:
            self._count[peer_id] = left
        else:
            del self._count[peer_id]

    def _drop_root(self, root: int) -> None:
        for peer_id in self._records.pop(root):
            self._uncount(peer_id)

    def announce(self, root: int, peer_id: str, now: float) -> bool:
        """`peer_id` holds `root` as of `now` (a newer announcement refreshes it). False:
        refused, the announcer holds MAX_ROOTS_PER_PROVIDER records here already."""
        records = self._records.get(root)
        if records is not None and peer_id in records:
            del records[peer_id]  # refreshed: newest again
            records[peer_id] = now
            self._records.move_to_end(root)
            return True
        if self._count.get(peer_id, 0) >= self._max_per_provider:
            return False
        if records is None:
            if len(self._records) >= self._max_roots:
                self._drop_root(next(iter(self._records)))  # the least recently announced
            records = self._records[root] = OrderedDict()
        else:
            self._records.move_to_end(root)
        records[peer_id] = now
        self._count[peer_id] = self._count.get(peer_id, 0) + 1
        while len(records) > self._max_per_root:
            oldest, _ = records.popitem(last=False)
            self._uncount(oldest)
        return True

    def withdraw(self, root: int, peer_id: str) -> None:
        """`peer_id` no longer holds `root`."""
        records = self._records.get(root)
        if records is not None and records.pop(peer_id, None) is not None:
            self._uncount(peer_id)
            if not records:
                del self._records[root]

    def providers(self, root: int, now: float) -> list[str]:
        """The live records for `root`, most recently announced first (lapsed ones go)."""
        records = self._records.get(root)
        if records is None:
            return []
        for peer_id in [p for p, t in records.items() if now - t >= self._ttl_s]:
            del records[peer_id]
            self._uncount(peer_id)
        if not records:
            del self._records[root]
            return []
        return list(reversed(records))

    def expire(self, now: float) -> int:
        """Drop the roots none of whose records is live any more, the least recently
        announced first, stopping at the first live one; returns how many went."""
        dropped = 0
        while self._records:
            root, records = next(iter(self._records.items()))
            if now - next(reversed(records.values())) < self._ttl_s:
                break
            self._drop_root(root)
            dropped += 1
        return dropped


class HomeRing:
    """The known peers (and this one) on the ring; the homes of a root among them."""

    def __init__(self, self_id: str | None = None, homes: int = PROVIDER_HOMES) -> None:
        if homes < 1:
            raise ValueError(f"homes must be >= 1, got {homes}")
        self._self_id = self_id
        self._homes = homes
        self._members: frozenset[str] = frozenset()
        self._positions: list[int] = []  # sorted
        self._ids: list[str] = []  # in the same order
        self._refused: OrderedDict[str, float] = OrderedDict()  # peer -> refused until
        self._next_lapse = math.inf  # when the earliest refusal lapses
        self._version = 0

    @property
    def members(self) -> frozenset[str]:
        return self._members

    def update(self, known: Iterable[str]) -> bool:
        """The peers known now (this peer is always a member); whether that changed."""
        members = set(known)
        if self._self_id is not None:
            members.add(self._self_id)
        frozen = frozenset(members)
        if frozen == self._members:
            return False
        ring = sorted((ring_position(p), p) for p in frozen)
        self._members = frozen
        self._positions = [pos for pos, _ in ring]
        self._ids = [p for _, p in ring]
        self._version += 1
        return True

    def refuse(self, peer_id: str, now: float) -> None:
        """`peer_id` refused the protocol or did not answer: not a home for REFUSAL_S."""
        if peer_id == self._self_id:
            return
        self._refused.pop(peer_id, None)
        self._refused[peer_id] = now + REFUSAL_S
        while len(self._refused) > MAX_REFUSED:
            self._refused.popitem(last=False)
        self._next_lapse = min(self._next_lapse, now + REFUSAL_S)
        self._version += 1

    def _lapse(self, now: float) -> None:
        if now < self._next_lapse:
            return
        for peer_id in [p for p, until in self._refused.items() if until <= now]:
            del self._refused[peer_id]
        self._next_lapse = min(self._refused.values(), default=math.inf)
        self._version += 1

    def version(self, now: float) -> int:
        """Changes whenever `homes` may answer differently (members or refusals)."""
        self._lapse(now)
        return self._version

    def homes(self, root: int, now: float) -> tuple[str, ...]:
        """The members nearest `root` on the ring (nearest first; ties to the lower id),
        refused ones skipped: at most `homes` of them."""
        self._lapse(now)
        n = len(self._ids)
        out: list[str] = []
        if not n:
            return ()
        right = bisect.bisect_left(self._positions, root)  # first at or after the root
        left = right - 1
        for _ in range(n):
            if len(out) >= self._homes:
                break
            r, lft = self._ids[right % n], self._ids[left % n]
            d_right = (self._positions[right % n] - root) % _RING
            d_left = (root - self._positions[left % n]) % _RING
            if (d_right, r) <= (d_left, lft):
                peer_id, right = r, right + 1
            else:
                peer_id, left = lft, left - 1
            if peer_id not in self._refused and peer_id not in out:
                out.append(peer_id)
        return tuple(out)


class Announcement(NamedTuple):
    """Tell `home` that this peer holds `add` and no longer holds `drop`."""

    home: str
    add: tuple[int, ...]
    drop: tuple[int, ...]


class _Held(NamedTuple):
    homes: tuple[str, ...]
    announced_at: float  # -inf: to be announced again at the next sync


class RootAnnouncer:
    """What a holder tells the homes of its roots, decided at each `sync`."""

    def __init__(self, refresh_s: float = ANNOUNCE_REFRESH_S) -> None:
        if not (math.isfinite(refresh_s) and refresh_s > 0):
            raise ValueError(f"refresh_s must be finite and > 0, got {refresh_s}")
        self._refresh_s = refresh_s
        self._held: dict[int, _Held] = {}
        self._version = -1  # the HomeRing version the homes were computed at
        # Withdrawals not sent yet: home -> root -> since when. They ride along with the
        # next announcement to that home, or go alone once `refresh_s` old (a stale
        # record costs an entry one summary query, which shows the root is gone).
        self._drops: dict[str, dict[int, float]] = {}

    @property
    def held(self) -> frozenset[int]:
        return frozenset(self._held)

    def homes_of(self, root: int) -> tuple[str, ...]:
        held = self._held.get(root)
        return held.homes if held is not None else ()

    def sync(self, roots: Iterable[int], ring: HomeRing, now: float) -> list[Announcement]:
        """The roots held now (those the summary just published covers): what to send.

        New roots go to their homes, roots no longer held are withdrawn from theirs (with
        the next announcement there, at the latest `refresh_s` later), roots whose homes
        changed move, and roots announced `refresh_s` ago or more are announced again.
        One Announcement per home (more if over a frame's bound)."""
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now}")
        current: dict[int, None] = {}
        for root in roots:
            if len(current) >= MAX_HELD_ROOTS:
                break
            current[root] = None
        adds: dict[str, list[int]] = {}
        for root in [r for r in self._held if r not in current]:
            for home in self._held.pop(root).homes:
                self._drop_later(home, root, now)
        version = ring.version(now)
        moved = version != self._version
        self._version = version
        for root in current:
            old = self._held.get(root)
            homes = ring.homes(root, now) if old is None or moved else old.homes
            if old is not None and homes == old.homes and now - old.announced_at < self._refresh_s:
                continue
            for home in homes:
                adds.setdefault(home, []).append(root)
                self._drops.get(home, {}).pop(root, None)  # held again: no withdrawal
            if old is not None:
                for home in old.homes:
                    if home not in homes:
                        self._drop_later(home, root, now)
            self._held[root] = _Held(homes, now)
        drops: dict[str, list[int]] = {}
        for home, pending in list(self._drops.items()):
            if not pending:
                del self._drops[home]
            elif home in adds or now - min(pending.values()) >= self._refresh_s:
                drops[home] = list(pending)
                del self._drops[home]
        out: list[Announcement] = []
        for home in sorted(adds.keys() | drops.keys()):
            add, drop = adds.get(home, []), drops.get(home, [])
            step = MAX_ROOTS_PER_ANNOUNCE
            for i in range(0, max(len(add), len(drop)), step):
                out.append(Announcement(home, tuple(add[i : i + step]), tuple(drop[i : i + step])))
        return out

    def _drop_later(self, home: str, root: int, now: float) -> None:
        pending = self._drops.setdefault(home, {})
        pending.setdefault(root, now)
        if len(pending) > MAX_HELD_ROOTS:  # only if syncs stopped: forget the oldest
            del pending[next(iter(pending))]

    def failed(self, home: str) -> None:
        """A message to `home` was lost or refused: its roots are announced again (to
        their homes then) at the next sync, and nothing more is sent to `home` for them
        (its records lapse with their TTL, as a lost withdrawal does)."""
        self._drops.pop(home, None)
        for root, held in self._held.items():
            if home in held.homes:
                homes = tuple(h for h in held.homes if h != home)
                self._held[root] = _Held(homes, -math.inf)
