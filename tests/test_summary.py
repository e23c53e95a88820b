"""CacheSummary: round trips, strict validation; hostile bytes raise only RemoteProtocolError."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.bloom import BloomFilter
from protocols.errors import RemoteProtocolError
from protocols.summary import (
    BATCH_FIELDS,
    MAX_COUNT,
    MAX_SUMMARY_BYTES,
    CacheSummary,
    decode_summary,
    encode_summary,
)

PEER = "12D3KooWGRUVh7GkXDbdfa8zb5zWpWBX1G3DDoH2XNXvh8XxUSBq"


def make_summary(**changes: object) -> CacheSummary:
    bf = BloomFilter.for_capacity(100)
    bf.update(range(40))
    fields: dict[str, object] = {
        "peer_id": PEER,
        "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "block_size": 16,
        "seq": 7,
        "bloom_bits": bf.num_bits,
        "bloom_hashes": bf.num_hashes,
        "bloom": bf.to_bytes(),
        "cached_blocks": 40,
        "capacity_blocks": 100,
        "queued_prompt_tokens": 300,
        "running_requests": 2,
        "prefill_tokens_per_s": 512.5,
        "decode_tokens_per_s": 14.0,
    }
    fields.update(changes)
    return CacheSummary(**fields)  # type: ignore[arg-type]


def wire(**changes: object) -> bytes:
    obj = cbor2.loads(encode_summary(make_summary()))
    for key, value in changes.items():
        if value is dataclasses.MISSING:
            del obj[key]
        else:
            obj[key] = value
    return cbor2.dumps(obj)


BATCHING = {
    "waiting_requests": 3,
    "batch_slots": 32,
    "batch_decode_tokens_per_s": 61.5,
    "step_tokens": 256,
}


def batch_wire(**changes: object) -> bytes:
    obj = cbor2.loads(encode_summary(make_summary(**BATCHING)))
    obj.update(changes)
    return cbor2.dumps(obj)


counts = st.integers(0, MAX_COUNT)
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
MODEL_ID_RE = r"[a-z0-9][a-z0-9.-]{0,10}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,10})?"
rates = st.floats(0.0, 1e9, allow_nan=False)


@st.composite
def summaries(draw: st.DrawFn) -> CacheSummary:
    bf = BloomFilter(512 * draw(st.integers(1, 8)), draw(st.integers(1, 16)))
    bf.update(draw(st.lists(st.integers(0, 2**64 - 1), max_size=50)))
    return make_summary(
        peer_id=draw(st.text(BASE58, min_size=1, max_size=128)),
        model_id=draw(st.from_regex(MODEL_ID_RE, fullmatch=True)),
        block_size=draw(st.integers(1, 1024)),
        seq=draw(st.integers(0, 2**63 - 1)),
        bloom_bits=bf.num_bits,
        bloom_hashes=bf.num_hashes,
        bloom=bf.to_bytes(),
        cached_blocks=draw(counts),
        capacity_blocks=draw(counts),
        queued_prompt_tokens=draw(counts),
        running_requests=draw(counts),
        prefill_tokens_per_s=draw(rates),
        decode_tokens_per_s=draw(rates),
        **draw(batch_fields()),
        **draw(software_fields()),
    )


def software_fields() -> st.SearchStrategy[dict[str, object]]:
    """None (version 1 or 2) or the software fields drawn (version 3)."""
    return st.just({}) | st.fixed_dictionaries(
        {"software": st.from_regex(r"[A-Za-z0-9._+/-]{0,48}", fullmatch=True),
         "leaving": st.booleans()}
    )


def batch_fields() -> st.SearchStrategy[dict[str, object]]:
    """None (a peer that does not batch: version 1) or every batch field drawn (version 2)."""
    return st.just({}) | st.fixed_dictionaries(
        {
            "waiting_requests": counts,
            "batch_slots": st.integers(0, 1 << 16),
            "batch_decode_tokens_per_s": rates,
            "step_tokens": counts,
        }
    )


@settings(max_examples=100, deadline=None)
@given(summaries())
def test_round_trip(summary: CacheSummary) -> None:
    data = encode_summary(summary)
    assert len(data) <= MAX_SUMMARY_BYTES
    decoded = decode_summary(data)
    assert decoded == summary
    assert decoded.bloom_filter() == summary.bloom_filter()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_only_raise_remote_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_summary(data)


@settings(max_examples=300, deadline=None)
@given(summaries(), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3))
def test_mutated_summaries_decode_or_raise_remote_error(
    summary: CacheSummary, edits: list[tuple[int, int]]
) -> None:
    data = bytearray(encode_summary(summary))
    for where, byte in edits:
        data[where % len(data)] = byte
    with contextlib.suppress(RemoteProtocolError):
        assert isinstance(decode_summary(bytes(data)), CacheSummary)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([f.name for f in dataclasses.fields(CacheSummary)]),
    st.none() | st.booleans() | st.integers(-(2**64), 2**64 - 1) | st.floats() | st.text(max_size=5)
    | st.binary(max_size=5) | st.lists(st.integers(), max_size=2),
)
def test_any_field_value_decodes_or_raises_remote_error(name: str, value: object) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_summary(wire(**{name: value}))


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (wire(cached_blocks=-1), "cached_blocks"),
        (wire(cached_blocks=MAX_COUNT + 1), "cached_blocks"),
        (wire(seq=True), "seq must be an int"),
        (wire(block_size=0), "block_size"),
        (wire(prefill_tokens_per_s=math.nan), "prefill_tokens_per_s"),
        (wire(decode_tokens_per_s=math.inf), "decode_tokens_per_s"),
        (wire(decode_tokens_per_s=-1.0), "decode_tokens_per_s"),
        (wire(prefill_tokens_per_s="fast"), "must be a number"),
        (wire(bloom=b"\x00" * 3), "bloom has 3 bytes"),
        (wire(bloom_bits=1000), "multiple of 512"),
        (wire(bloom_hashes=0), "bloom_hashes"),
        (wire(bloom_hashes=17), "bloom_hashes"),
        (wire(bloom=bytearray(0).hex()), "bloom must be bytes"),
        (wire(peer_id="x/y"), "peer_id"),
        (wire(peer_id=""), "peer_id"),
        (wire(model_id="../etc"), "model id"),
        (wire(model_id="a//b"), "model id"),
        (wire(v=4), "version"),
        (wire(v=3), "missing"),  # version 3 has every key
        (wire(v=3, software="a b", leaving=False, **BATCHING), "software"),
        (wire(v=3, software="x", leaving=1, **BATCHING), "leaving"),
        (wire(v=2), "missing \\['batch_decode_tokens_per_s'"),  # v2 needs the batch keys
        (wire(v=1.0), "version"),
        (batch_wire(batch_slots=-1), "batch_slots"),
        (batch_wire(batch_slots=(1 << 16) + 1), "batch_slots"),
        (batch_wire(waiting_requests=MAX_COUNT + 1), "waiting_requests"),
        (batch_wire(batch_decode_tokens_per_s=math.nan), "batch_decode_tokens_per_s"),
        (batch_wire(step_tokens=1.5), "step_tokens must be an int"),
        (batch_wire(v=1), "unexpected"),  # the batch keys are version 2's
        (wire(v=dataclasses.MISSING), "version"),
        (wire(seq=dataclasses.MISSING), "missing \\['seq'\\]"),
        (wire(extra=1), "unexpected \\[\"'extra'\"\\]"),
        (cbor2.dumps([1, 2]), "must be a CBOR map"),
        (b"\x00" * (MAX_SUMMARY_BYTES + 1), "exceeds"),
        (encode_summary(make_summary())[:-1], "truncated"),
    ],
)
def test_invalid_summaries_are_rejected_with_reason(data: bytes, why: str) -> None:
    with pytest.raises(RemoteProtocolError, match=why):
        decode_summary(data)


def test_integral_rates_are_accepted_as_floats() -> None:
    decoded = decode_summary(wire(prefill_tokens_per_s=500))
    assert decoded.prefill_tokens_per_s == 500.0
    assert type(decoded.prefill_tokens_per_s) is float


def test_construction_validates_locally() -> None:
    with pytest.raises(ValueError):
        make_summary(seq=-1)
    with pytest.raises(ValueError):
        make_summary(bloom=b"")
    with pytest.raises(TypeError):
        make_summary(capacity_blocks=1.0)
    with pytest.raises(ValueError):
        make_summary(model_id="/abs/path")


def test_a_summary_without_batch_fields_is_version_1_and_reads_with_defaults() -> None:
    """What an older peer sends (exactly the 14 keys of version 1) still parses: the batch
    fields take their defaults, batch_slots = 0 meaning 'price as processor sharing'."""
    obj = cbor2.loads(encode_summary(make_summary()))
    assert obj["v"] == 1
    assert not set(BATCH_FIELDS) & obj.keys()
    assert len(obj) == 14
    decoded = decode_summary(cbor2.dumps(obj))
    assert decoded == make_summary()
    assert (decoded.waiting_requests, decoded.batch_slots, decoded.step_tokens) == (0, 0, 0)
    assert decoded.batch_decode_tokens_per_s == 0.0


def test_a_batching_summary_is_version_2_and_round_trips() -> None:
    summary = make_summary(**BATCHING)
    obj = cbor2.loads(encode_summary(summary))
    assert obj["v"] == 2
    assert {k: obj[k] for k in BATCH_FIELDS} == BATCHING
    assert decode_summary(encode_summary(summary)) == summary
    decoded = decode_summary(batch_wire(batch_decode_tokens_per_s=60))  # an int rate
    assert type(decoded.batch_decode_tokens_per_s) is float


def test_software_and_leaving_are_version_3_with_every_field() -> None:
    summary = make_summary(software="prefixswarm/0.1.0", leaving=True)
    obj = cbor2.loads(encode_summary(summary))
    assert obj["v"] == 3 and obj["software"] == "prefixswarm/0.1.0" and obj["leaving"] is True
    assert set(BATCH_FIELDS) <= obj.keys()  # at their defaults: version 3 has every key
    assert decode_summary(encode_summary(summary)) == summary
    assert cbor2.loads(encode_summary(make_summary(**BATCHING)))["v"] == 2  # unsaid: as before
