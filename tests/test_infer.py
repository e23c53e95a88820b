"""The inference protocol frames: bounds, round trips, and hostile input."""

from __future__ import annotations

import math
from dataclasses import replace

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.engine.api import SamplingParams
from peer.request.forward import infer_request
from protocols.errors import RemoteProtocolError
from protocols.framing import FRAME_HEADER_BYTES, MAX_FRAME_BYTES, decode_cbor, encode_frame
from protocols.infer import (
    MAX_CHUNK_TEXT_LEN,
    MAX_CHUNK_TOKENS,
    MAX_ERROR_MESSAGE_LEN,
    MAX_HOPS,
    MAX_NEW_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_ID_LEN,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    ErrorCode,
    FinishReason,
    InferError,
    InferRequest,
    InferResult,
    TokenChunk,
    parse_frame,
    parse_request,
    parse_response,
)

VOCAB = 1000


def make_request(**changes: object) -> InferRequest:
    fields: dict[str, object] = {
        "request_id": "req-1",
        "prompt_token_ids": (1, 2, 3),
        "max_new_tokens": 8,
        "deadline_s": 30.0,
    }
    fields.update(changes)
    return InferRequest(**fields)  # type: ignore[arg-type]


def wire(**changes: object) -> dict[str, object]:
    obj = make_request().to_wire()
    obj.update(changes)
    return obj


def test_request_round_trip_through_cbor() -> None:
    request = make_request(temperature=0.7, top_p=0.9, seed=42, stop=("\n\n", "END"), hops=1)
    back = parse_request(cbor2.loads(cbor2.dumps(request.to_wire())), VOCAB)
    assert back == request


def test_responses_round_trip_through_cbor() -> None:
    frames = [
        TokenChunk((5, 6), "hi"),
        TokenChunk((), ""),
        InferResult(100, 64, 8, 0.25, 12.5, 0.9, FinishReason.LENGTH, "12D3KooWpeer"),
        InferError(ErrorCode.OVERLOADED, "queue full (64 waiting)"),
    ]
    for frame in frames:
        assert parse_response(cbor2.loads(cbor2.dumps(frame.to_wire())), VOCAB) == frame
        assert parse_frame(frame.to_wire(), VOCAB) == frame


def test_direction_is_checked() -> None:
    with pytest.raises(RemoteProtocolError, match="response was expected"):
        parse_response(make_request().to_wire(), VOCAB)
    with pytest.raises(RemoteProtocolError, match="expected an infer request"):
        parse_request(TokenChunk((1,)).to_wire(), VOCAB)


def test_token_ids_checked_against_vocabulary() -> None:
    assert parse_request(wire(prompt=[0, VOCAB - 1]), VOCAB).prompt_token_ids == (0, VOCAB - 1)
    with pytest.raises(RemoteProtocolError, match="vocabulary size"):
        parse_request(wire(prompt=[1, VOCAB]), VOCAB)
    with pytest.raises(RemoteProtocolError, match="vocabulary size"):
        parse_response(TokenChunk((VOCAB,)).to_wire(), VOCAB)
    with pytest.raises(RemoteProtocolError, match="non-negative"):
        parse_request(wire(prompt=[-1]), VOCAB)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prompt": []}, "prompt_token_ids"),
        ({"prompt": [1] * (MAX_PROMPT_TOKENS + 1)}, "'prompt' holds"),
        ({"prompt": [1, True]}, "must hold ints"),
        ({"prompt": [1.0]}, "must hold ints"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": MAX_NEW_TOKENS + 1}, "max_new_tokens"),
        ({"max_new_tokens": True}, "must be an int"),
        ({"deadline_s": 0.0}, "deadline_s"),
        ({"deadline_s": math.inf}, "finite"),
        ({"deadline_s": math.nan}, "finite"),
        ({"deadline_s": 10**400}, "out of range"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"temperature": 1.0, "seed": None}, "needs a seed"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "'stop' holds"),
        ({"stop": ["x" * (MAX_STOP_LEN + 1)]}, "stop string"),
        ({"stop": [""]}, "stop string"),
        ({"stop": "END"}, "must be a list"),
        ({"hops": MAX_HOPS + 1}, "hops"),
        ({"hops": -1}, "hops"),
        ({"id": ""}, "request_id"),
        ({"id": "x" * (MAX_REQUEST_ID_LEN + 1)}, "request_id"),
        ({"id": "a\nb"}, "printable"),
        ({"id": 7}, "must be a str"),
        ({"t": "nonsense"}, "expected an infer request"),
    ],
)
def test_request_bounds(changes: dict[str, object], message: str) -> None:
    with pytest.raises(RemoteProtocolError, match=message):
        parse_request(wire(**changes), VOCAB)


