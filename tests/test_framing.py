"""Frames and strict CBOR: round trips, chunked decoding, and hostile bytes."""

from __future__ import annotations

import contextlib
import math
import time

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.errors import RemoteProtocolError
from protocols.framing import (
    MAX_CBOR_DEPTH,
    MAX_FRAME_BYTES,
    FrameDecoder,
    decode_cbor,
    encode_frame,
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=5) | st.integers(-10, 10), children, max_size=5),
    max_leaves=30,
)


def decode_all(decoder: FrameDecoder) -> list[object]:
    out = []
    while (frame := decoder.next_frame()) is not None:
        out.append(frame)
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(values.filter(lambda v: v is not None), min_size=1, max_size=4),
    st.lists(st.integers(1, 50), max_size=30),
)
def test_frames_round_trip_in_arbitrary_chunks(objs: list[object], cuts: list[int]) -> None:
    stream = b"".join(encode_frame(obj) for obj in objs)
    decoder = FrameDecoder()
    got: list[object] = []
    pos = 0
    for cut in cuts:
        decoder.feed(stream[pos : pos + cut])
        pos += cut
        got += decode_all(decoder)
    decoder.feed(stream[pos:])
    got += decode_all(decoder)
    assert got == objs
    assert decoder.buffered == 0
    decoder.end_of_stream()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decode_cbor_of_arbitrary_bytes_returns_or_raises_remote_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_cbor(data)


@settings(max_examples=300, deadline=None)
@given(values, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4))
def test_decode_cbor_of_mutated_valid_bytes(obj: object, edits: list[tuple[int, int]]) -> None:
    data = bytearray(cbor2.dumps(obj))
    for where, byte in edits:
        data[where % len(data)] = byte
    with contextlib.suppress(RemoteProtocolError):
        decode_cbor(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 64))
def test_frame_decoder_of_arbitrary_bytes_only_raises_remote_error(
    data: bytes, max_size: int
) -> None:
    decoder = FrameDecoder(max_size=max_size)
    try:
        for i in range(0, len(data), 7):
            decoder.feed(data[i : i + 7])
            decode_all(decoder)
        decoder.end_of_stream()
    except RemoteProtocolError:
        with pytest.raises(RemoteProtocolError):  # failed decoders stay failed
            decoder.next_frame()


def test_oversize_header_fails_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_size=100)
    decoder.feed(b"\x00\x00")
    assert decoder.next_frame() is None
    with pytest.raises(RemoteProtocolError, match="exceeds the limit of 100"):
        decoder.feed(b"\x00\x65")
    with pytest.raises(RemoteProtocolError):
        decoder.feed(b"more")


def test_default_limit_and_encode_oversize_is_local_error() -> None:
    frame = encode_frame(b"x" * 100)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    with pytest.raises(ValueError, match="exceeds"):
        encode_frame(b"x" * 100, max_size=50)
    with pytest.raises(ValueError):
        encode_frame(b"x" * MAX_FRAME_BYTES)
    with pytest.raises(ValueError):
        FrameDecoder(max_size=0)


def test_null_frame_is_rejected_both_ways() -> None:
    with pytest.raises(ValueError):
        encode_frame(None)
    decoder = FrameDecoder()
    decoder.feed(b"\x00\x00\x00\x01\xf6")
    with pytest.raises(RemoteProtocolError, match="null"):
        decoder.next_frame()


def test_truncated_stream_is_reported() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frame([1, 2, 3])[:-1])
    assert decoder.next_frame() is None
    with pytest.raises(RemoteProtocolError, match="stream ended inside a frame"):
        decoder.end_of_stream()


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x9b" + (2**63).to_bytes(8, "big"), "container claims"),  # array of 2^63 items
        (b"\xbb" + (2**40).to_bytes(8, "big") + b"\x00", "container claims"),  # huge map
        (b"\x5b" + (2**62).to_bytes(8, "big"), "string claims"),  # 2^62-byte string
        (b"\x81" * (MAX_CBOR_DEPTH + 1) + b"\x00", "nesting"),
        (b"\xc1\x1b" + (2**63).to_bytes(8, "big"), "tags"),  # epoch datetime
        (b"\xc5\x82\x1b" + (2**40).to_bytes(8, "big") + b"\x01", "tags"),  # bigfloat bomb
        (b"\xd8\x1c\x81\xd8\x1d\x00", "tags"),  # cyclic shared reference
        (b"\x9f\x00\xff", "indefinite"),
        (b"\xf7", "simple value"),  # undefined
        (b"\x00\x00", "trailing"),
        (b"", "truncated"),
        (b"\xa1\x80\x00", "map keys"),
        (b"\xa2\x61a\x01\x61a\x02", "duplicate key"),
        (b"\x62\xff\xfe", "invalid CBOR"),  # bad UTF-8
    ],
)
def test_hostile_cbor_is_rejected_cheaply(data: bytes, why: str) -> None:
    start = time.perf_counter()
    with pytest.raises(RemoteProtocolError, match=why):
        decode_cbor(data)
    assert time.perf_counter() - start < 0.1


def test_depth_limit_allows_our_nesting() -> None:
    nested: object = 0
    for _ in range(MAX_CBOR_DEPTH):
        nested = [nested]
    assert decode_cbor(cbor2.dumps(nested)) == nested


def test_floats_keep_their_value() -> None:
    assert math.isnan(decode_cbor(cbor2.dumps(math.nan)))  # type: ignore[arg-type]
    assert decode_cbor(cbor2.dumps(math.inf)) == math.inf
    assert decode_cbor(b"\xf9\x3c\x00") == 1.0  # half precision
