"""Radix tree over token blocks: prefix match, ref-counted locks, LRU eviction, change events.

Pure: no torch, no trio, no clock. Each node is one full block of `block_size` tokens and
holds an opaque value (the engine stores the block's KV tensor there). Children are keyed
by the block's token content, so a hash collision can never return a wrong prefix; each
node also keeps its chain hash (protocols.blocks) for the gossip summaries.

Eviction removes unlocked leaves, least recently used first, so the cache always holds
whole prefixes. Stored and removed block hashes go to an outbox read by `drain_events()`.

Private requests pass a `salt`: their blocks hang under a root of their own (so only a
request with the same salt matches them), their chain hashes start from the salted seed,
and they produce no events and are left out of `cached_hashes()`: the gossip summary,
built from those, never advertises them.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from protocols.blocks import BlockHasher

V = TypeVar("V")

MAX_PENDING_EVENTS = 65_536  # outbox bound if nobody drains; older events are dropped and counted
MAX_CAPACITY_BLOCKS = 1 << 24  # 16M blocks = 268M tokens: far above any RAM-backed KV budget


class EventKind(enum.Enum):
    """What happened to a block."""

    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class CacheEvent:
    """A block entered or left the cache."""

    kind: EventKind
    block_hash: int


class _Node(Generic[V]):
    """One cached block. Internal; reached from outside only as an opaque handle in a Match."""

    __slots__ = (
        "block_hash", "children", "key", "last_access", "lock_ref", "parent", "private", "value"
    )

    def __init__(
        self,
        key: tuple[int, ...],
        parent: _Node[V] | None,
        value: V | None,
        block_hash: int,
        now: float,
        private: bool = False,
    ) -> None:
        self.key = key
        self.private = private  # under a salted root: never announced
        self.parent = parent
        self.value = value
        self.block_hash = block_hash
        self.children: dict[tuple[int, ...], _Node[V]] = {}
        self.lock_ref = 0
        self.last_access = now


@dataclass(frozen=True)
class Match(Generic[V]):
    """The longest cached block-aligned prefix of a token sequence."""

    num_blocks: int
    num_tokens: int
    values: tuple[V, ...]
    hashes: tuple[int, ...]
    nodes: tuple[_Node[V], ...] = field(repr=False)


@dataclass(frozen=True)
class InsertResult:
    """What an insert did: blocks already present, blocks added, blocks evicted to make room.

    `dropped_blocks` counts new blocks that did not fit (everything evictable was locked).
    """

    existing_blocks: int
    stored_hashes: tuple[int, ...]
    evicted_hashes: tuple[int, ...]
    dropped_blocks: int


class RadixCache(Generic[V]):
    """A block-granular prefix cache with a capacity in blocks."""

    def __init__(self, block_size: int, capacity_blocks: int, hasher: BlockHasher) -> None:
        if block_size != hasher.block_size:
            raise ValueError(
                f"block_size {block_size} differs from the hasher's {hasher.block_size}"
            )
        if not 0 <= capacity_blocks <= MAX_CAPACITY_BLOCKS:
            raise ValueError(
                f"capacity_blocks must be in [0, {MAX_CAPACITY_BLOCKS}], got {capacity_blocks}"
            )
        self._block_size = block_size
        self._capacity = capacity_blocks
        self._hasher = hasher
        self._root: _Node[V] = _Node((), None, None, hasher.seed, 0.0)
        # One root per cache salt that has blocks; an emptied salted root is dropped, so
        # there are never more salted roots than blocks.
        self._salted: dict[bytes, _Node[V]] = {}
        self._num_blocks = 0
        self._private_blocks = 0  # of _num_blocks, under salted roots
        self._locked_blocks = 0  # nodes with lock_ref > 0
        self._events: deque[CacheEvent] = deque()
        self._events_dropped = 0
        self._tiebreak = itertools.count()
        self._stats = {
            "match_queries": 0,
            "match_query_blocks": 0,
            "match_hit_blocks": 0,
            "inserted_blocks": 0,
            "evicted_blocks": 0,
            "dropped_blocks": 0,
        }

    # -- properties -------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def capacity_blocks(self) -> int:
        """The most blocks the cache holds."""
        return self._capacity

    @property
    def num_blocks(self) -> int:
        """Blocks held now."""
        return self._num_blocks

    @property
    def public_blocks(self) -> int:
        """Blocks held now that a summary announces: `num_blocks` less the private ones
        (exactly the count of `cached_hashes()`)."""
        return self._num_blocks - self._private_blocks

    @property
    def hasher(self) -> BlockHasher:
        """The block hasher whose chain hashes the nodes carry."""
        return self._hasher

    # -- queries ----------------------------------------------------------------------

    def _root_for(self, salt: bytes | None, create: bool) -> _Node[V] | None:
        if salt is None:
            return self._root
        root = self._salted.get(salt)
        if root is None and create:
            root = _Node((), None, None, self._hasher.salted_seed(salt), 0.0, private=True)
            self._salted[salt] = root
        return root

    def _drop_if_empty(self, root: _Node[V]) -> None:
        if root.private and not root.children:
            salt = next(k for k, r in self._salted.items() if r is root)
            del self._salted[salt]

    def _walk(
        self, tokens: Sequence[int], max_blocks: int | None, salt: bytes | None = None
    ) -> list[_Node[V]]:
        bs = self._block_size
        limit = len(tokens) // bs
        if max_blocks is not None:
            limit = min(limit, max(0, max_blocks))
        path: list[_Node[V]] = []
        root = self._root_for(salt, create=False)
        if root is None:
            return path
        node = root
        for b in range(limit):
            child = node.children.get(tuple(tokens[b * bs : (b + 1) * bs]))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def match(
        self,
        tokens: Sequence[int],
        now: float,
        max_blocks: int | None = None,
        *,
        salt: bytes | None = None,
    ) -> Match[V]:
        """The longest cached prefix of `tokens` (at most `max_blocks` blocks) among blocks
        stored with the same `salt`; marks it used."""
        path = self._walk(tokens, max_blocks, salt)
        for node in path:
            node.last_access = now
        self._stats["match_queries"] += 1
        self._stats["match_query_blocks"] += len(tokens) // self._block_size
        self._stats["match_hit_blocks"] += len(path)
        return Match(
            num_blocks=len(path),
            num_tokens=len(path) * self._block_size,
            values=tuple(n.value for n in path),  # type: ignore[misc]  # non-root: never None
            hashes=tuple(n.block_hash for n in path),
            nodes=tuple(path),
        )

    def peek(self, tokens: Sequence[int], *, salt: bytes | None = None) -> int:
        """Tokens of the longest cached prefix, with no side effect (for routing estimates)."""
        return len(self._walk(tokens, None, salt)) * self._block_size

    def cached_hashes(self) -> Iterator[int]:
        """The chain hash of every cached public block (private ones are never announced)."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node.block_hash
            stack.extend(node.children.values())

    def root_hashes(self) -> list[int]:
        """The chain hash of every cached public first block: the prefix roots this cache
        holds (gossip mode `ring` announces them, peer/swarm/providers.py)."""
        return [node.block_hash for node in self._root.children.values()]

    def match_hashes(self, chain: Sequence[int]) -> int:
        """Leading blocks of a block-hash chain (protocols/blocks.py) cached as public
        blocks: the walk by chain hash (another peer's prompt, known by its hashes only;
        a hash collision costs a cache miss there, never a wrong answer)."""
        node = self._root
        for count, block_hash in enumerate(chain):
            child = next((c for c in node.children.values() if c.block_hash == block_hash), None)
            if child is None:
                return count
            node = child
        return len(chain)

    # -- locks ------------------------------------------------------------------------

    def lock(self, match: Match[V]) -> None:
        """Protect the matched blocks from eviction until `unlock(match)`. Ref-counted."""
        for node in match.nodes:
            if node.lock_ref == 0:
                self._locked_blocks += 1
            node.lock_ref += 1

    def unlock(self, match: Match[V]) -> None:
        """Release one `lock(match)`."""
        for node in match.nodes:
            if node.lock_ref <= 0:
                raise ValueError("unlock() without a matching lock()")
        for node in match.nodes:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked_blocks -= 1

    # -- changes ----------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        values: Sequence[V] | Callable[[int], V],
        now: float,
        *,
        salt: bytes | None = None,
    ) -> InsertResult:
        """Cache every full block of `tokens`, evicting LRU unlocked leaves to make room.

        `values` gives block i's value, as a sequence indexed by block or as a function of
        the block index; a function is called only for blocks not cached yet. Blocks that do
        not fit even after eviction are not stored (counted in `dropped_blocks`). With a
        `salt` the blocks are private: matched only with that salt, never announced.
        """
        n_blocks = len(tokens) // self._block_size
        if not callable(values) and len(values) < n_blocks:
            raise ValueError(f"{n_blocks} full blocks but only {len(values)} values")
        path = self._walk(tokens, None, salt)
        for node in path:
            node.last_access = now
        existing = len(path)
        wanted = n_blocks - existing
        evicted: list[int] = []
        if wanted > 0 and self._num_blocks + wanted > self._capacity:
            # The path we extend must survive the eviction it triggers.
            guard = Match(existing, existing * self._block_size, (), (), tuple(path))
            self.lock(guard)
            try:
                evicted = self.evict(self._num_blocks + wanted - self._capacity)
            finally:
                self.unlock(guard)
        room = max(0, self._capacity - self._num_blocks)
        to_store = min(wanted, room)
        parent = path[-1] if path else self._root_for(salt, create=to_store > 0)
        bs = self._block_size
        stored: list[int] = []
        for b in range(existing, existing + to_store):
            key = tuple(tokens[b * bs : (b + 1) * bs])
            value = values(b) if callable(values) else values[b]
            assert parent is not None  # _root_for created it: something is stored
            block_hash = self._hasher.extend(parent.block_hash, key)  # the root holds the seed
            node = _Node(key, parent, value, block_hash, now, private=salt is not None)
            parent.children[key] = node
            parent = node
            stored.append(block_hash)
            if salt is None:
                self._emit(CacheEvent(EventKind.STORED, block_hash))
        self._num_blocks += to_store
        if salt is not None:
            self._private_blocks += to_store
        self._stats["inserted_blocks"] += to_store
        self._stats["dropped_blocks"] += wanted - to_store if wanted > 0 else 0
        return InsertResult(
            existing_blocks=existing,
            stored_hashes=tuple(stored),
            evicted_hashes=tuple(evicted),
            dropped_blocks=max(0, wanted - to_store),
        )

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to `num_blocks` unlocked leaves, least recently used first.

        Returns the evicted blocks' hashes; fewer than asked when the rest is locked.
        """
        if num_blocks <= 0:
            return []
        heap: list[tuple[float, int, _Node[V]]] = []
        stack = list(self._root.children.values())
        for root in self._salted.values():
            stack.extend(root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.lock_ref == 0:
                heap.append((node.last_access, next(self._tiebreak), node))
        heapq.heapify(heap)
        evicted: list[int] = []
        while heap and len(evicted) < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None  # the root is never a candidate
            del parent.children[node.key]
            node.parent = None
            node.value = None  # release the stored tensor now
            self._num_blocks -= 1
            evicted.append(node.block_hash)
            if node.private:
                self._private_blocks -= 1
            else:
                self._emit(CacheEvent(EventKind.REMOVED, node.block_hash))
            if parent.parent is None:  # a root: the public one stays, a salted one goes
                self._drop_if_empty(parent)
            elif not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(self._tiebreak), parent))
        self._stats["evicted_blocks"] += len(evicted)
        return evicted

    def clear(self) -> list[int]:
        """Evict everything that is not locked; returns the evicted hashes."""
        return self.evict(self._num_blocks)

    # -- events and statistics ---------------------------------------------------------

    def _emit(self, event: CacheEvent) -> None:
        if len(self._events) >= MAX_PENDING_EVENTS:
            self._events.popleft()
            self._events_dropped += 1
        self._events.append(event)

    def drain_events(self) -> list[CacheEvent]:
        """Stored/removed events since the last call, oldest first.

        If more than MAX_PENDING_EVENTS piled up, the oldest were dropped (see
        `statistics()["events_dropped"]`); rebuild from `cached_hashes()` then.
        """
        events = list(self._events)
        self._events.clear()
        return events

    def statistics(self) -> dict[str, int]:
        """Counters and sizes, for metrics and summaries."""
        return {
            "num_blocks": self._num_blocks,
            "public_blocks": self.public_blocks,
            "capacity_blocks": self._capacity,
            "locked_blocks": self._locked_blocks,
            "pending_events": len(self._events),
            "events_dropped": self._events_dropped,
            **self._stats,
        }