def test_missing_field_is_named() -> None:
    obj = wire()
    del obj["deadline_s"]
    with pytest.raises(RemoteProtocolError, match="lacks 'deadline_s'"):
        parse_request(obj, VOCAB)


def test_unknown_keys_are_ignored() -> None:
    assert parse_request(wire(future_field=[1, 2]), VOCAB) == make_request()


@pytest.mark.parametrize(
    "obj",
    [
        {"t": "chunk", "tokens": [1] * (MAX_CHUNK_TOKENS + 1), "text": ""},
        {"t": "chunk", "tokens": [1], "text": b"bytes"},
        {"t": "error", "code": "teapot", "message": ""},
        {"t": "error", "code": "internal", "message": "x" * (MAX_ERROR_MESSAGE_LEN + 1)},
        {**InferResult(10, 4, 1, 0.1, 1.0, 0.2, FinishReason.STOP, "p").to_wire(),
         "cached_tokens": 11},
        {**InferResult(10, 4, 1, 0.1, 1.0, 0.2, FinishReason.STOP, "p").to_wire(),
         "finish_reason": "bored"},
        {**InferResult(10, 4, 1, 0.1, 1.0, 0.2, FinishReason.STOP, "p").to_wire(),
         "ttft_s": -1.0},
        {**InferResult(10, 4, 1, 0.1, 1.0, 0.2, FinishReason.STOP, "p").to_wire(),
         "served_by": ""},
        {"t": "result"},
        {"tokens": [1]},
        [1, 2, 3],
        None,
    ],
)
def test_bad_responses(obj: object) -> None:
    with pytest.raises(RemoteProtocolError):
        parse_response(obj, VOCAB)


def test_misuse_by_our_code_is_value_error() -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        make_request(max_new_tokens=0)
    with pytest.raises(ValueError, match="must be a tuple"):
        make_request(prompt_token_ids=[1, 2])
    with pytest.raises(ValueError, match="vocab_size"):
        parse_request(wire(), 0)
    with pytest.raises(ValueError, match="code must be"):
        InferError("overloaded", "x")  # type: ignore[arg-type]


def test_a_forwarded_request_cannot_go_further() -> None:
    """The hop rule: the entry sends hops = MAX_HOPS, one hop more is not a request."""
    sent = infer_request("req-1", [1, 2, 3], SamplingParams(max_new_tokens=2), 12.5)
    assert (sent.hops, sent.deadline_s) == (MAX_HOPS, 12.5)
    with pytest.raises(ValueError, match="hops"):
        replace(sent, hops=sent.hops + 1)


def test_retryable_codes() -> None:
    assert {code for code in ErrorCode if code.retryable} == {
        ErrorCode.OVERLOADED,
        ErrorCode.INTERNAL,
        ErrorCode.OVER_BUDGET,
        ErrorCode.REFUSED,
    }
    assert not InferError(ErrorCode.INVALID_REQUEST, "bad").retryable
    long = InferError.truncated(ErrorCode.INTERNAL, "y" * 5000)
    assert len(long.message) == MAX_ERROR_MESSAGE_LEN


# Properties.

tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=50).map(tuple)
printable_id = st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=40
)
requests = st.builds(
    InferRequest,
    request_id=printable_id,
    prompt_token_ids=tokens,
    max_new_tokens=st.integers(1, MAX_NEW_TOKENS),
    deadline_s=st.floats(1e-6, 3600.0),
    temperature=st.floats(0.0, 2.0),
    top_p=st.floats(1e-6, 1.0),
    seed=st.integers(0, 2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=4).map(tuple),
    hops=st.integers(0, MAX_HOPS),
)
responses = st.one_of(
    st.builds(TokenChunk, st.lists(st.integers(0, VOCAB - 1), max_size=8).map(tuple), st.text()),
    st.builds(InferError, st.sampled_from(ErrorCode), st.text(max_size=50)),
    st.integers(1, 500).flatmap(
        lambda p: st.builds(
            InferResult,
            st.just(p),
            st.integers(0, p),
            st.integers(0, 100),
            st.floats(0.0, 100.0),
            st.floats(0.0, 1e4),
            st.floats(0.0, 100.0),
            st.sampled_from(FinishReason),
            printable_id,
        )
    ),
)


@given(requests)
def test_request_round_trip_property(request: InferRequest) -> None:
    assert parse_request(cbor2.loads(cbor2.dumps(request.to_wire())), VOCAB) == request


@given(responses)
def test_response_round_trip_property(frame: TokenChunk | InferResult | InferError) -> None:
    assert parse_response(cbor2.loads(cbor2.dumps(frame.to_wire())), VOCAB) == frame


wire_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(
    ["t", "id", "prompt", "max_new_tokens", "deadline_s", "temperature", "top_p", "seed",
     "stop", "hops", "tokens", "text", "code", "message", "prompt_tokens", "cached_tokens",
     "completion_tokens", "ttft_s", "decode_tokens_per_s", "total_s", "finish_reason",
     "served_by"]
)
kinds = st.sampled_from(["request", "chunk", "result", "error", "other"])


@st.composite
def mutated_frames(draw: st.DrawFn) -> object:
    """A valid frame with some fields replaced, removed or added: reaches deep checks."""
    base = dict(draw(st.one_of(requests, responses)).to_wire())
    for name in draw(st.lists(field_names, max_size=3)):
        if draw(st.booleans()):
            base.pop(name, None)
        else:
            base[name] = draw(wire_values | kinds)
    return base


@settings(max_examples=300)
@given(st.one_of(wire_values, mutated_frames()))
def test_arbitrary_objects_parse_or_raise_remote_protocol_error(obj: object) -> None:
    for parse in (parse_request, parse_response, parse_frame):
        try:
            frame = parse(obj, VOCAB)
        except RemoteProtocolError:
            continue
        assert frame.to_wire()["t"] in {"request", "chunk", "result", "error"}


@given(st.binary(max_size=200))
def test_arbitrary_cbor_bytes(data: bytes) -> None:
    try:
        obj = decode_cbor(data)
        frame = parse_frame(obj, VOCAB)
    except RemoteProtocolError:
        return
    assert isinstance(frame, InferRequest | TokenChunk | InferResult | InferError)


@settings(max_examples=50)
@given(requests)
def test_truncated_or_corrupted_request_bytes(request: InferRequest) -> None:
    data = bytearray(encode_frame(request.to_wire()))[FRAME_HEADER_BYTES:]
    for corrupt in (data[: len(data) // 2], data[:-1], bytes(b ^ 0x5A for b in data)):
        try:
            frame = parse_frame(decode_cbor(corrupt), VOCAB)
        except RemoteProtocolError:
            continue
        assert isinstance(frame, InferRequest)  # a flip that still decodes is still bounded


def test_largest_frames_fit_the_frame_bound() -> None:
    request = make_request(
        request_id="r" * MAX_REQUEST_ID_LEN,
        prompt_token_ids=(2**32 - 1,) * MAX_PROMPT_TOKENS,
        stop=("\U0010ffff" * MAX_STOP_LEN,) * MAX_STOP_STRINGS,
        seed=2**63 - 1,
    )
    chunk = TokenChunk((2**32 - 1,) * MAX_CHUNK_TOKENS, "\U0010ffff" * MAX_CHUNK_TEXT_LEN)
    for frame in (request, chunk):
        assert len(encode_frame(frame.to_wire())) <= MAX_FRAME_BYTES + FRAME_HEADER_BYTES
