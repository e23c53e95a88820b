"""The pure cores of gossip mode ring's lookup beyond the ring (docs/protocol.md 5.4):
provider records at home peers (peer/swarm/providers.py), the entry peer's decisions
(peer/swarm/interest.py) and the wire format (protocols/roots.py)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.engine.radix import RadixCache
from peer.swarm.interest import Interest, Lookups
from peer.swarm.neighbourhood import ring_position
from peer.swarm.providers import (
    ANNOUNCE_REFRESH_S,
    RECORD_TTL_S,
    REFUSAL_S,
    HomeRing,
    ProviderIndex,
    RootAnnouncer,
)
from protocols.blocks import BlockHasher
from protocols.errors import RemoteProtocolError
from protocols.framing import FrameDecoder, encode_cbor, encode_frame
from protocols.roots import (
    MAX_ROOTS_PER_ANNOUNCE,
    Ack,
    Announce,
    Find,
    Match,
    Matched,
    Providers,
    SummaryQuery,
    SummaryReply,
    decode_ack,
    decode_matched,
    decode_providers,
    decode_request,
    decode_summary_reply,
)

PEERS = [f"p{i}" for i in range(10)]
ROOTS = [ring_position(f"root{i}") for i in range(12)]  # spread over the ring

# -- ProviderIndex (the home) -------------------------------------------------------------


def test_provider_index_keeps_the_newest_bounded_and_expires() -> None:
    index = ProviderIndex(ttl_s=10.0, max_per_root=3)
    for i in range(5):
        assert index.announce(7, f"p{i}", float(i))
    assert index.providers(7, 5.0) == ["p4", "p3", "p2"]  # newest first, 3 kept
    index.announce(7, "p2", 6.0)  # a refresh moves it to the front
    assert index.providers(7, 6.0) == ["p2", "p4", "p3"]
    index.withdraw(7, "p4")
    assert index.providers(7, 6.0) == ["p2", "p3"]
    assert index.providers(7, 13.5) == ["p2"]  # p3's record (t=3) is older than 10 s
    assert index.providers(8, 0.0) == []
    index.withdraw(7, "p2")
    assert len(index) == 0 and index.records_of("p2") == index.records_of("p3") == 0
    with pytest.raises(ValueError):
        ProviderIndex(ttl_s=0.0)


def test_provider_index_bounds_each_announcer_and_expires_whole_roots() -> None:
    index = ProviderIndex(ttl_s=10.0, max_per_provider=2, max_roots=3)
    assert index.announce(1, "greedy", 0.0) and index.announce(2, "greedy", 0.0)
    assert not index.announce(3, "greedy", 0.0)  # a third record: refused
    assert index.announce(1, "greedy", 1.0)  # a refresh is not a new record
    assert index.announce(3, "other", 2.0) and index.announce(4, "other", 3.0)
    assert len(index) == 3  # root 2, the least recently announced, made room
    assert index.records_of("greedy") == 1 and index.providers(2, 3.0) == []
    assert index.expire(11.5) == 1  # root 1 (last announced at 1.0); root 3 is live
    assert index.providers(3, 11.5) == ["other"] and len(index) == 2


ops = st.lists(
    st.tuples(st.booleans(), st.sampled_from(ROOTS[:4]), st.sampled_from(PEERS[:5]),
              st.floats(0.0, 30.0)),
    max_size=60,
)  # (announce?, root, peer, time step)


@settings(max_examples=100, deadline=None)
@given(ops, st.floats(0.0, 50.0))
def test_no_false_negatives_for_what_a_home_was_told(
    steps: list[tuple[bool, int, str, float]], later: float
) -> None:
    """Within its bounds a home answers exactly what it was told and not withdrawn,
    newer than the TTL: no false negatives, and no record it was not given."""
    index = ProviderIndex(ttl_s=40.0)
    told: dict[tuple[int, str], float] = {}
    now = 0.0
    for announce, root, peer, dt in steps:
        now += dt
        if announce:
            assert index.announce(root, peer, now)
            told[(root, peer)] = now
        else:
            index.withdraw(root, peer)
            told.pop((root, peer), None)
    now += later
    for root in ROOTS[:4]:
        live = {p for (r, p), t in told.items() if r == root and now - t < 40.0}
        got = index.providers(root, now)
        assert set(got) == live and len(got) == len(live)
        assert got == sorted(got, key=lambda p: -told[(root, p)])  # newest first


# -- HomeRing -----------------------------------------------------------------------------


def _distance(a: int, b: int) -> int:
    return min((a - b) % (1 << 64), (b - a) % (1 << 64))


@settings(max_examples=60, deadline=None)
@given(st.sets(st.sampled_from(PEERS), min_size=1), st.integers(0, (1 << 64) - 1),
       st.sets(st.sampled_from(PEERS)))
def test_homes_are_the_nearest_members_not_refused(
    members: set[str], root: int, refused: set[str]
) -> None:
    ring = HomeRing(homes=2)
    ring.update(members)
    for peer in refused:
        ring.refuse(peer, 0.0)
    brute = sorted((_distance(ring_position(p), root), p) for p in members - refused)
    assert ring.homes(root, 1.0) == tuple(p for _, p in brute[:2])
    everyone = sorted((_distance(ring_position(p), root), p) for p in members)
    assert ring.homes(root, REFUSAL_S) == tuple(p for _, p in everyone[:2])  # refusals lapse


def test_a_home_ring_counts_itself_and_reports_changes() -> None:
    ring = HomeRing("me")
    assert ring.update(["a", "b"]) and ring.members == {"me", "a", "b"}
    assert not ring.update(["b", "a", "me"])  # the same peers
    v = ring.version(0.0)
    ring.refuse("me", 0.0)  # never refuses itself
    assert ring.version(0.0) == v
    ring.refuse("a", 0.0)
    assert ring.version(0.0) > v and "a" not in ring.homes(ROOTS[0], 0.0)


# -- RootAnnouncer: anti-entropy over lossy messages ---------------------------------------


class _Swarm:
    """Holders announcing to homes through a lossy channel; every home an index."""

    def __init__(self, peers: list[str]) -> None:
        self.ring = HomeRing()
        self.ring.update(peers)
        self.announcers = {p: RootAnnouncer() for p in peers}
        self.indices = {p: ProviderIndex() for p in peers}

    def sync(self, holder: str, roots: list[int], now: float, lose: bool) -> None:
        for msg in self.announcers[holder].sync(roots, self.ring, now):
            if lose:
                continue
            for root in msg.drop:
                self.indices[msg.home].withdraw(root, holder)
            for root in msg.add:
                assert self.indices[msg.home].announce(root, holder, now)

    def providers(self, root: int, now: float) -> list[set[str]]:
        return [set(self.indices[h].providers(root, now)) for h in self.ring.homes(root, now)]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(PEERS[:4]), st.sets(st.sampled_from(ROOTS[:6])),
                       st.booleans()), min_size=1, max_size=30),
    st.floats(1.0, 10.0),
)  # fmt: skip
def test_announcements_converge_after_message_loss(
    changes: list[tuple[str, set[int], bool]], step: float
) -> None:
    """Holders change what they hold and sync at every summary (each sync's messages
    lost or not); once messages flow again, within the record TTL every home of every
    root lists exactly the holders of that root (lost announcements come back with the
    refresh, lost withdrawals lapse). It fails without refreshes or without the TTL."""
    peers = PEERS[:6]
    swarm = _Swarm(peers)
    holding = {p: set[int]() for p in peers}
    now = 0.0
    for holder, roots, lose in changes:
        now += step
        holding[holder] = roots
        swarm.sync(holder, sorted(roots), now, lose)
    end = now + RECORD_TTL_S + step
    while now < end:  # unchanged caches, a summary every `step` seconds, nothing lost
        now += step
        for holder in peers:
            swarm.sync(holder, sorted(holding[holder]), now, lose=False)
    for root in ROOTS[:6]:
        holders = {p for p in peers if root in holding[p]}
        assert swarm.providers(root, now) == [holders, holders]


def test_announcer_batches_per_home_moves_roots_and_resends_after_a_failure() -> None:
    ring = HomeRing("me")
    ring.update(PEERS[:5])
    announcer = RootAnnouncer()
    roots = ROOTS[:8]
    first = announcer.sync(roots, ring, 0.0)
    assert len({m.home for m in first}) == len(first)  # one message per home
    assert sorted(r for m in first for r in m.add) == sorted(r for r in roots for _ in (1, 2))
    assert announcer.sync(roots, ring, 1.0) == []  # nothing new: nothing sent
    gone = roots[0]
    assert announcer.sync(roots[1:], ring, 1.5) == []  # a withdrawal waits for company
    shared = ring.homes(gone, 2.0)[0]
    new = next(r for r in (ring_position(f"n{i}") for i in range(999))
               if shared in ring.homes(r, 2.0) and r not in roots)
    roots = [*roots, new]
    with_new = {m.home: m for m in announcer.sync(roots[1:], ring, 2.0)}
    assert with_new[shared].add == (new,) and with_new[shared].drop == (gone,)
    late = {m.home: m.drop for m in announcer.sync(roots[1:], ring, 1.5 + ANNOUNCE_REFRESH_S)}
    assert all(late.get(h) == (gone,) for h in ring.homes(gone, 2.0) if h != shared)
    t = 2.5 + ANNOUNCE_REFRESH_S
    home = ring.homes(roots[1], t)[0]
    announcer.failed(home)
    ring.refuse(home, t)
    moved = announcer.sync(roots[1:], ring, t + 1.0)
    assert all(m.home != home for m in moved)
    assert roots[1] in {r for m in moved for r in m.add}
    assert home not in announcer.homes_of(roots[1])
    refreshed = announcer.sync(roots[1:], ring, t + 1.0 + ANNOUNCE_REFRESH_S)
    assert sorted(r for m in refreshed for r in m.add) == sorted(
        r for r in roots[1:] for _ in announcer.homes_of(r)
    )
    many = [ring_position(f"x{i}") for i in range(MAX_ROOTS_PER_ANNOUNCE * 3)]
    assert all(len(m.add) <= MAX_ROOTS_PER_ANNOUNCE for m in announcer.sync(many, ring, 9e3))


# -- Lookups (the entry peer) -------------------------------------------------------------


def test_lookups_unless_the_root_is_here_or_the_whole_prompt_is_heard_and_spaced() -> None:
    lookups = Lookups(Interest(4, lookup_gap_s=2.0), random.Random(1))
    assert not lookups.wanted(7, local_blocks=1, heard_blocks=0, chain_blocks=5, now=0.0)
    assert not lookups.wanted(7, local_blocks=0, heard_blocks=5, chain_blocks=5, now=0.0)
    assert lookups.wanted(7, 0, 4, 5, 0.0)  # a heard peer holds part: another may hold more
    assert not lookups.wanted(7, 0, 0, 5, 1.0)  # within the gap
    assert lookups.wanted(7, 0, 0, 5, 2.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(PEERS), max_size=16), st.sets(st.sampled_from(PEERS)),
       st.integers(0, 1000))
def test_holders_probed_are_few_distinct_and_not_heard_already(
    providers: list[str], heard: set[str], seed: int
) -> None:
    lookups = Lookups(Interest(8), random.Random(seed), probes_per_lookup=4)
    probed = lookups.holders_to_probe(providers, heard)
    assert len(probed) == len(set(probed)) == min(4, len(set(providers) - heard))
    assert set(probed) <= set(providers) - heard


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(PEERS), st.integers(0, 20)), st.integers(0, 20),
       st.integers(0, 1000))
def test_the_longest_matches_beyond_what_is_heard_are_asked_for_summaries(
    matches: dict[str, int], heard: int, seed: int
) -> None:
    lookups = Lookups(Interest(8), random.Random(seed), providers_per_lookup=2)
    asked = lookups.holders_to_ask(matches, heard)
    better = sorted((m for m in matches.values() if m > heard), reverse=True)
    assert sorted((matches[p] for p in asked), reverse=True) == better[:2]
    assert len(set(asked)) == len(asked)


def test_lookup_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        Lookups(Interest(8), random.Random(0), providers_per_lookup=3, probes_per_lookup=2)


def test_only_holders_whose_summary_shows_the_root_are_heard() -> None:
    lookups = Lookups(Interest(2), random.Random(0))
    change = lookups.admit(["liar", "holder", "ring"], lambda p: p != "liar", exclude=["ring"])
    assert change == (("holder",), ())
    assert lookups.interest.members == {"holder"}
    lookups.touch("holder")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([f"p{i}" for i in range(12)]), max_size=4),
                max_size=30), st.integers(0, 6))
def test_interest_stays_bounded_and_reports_what_changed(
    batches: list[list[str]], size: int
) -> None:
    interest = Interest(size, lookup_gap_s=1.0)
    members: set[str] = set()
    for batch in batches:
        change = interest.add(batch, exclude=["p0"])
        members = (members | set(change.added)) - set(change.removed)
        assert members == interest.members
        assert len(members) <= size and "p0" not in members


def test_interest_lookups_are_spaced_per_root_and_useful_peers_stay() -> None:
    interest = Interest(2, lookup_gap_s=2.0)
    assert interest.should_lookup(1, 0.0)
    assert not interest.should_lookup(1, 1.9)
    assert interest.should_lookup(2, 1.9)  # another root
    assert interest.should_lookup(1, 2.0)
    interest.add(["a", "b"])
    interest.touch("a")  # a was used: b is the least recently useful
    change = interest.add(["c"])
    assert change == (("c",), ("b",))
    assert not Interest(0).should_lookup(1, 0.0)  # no room: never look up


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5), st.integers(0, 99)),
                min_size=1, max_size=12), st.integers(4, 40))
def test_a_holder_matches_a_chain_by_hash_as_its_cache_matches_tokens(
    prompts: list[tuple[int, int, int]], capacity: int
) -> None:
    """What a Match answers (the walk by block hash) is what the cache holds of those
    tokens; private (salted) blocks are never matched."""
    hasher = BlockHasher("m", 4)
    cache: RadixCache[None] = RadixCache(4, capacity, hasher)

    def tokens(prefix: int, blocks: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [prefix] * 8 + [rng.randrange(50) for _ in range(4 * blocks)]

    for i, p in enumerate(prompts):
        need = cache.num_blocks + len(tokens(*p)) // 4 - capacity
        if need > 0:
            cache.evict(need)
        cache.insert(tokens(*p), lambda _b: None, float(i))
    for p in prompts:
        t = tokens(*p)
        assert cache.match_hashes(hasher.chain(t)) == cache.peek(t) // 4
    private: RadixCache[None] = RadixCache(4, 64, hasher)
    t = tokens(*prompts[0])
    private.insert(t, lambda _b: None, 0.0, salt=b"secret")
    assert private.match_hashes(hasher.chain(t)) == 0


# -- protocols/roots.py ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [Announce((1, 2**64 - 1), (3,)), Find(5), Match((4, 5, 6)), SummaryQuery()],
)
def test_requests_round_trip(message: Announce | Find | Match | SummaryQuery) -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frame(message.to_wire()))
    assert decode_request(decoder.next_frame()) == message


def test_replies_round_trip_and_wrong_ones_are_refused() -> None:
    assert decode_ack(Ack(3).to_wire()) == Ack(3)
    providers = Providers(9, ("a1", "b2"))
    assert decode_providers(providers.to_wire(), 9) == providers
    dup = {**providers.to_wire(), "peers": ["a1", "a1", "b2"], "extra": 1}  # unknown key ok
    assert decode_providers(dup, 9) == providers
    assert decode_summary_reply(SummaryReply(b"xyz").to_wire()).data == b"xyz"
    asked = Match((1, 2, 3))
    assert decode_matched(Matched(2).to_wire(), asked) == Matched(2)
    seventeen = [f"p{i}" for i in range(17)]
    bad = [
        (lambda: decode_providers(providers.to_wire(), 8)),  # not the root asked about
        (lambda: decode_providers({**providers.to_wire(), "peers": ["a b"]}, 9)),
        (lambda: decode_providers({**providers.to_wire(), "peers": [["x"]]}, 9)),
        (lambda: decode_providers({**providers.to_wire(), "peers": seventeen}, 9)),
        (lambda: decode_ack({**Ack(3).to_wire(), "v": 2})),  # a version we do not know
        (lambda: decode_ack(Find(1).to_wire())),  # the wrong kind
        (lambda: decode_request({"t": "announce", "v": 1, "add": [-1]})),
        (lambda: decode_request({"t": "announce", "v": 1, "add": [0] * 513})),
        (lambda: decode_request({"t": "find", "v": 1, "root": True})),
        (lambda: decode_request({"t": "find", "v": 1})),
        (lambda: decode_request([1, 2])),
        (lambda: decode_request({"t": "match", "v": 1, "chain": [0] * 513})),
        (lambda: decode_request({"t": "match", "v": 1, "chain": 7})),
        (lambda: decode_matched(Matched(4).to_wire(), asked)),  # more than it was asked
    ]
    for call in bad:
        with pytest.raises(RemoteProtocolError):
            call()
    with pytest.raises(ValueError):
        Announce(add=(-1,))


cbor_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64) + 1, 2**64 - 1) | st.text(max_size=8)
    | st.binary(max_size=8) | st.floats(allow_nan=True),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["t", "v", "add", "drop", "root", "peers", "kept",
                                       "data", "x"]), inner, max_size=5),
    max_leaves=12,
)  # fmt: skip
kinds = st.sampled_from(["announce", "find", "match", "summary_query", "ack", "providers",
                         "matched", "summary"])


@settings(max_examples=300, deadline=None)
@given(cbor_values, kinds, st.booleans())
def test_decoders_either_return_a_message_or_raise_remote_protocol_error(
    value: object, kind: str, framed: bool
) -> None:
    if framed and isinstance(value, dict):
        value = {**value, "t": kind, "v": 1}
    if framed:  # through the frame decoder, as bytes from the wire arrive
        decoder = FrameDecoder()
        try:
            decoder.feed(encode_frame(value) if value is not None else encode_cbor(0))
            value = decoder.next_frame()
        except (RemoteProtocolError, ValueError):
            return
    for decode in (decode_request, decode_ack, lambda v: decode_providers(v, 5),
                   lambda v: decode_matched(v, Match((1, 2))), decode_summary_reply):
        try:
            message = decode(value)
        except RemoteProtocolError:
            continue
        assert isinstance(
            message, (Announce, Find, Match, SummaryQuery, Ack, Providers, Matched, SummaryReply)
        )


def test_constants_hold_together() -> None:
    assert ANNOUNCE_REFRESH_S * 2 < RECORD_TTL_S  # two refreshes may be lost
    assert math.isfinite(REFUSAL_S)
