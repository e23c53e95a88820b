"""Private requests (a `cache_salt`): salted block hashes, separate cache namespaces, never
in the gossip summary; unsalted behaviour unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.engine.engine import SamplingParams
from peer.engine.radix import RadixCache
from peer.swarm.local_summary import build_summary
from protocols.blocks import BlockHasher
from protocols.bloom import BloomFilter

BS = 2
SALT_A = b"alice's secret"
SALT_B = b"bob's secret"


def make(capacity: int = 64) -> RadixCache[int]:
    return RadixCache(BS, capacity, BlockHasher("test-model", BS))


def test_salted_chains_differ_per_salt_and_from_the_public_chain():
    hasher = BlockHasher("m", 4)
    tokens = list(range(12))
    public = hasher.chain(tokens)
    a, b = hasher.chain(tokens, SALT_A), hasher.chain(tokens, SALT_B)
    assert len({*public, *a, *b}) == 9
    assert a == hasher.chain(tokens, SALT_A)  # deterministic: same salt, same hashes
    assert hasher.chain(tokens) == public  # unsalted unchanged
    with pytest.raises(ValueError):
        hasher.salted_seed(b"")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=10), st.binary(min_size=1, max_size=8))
def test_salted_blocks_match_only_with_their_salt(tokens, salt):
    cache = make()
    cache.insert(tokens, lambda b: b, 0.0, salt=salt)
    full = len(tokens) // BS * BS
    assert cache.peek(tokens, salt=salt) == full
    assert cache.peek(tokens) == 0
    assert cache.peek(tokens, salt=salt + b"x") == 0
    assert list(cache.cached_hashes()) == []
    assert cache.drain_events() == []
    assert cache.num_blocks == full // BS


def test_same_salt_shares_different_salt_does_not_unsalted_unchanged():
    cache = make()
    shared = [1, 2, 3, 4, 5, 6]
    cache.insert([*shared, 7, 8], lambda b: b, 0.0, salt=SALT_A)
    m = cache.match([*shared, 9, 9], 1.0, salt=SALT_A)
    assert m.num_tokens == 6
    assert m.hashes == tuple(cache.hasher.chain(shared, SALT_A))
    assert cache.match(shared, 1.0, salt=SALT_B).num_tokens == 0
    assert cache.match(shared, 1.0).num_tokens == 0
    result = cache.insert(shared, lambda b: b, 2.0)  # the same tokens, public
    assert result.stored_hashes == tuple(cache.hasher.chain(shared))
    assert set(cache.cached_hashes()) == set(cache.hasher.chain(shared))
    assert cache.num_blocks == 4 + 3


def test_private_blocks_are_evicted_silently_and_their_root_goes():
    cache = make(capacity=3)
    cache.insert([1, 2, 3, 4], lambda b: b, 0.0, salt=SALT_A)
    cache.drain_events()
    cache.insert([5, 6, 7, 8], lambda b: b, 1.0)  # evicts the LRU private leaf
    events = cache.drain_events()
    assert [e.kind.value for e in events] == ["stored", "stored"]
    assert cache.num_blocks == 3
    cache.insert([9, 9, 9, 9], lambda b: b, 2.0)  # evicts the rest of the private chain
    assert cache.peek([1, 2, 3, 4], salt=SALT_A) == 0
    assert cache._salted == {}  # no empty salted roots are kept
    assert cache.statistics()["num_blocks"] == 3


async def test_engine_private_requests_share_cache_only_per_salt(tiny_engine):
    prompt = [100 + 7 * i % 5000 for i in range(40)]
    params = SamplingParams(max_new_tokens=3)
    first = await tiny_engine.generate(prompt, params, cache_salt=SALT_A)
    again = await tiny_engine.generate(prompt, params, cache_salt=SALT_A)
    other = await tiny_engine.generate(prompt, params, cache_salt=SALT_B)
    public = await tiny_engine.generate(prompt, params)
    assert [c.usage.cached_tokens for c in (first, again, other, public)] == [0, 32, 0, 0]
    assert first.token_ids == again.token_ids == other.token_ids == public.token_ids
    assert tiny_engine.local_match_tokens(prompt, SALT_A) == 32
    # Only the public request's blocks reach the gossip summary.
    summary = build_summary(tiny_engine, peer_id="p", seq=1, fp_rate=0.01)
    bloom = BloomFilter.from_bytes(summary.bloom_bits, summary.bloom_hashes, summary.bloom)
    public_hashes = tiny_engine.hasher.chain(prompt)
    assert all(h in bloom for h in public_hashes)
    for salt in (SALT_A, SALT_B):
        assert not any(h in bloom for h in tiny_engine.hasher.chain(prompt, salt))
    assert set(tiny_engine.cache.cached_hashes()) == set(public_hashes)
    assert summary.cached_blocks == len(public_hashes)  # the count matches the filter


async def test_a_private_request_is_served_by_the_entry_even_when_a_peer_holds_its_prefix(
    nursery, tiny_engine_factory
):
    from peer.request.pipeline import Outcome
    from tests.test_pipeline import reference, start_swarm, tokens, wait_for_match

    a, b = await start_swarm(nursery, [tiny_engine_factory() for _ in range(2)])
    prefix = tokens(640, seed=1)
    prompt = prefix + tokens(20, seed=2)
    await b.peer.engine.generate(prefix + tokens(9, seed=3), SamplingParams(max_new_tokens=1))
    await wait_for_match(a, b, prompt, len(prefix) // 16)
    params = SamplingParams(max_new_tokens=6)
    public = await a.peer.generate(prompt, params)
    assert public.served_by == b.peer.peer_id  # the premise: b is the router's choice

    private = await a.peer.generate(prompt, params, cache_salt=SALT_A)

    assert private.served_by == a.peer.peer_id
    assert [(x.peer_id, x.outcome) for x in private.route] == [(a.peer.peer_id, Outcome.OK)]
    assert private.token_ids == await reference(tiny_engine_factory, prompt, params)
    again = await a.peer.generate(prompt, params, cache_salt=SALT_A)
    assert again.cached_tokens == 656  # its own private blocks, on a
    assert not any(h in set(a.peer.engine.cache.cached_hashes())
                   for h in a.peer.engine.hasher.chain(prompt, SALT_A))


# -- summaries count only what they announce ----------------------------------------------

_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "evict"]),
        st.lists(st.integers(0, 3), min_size=2, max_size=8),
        st.sampled_from([None, SALT_A, SALT_B]),
    ),
    max_size=20,
)


@settings(max_examples=200, deadline=None)
@given(_ops, st.integers(1, 12))
def test_public_blocks_counts_exactly_the_announced_hashes(ops, capacity):
    """Through any mix of public and salted inserts and evictions, `public_blocks` is the
    number of `cached_hashes()` (what the summary's filter holds), and the private ones
    make up the rest of `num_blocks`."""
    cache = make(capacity)
    for now, (op, tokens, salt) in enumerate(ops):
        if op == "insert":
            cache.insert(tokens, lambda b: b, float(now), salt=salt)
        else:
            cache.evict(len(tokens) // BS)
        assert cache.public_blocks == len(list(cache.cached_hashes()))
        assert 0 <= cache.public_blocks <= cache.num_blocks <= capacity


class _CacheOnly:
    """The engine view build_summary reads, around a bare RadixCache."""

    def __init__(self, cache: RadixCache[int]) -> None:
        from peer.engine.api import EngineLoad

        self.cache = cache
        self.model_id = "test-model"
        self.block_size = BS
        self._load = EngineLoad(0, 0, 0.0, 0.0)

    def load(self):
        return self._load


def test_a_peer_serving_private_requests_stays_in_other_tables():
    """Many private blocks beside a few public ones: the summary counts the public ones
    only, so its fill matches its count and another peer's table keeps the peer (it used
    to count every block and be dropped as bloom_inconsistent)."""
    from peer.swarm.peer_table import PeerTable, Verdict

    cache = make(capacity=4096)
    cache.insert(list(range(40)), lambda b: b, 0.0)  # 20 public blocks
    for i in range(8):  # 8 private requests of 600 tokens: 2,400 salted blocks
        cache.insert([i, *range(1000, 1599)], lambda b: b, 1.0, salt=bytes([i + 1]))
    assert cache.num_blocks == 20 + 8 * 300 and cache.public_blocks == 20
    summary = build_summary(_CacheOnly(cache), peer_id="server", seq=1, fp_rate=0.01)
    assert summary.cached_blocks == 20
    table = PeerTable("other", "test-model", BS, expiry_s=10.0)
    result = table.apply(summary, "server", now=0.0)
    assert result.accepted and result.reason is Verdict.NEW_PEER, result
