"""The inference protocol /prefixswarm/infer/1.0.0: request, token chunk, result, error frames.

One request per stream. The entry peer sends one ``InferRequest``; the serving peer answers
with any number of ``TokenChunk`` frames and then exactly one ``InferResult`` or one
``InferError`` (an error may also end the stream after some chunks). Each frame is a plain
dict (``to_wire()``) carried by protocols/framing.py as CBOR; the key ``"t"`` names its kind.

Parsers take what a remote peer sent and return a frozen dataclass or raise only
``RemoteProtocolError``; constructing a dataclass with bad values from our own code raises
``ValueError``. Unknown keys are ignored, so a minor addition needs no new protocol id.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

from protocols.errors import RemoteProtocolError

# Bounds, each with its reason.
MAX_REQUEST_ID_LEN = 128  # room for a UUID plus a peer-id prefix; it is logged, keep it short
MAX_PROMPT_TOKENS = 32_768  # above the context window of every model we serve (SmolLM2: 8192)
MAX_NEW_TOKENS = 8_192  # a generation longer than a whole context window is a mistake
MAX_STOP_STRINGS = 16  # OpenAI allows 4; room for chat-template end markers on top
MAX_STOP_LEN = 256  # characters; a stop string is a marker, not a document
MAX_TEMPERATURE = 2.0  # OpenAI's upper bound; beyond it sampling is noise
MAX_SEED = 2**63 - 1  # fits torch.Generator.manual_seed and a CBOR unsigned int
MAX_HOPS = 1  # a forwarded request is never forwarded again: no loops, no ping-pong
MAX_DEADLINE_S = 3_600.0  # an hour; the default end-to-end timeout is 300 s (peer/config.py)
MAX_CHUNK_TOKENS = 1_024  # a chunk batches tokens decoded since the last send
MAX_CHUNK_TEXT_LEN = 65_536  # characters; tokens decode to short strings, this is generous
MAX_PEER_ID_LEN = 128  # a base58 libp2p peer id is 46-53 characters
MAX_ERROR_MESSAGE_LEN = 1_024  # characters; a reason for a log line, not a traceback
MAX_SECONDS = 86_400.0  # a day: no timing in a result can honestly be longer
MAX_TOKENS_PER_S = 1e7  # no engine decodes ten million tokens a second
MAX_RESULT_SIGNATURE_LEN = 128  # ed25519 signs in 64 bytes (protocols/answers.py)

KIND_REQUEST = "request"
KIND_CHUNK = "chunk"
KIND_RESULT = "result"
KIND_ERROR = "error"


class ErrorCode(enum.Enum):
    """Why a serving peer refused or failed a request."""

    OVERLOADED = "overloaded"  # its queue is full; another peer may have room
    INVALID_REQUEST = "invalid_request"  # the request is wrong; it is wrong everywhere
    DEADLINE = "deadline"  # the time left ran out; no one else can do better
    INTERNAL = "internal"  # the peer failed; another peer may not
    OVER_BUDGET = "over_budget"  # the requester's share of this peer is spent for now
    REFUSED = "refused"  # this peer serves the requester no more (it quarantined it)

    @property
    def retryable(self) -> bool:
        """Whether the entry peer should try its next candidate after this error."""
        return self in (
            ErrorCode.OVERLOADED, ErrorCode.INTERNAL, ErrorCode.OVER_BUDGET, ErrorCode.REFUSED
        )


class FinishReason(enum.Enum):
    """Why generation stopped: a stop string or end-of-sequence, or max_new_tokens."""

    STOP = "stop"
    LENGTH = "length"


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_float(name: str, value: float, low: float, high: float, *, open_low: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if (value <= low if open_low else value < low) or value > high:
        bracket = "(" if open_low else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")


def _check_str(name: str, value: str, min_len: int, max_len: int) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise ValueError(f"{name} length must be in [{min_len}, {max_len}], got {len(value)}")


def _check_tokens(name: str, tokens: tuple[int, ...], min_len: int, max_len: int) -> None:
    if not isinstance(tokens, tuple):
        raise ValueError(f"{name} must be a tuple, got {type(tokens).__name__}")
    if not min_len <= len(tokens) <= max_len:
        raise ValueError(f"{name} must hold [{min_len}, {max_len}] tokens, got {len(tokens)}")
    for token in tokens:
        if type(token) is not int or token < 0:
            raise ValueError(f"{name} must hold non-negative ints, got {token!r}")


def _check_vocab(name: str, tokens: tuple[int, ...], vocab_size: int) -> None:
    if tokens and max(tokens) >= vocab_size:
        raise ValueError(f"{name} holds token {max(tokens)} >= vocabulary size {vocab_size}")


@dataclass(frozen=True)
class InferRequest:
    """A prompt to complete. ``deadline_s`` is the time left when sent (clocks differ).

    A sampled request (temperature > 0) carries the ``seed`` the entry chose: the serving
    peer draws every token with peer/engine/sampling.py's sampler keyed by it, so the
    entry can check that each sampled token is the one the seed selects."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    deadline_s: float
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    hops: int = 0  # forwards this request has made so far, this one included

    def __post_init__(self) -> None:
        _check_str("request_id", self.request_id, 1, MAX_REQUEST_ID_LEN)
        if not (self.request_id.isascii() and self.request_id.isprintable()):
            raise ValueError("request_id must be printable ASCII")
        _check_tokens("prompt_token_ids", self.prompt_token_ids, 1, MAX_PROMPT_TOKENS)
        _check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        _check_float("deadline_s", self.deadline_s, 0.0, MAX_DEADLINE_S, open_low=True)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE, open_low=False)
        _check_float("top_p", self.top_p, 0.0, 1.0, open_low=True)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        elif self.temperature > 0.0:
            raise ValueError("a sampled request (temperature > 0) needs a seed")
        if not isinstance(self.stop, tuple):
            raise ValueError(f"stop must be a tuple, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings, at most {MAX_STOP_STRINGS}")
        for text in self.stop:
            _check_str("stop string", text, 1, MAX_STOP_LEN)
        _check_int("hops", self.hops, 0, MAX_HOPS)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a prompt token is outside a vocabulary of this size."""
        _check_vocab("prompt_token_ids", self.prompt_token_ids, vocab_size)

    def to_wire(self) -> dict[str, object]:
        return {
            "t": KIND_REQUEST,
            "id": self.request_id,
            "prompt": list(self.prompt_token_ids),
            "max_new_tokens": self.max_new_tokens,
            "deadline_s": float(self.deadline_s),
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "seed": self.seed,
            "stop": list(self.stop),
            "hops": self.hops,
        }


@dataclass(frozen=True)
class TokenChunk:
    """Tokens decoded since the previous chunk and the text they add (may lag the tokens)."""

    token_ids: tuple[int, ...]
    text: str = ""

    def __post_init__(self) -> None:
        _check_tokens("token_ids", self.token_ids, 0, MAX_CHUNK_TOKENS)
        _check_str("text", self.text, 0, MAX_CHUNK_TEXT_LEN)

    def to_wire(self) -> dict[str, object]:
        return {"t": KIND_CHUNK, "tokens": list(self.token_ids), "text": self.text}


@dataclass(frozen=True)
class InferResult:
    """The end of a successful stream: usage, timing and who served it. ``signature`` is
    the server's over its answer (protocols/answers.py `signed_bytes`); empty: unsigned."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    decode_tokens_per_s: float
    total_s: float
    finish_reason: FinishReason
    served_by: str
    signature: bytes = b""

    def __post_init__(self) -> None:
        _check_int("prompt_tokens", self.prompt_tokens, 1, MAX_PROMPT_TOKENS)
        _check_int("cached_tokens", self.cached_tokens, 0, self.prompt_tokens)
        _check_int("completion_tokens", self.completion_tokens, 0, MAX_NEW_TOKENS)
        _check_float("ttft_s", self.ttft_s, 0.0, MAX_SECONDS, open_low=False)
        _check_float("decode_tokens_per_s", self.decode_tokens_per_s, 0.0, MAX_TOKENS_PER_S,
                     open_low=False)
        _check_float("total_s", self.total_s, 0.0, MAX_SECONDS, open_low=False)
        if not isinstance(self.finish_reason, FinishReason):
            raise ValueError(f"finish_reason must be a FinishReason, got {self.finish_reason!r}")
        _check_str("served_by", self.served_by, 1, MAX_PEER_ID_LEN)
        if not isinstance(self.signature, bytes) or len(self.signature) > (
            MAX_RESULT_SIGNATURE_LEN
        ):
            raise ValueError(f"signature must be at most {MAX_RESULT_SIGNATURE_LEN} bytes")

    def to_wire(self) -> dict[str, object]:
        return {
            "t": KIND_RESULT,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": float(self.ttft_s),
            "decode_tokens_per_s": float(self.decode_tokens_per_s),
            "total_s": float(self.total_s),
            "finish_reason": self.finish_reason.value,
            "served_by": self.served_by,
            "sig": self.signature,
        }


@dataclass(frozen=True)
class InferError:
    """The end of a failed stream."""

    code: ErrorCode
    message: str

    def __post_init__(self) -> None:
        if not isinstance(self.code, ErrorCode):
            raise ValueError(f"code must be an ErrorCode, got {self.code!r}")
        _check_str("message", self.message, 0, MAX_ERROR_MESSAGE_LEN)

    @classmethod
    def truncated(cls, code: ErrorCode, message: str) -> InferError:
        """An error whose message is cut to the wire bound (for messages we did not write)."""
        return cls(code, message[:MAX_ERROR_MESSAGE_LEN])

    @property
    def retryable(self) -> bool:
        return self.code.retryable

    def to_wire(self) -> dict[str, object]:
        return {"t": KIND_ERROR, "code": self.code.value, "message": self.message}


Response: TypeAlias = TokenChunk | InferResult | InferError
Frame: TypeAlias = InferRequest | Response


# Parsing: everything below turns remote input into dataclasses or RemoteProtocolError.


def _field(obj: Mapping[object, object], key: str) -> object:
    if key not in obj:
        raise RemoteProtocolError(f"infer frame lacks {key!r}")
    return obj[key]


def _int(obj: Mapping[object, object], key: str) -> int:
    value = _field(obj, key)
    if type(value) is not int:
        raise RemoteProtocolError(f"infer frame field {key!r} must be an int")
    return value


def _float(obj: Mapping[object, object], key: str) -> float:
    value = _field(obj, key)
    if type(value) is float:
        return value
    if type(value) is not int:
        raise RemoteProtocolError(f"infer frame field {key!r} must be a number")
    try:
        return float(value)
    except OverflowError as exc:  # a CBOR bignum
        raise RemoteProtocolError(f"infer frame field {key!r} is out of range") from exc


def _str(obj: Mapping[object, object], key: str) -> str:
    value = _field(obj, key)
    if type(value) is not str:
        raise RemoteProtocolError(f"infer frame field {key!r} must be a str")
    return value


def _tokens(obj: Mapping[object, object], key: str, max_len: int) -> tuple[int, ...]:
    value = _field(obj, key)
    if type(value) is not list and type(value) is not tuple:
        raise RemoteProtocolError(f"infer frame field {key!r} must be a list")
    if len(value) > max_len:  # before the per-item check: bound the work first
        raise RemoteProtocolError(f"infer frame field {key!r} holds {len(value)} > {max_len}")
    for token in value:
        if type(token) is not int:
            raise RemoteProtocolError(f"infer frame field {key!r} must hold ints")
    return tuple(value)


def _bytes(obj: Mapping[object, object], key: str) -> bytes:
    """An optional bytes field (absent: empty)."""
    value = obj.get(key, b"")
    if type(value) is not bytes:
        raise RemoteProtocolError(f"infer frame field {key!r} must be bytes")
    return value


def _strings(obj: Mapping[object, object], key: str, max_len: int) -> tuple[str, ...]:
    value = _field(obj, key)
    if type(value) is not list and type(value) is not tuple:
        raise RemoteProtocolError(f"infer frame field {key!r} must be a list")
    if len(value) > max_len:
        raise RemoteProtocolError(f"infer frame field {key!r} holds {len(value)} > {max_len}")
    for text in value:
        if type(text) is not str:
            raise RemoteProtocolError(f"infer frame field {key!r} must hold strings")
    return tuple(value)


def _kind(obj: object) -> tuple[Mapping[object, object], str]:
    if not isinstance(obj, Mapping):
        raise RemoteProtocolError(f"infer frame must be a map, got {type(obj).__name__}")
    return obj, _str(obj, "t")


def _build_request(obj: Mapping[object, object], vocab_size: int) -> InferRequest:
    seed = _field(obj, "seed")
    if seed is not None and type(seed) is not int:
        raise RemoteProtocolError("infer frame field 'seed' must be an int or null")
    try:
        request = InferRequest(
            request_id=_str(obj, "id"),
            prompt_token_ids=_tokens(obj, "prompt", MAX_PROMPT_TOKENS),
            max_new_tokens=_int(obj, "max_new_tokens"),
            deadline_s=_float(obj, "deadline_s"),
            temperature=_float(obj, "temperature"),
            top_p=_float(obj, "top_p"),
            seed=seed,
            stop=_strings(obj, "stop", MAX_STOP_STRINGS),
            hops=_int(obj, "hops"),
        )
        request.check_vocab(vocab_size)
    except ValueError as exc:
        raise RemoteProtocolError(f"invalid infer request: {exc}") from exc
    return request


def _build_response(kind: str, obj: Mapping[object, object], vocab_size: int) -> Response:
    try:
        if kind == KIND_CHUNK:
            chunk = TokenChunk(_tokens(obj, "tokens", MAX_CHUNK_TOKENS), _str(obj, "text"))
            _check_vocab("token_ids", chunk.token_ids, vocab_size)
            return chunk
        if kind == KIND_RESULT:
            return InferResult(
                prompt_tokens=_int(obj, "prompt_tokens"),
                cached_tokens=_int(obj, "cached_tokens"),
                completion_tokens=_int(obj, "completion_tokens"),
                ttft_s=_float(obj, "ttft_s"),
                decode_tokens_per_s=_float(obj, "decode_tokens_per_s"),
                total_s=_float(obj, "total_s"),
                finish_reason=FinishReason(_str(obj, "finish_reason")),
                served_by=_str(obj, "served_by"),
                signature=_bytes(obj, "sig"),
            )
        if kind == KIND_ERROR:
            return InferError(ErrorCode(_str(obj, "code")), _str(obj, "message"))
    except ValueError as exc:  # also an unknown enum value
        raise RemoteProtocolError(f"invalid infer {kind}: {exc}") from exc
    raise RemoteProtocolError(f"unknown infer frame kind {kind!r}")


def _check_vocab_size(vocab_size: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")


def parse_request(obj: object, vocab_size: int) -> InferRequest:
    """The request a remote peer opened a stream with (the serving side's first frame)."""
    _check_vocab_size(vocab_size)
    mapping, kind = _kind(obj)
    if kind != KIND_REQUEST:
        raise RemoteProtocolError(f"expected an infer request, got kind {kind!r}")
    return _build_request(mapping, vocab_size)


def parse_response(obj: object, vocab_size: int) -> Response:
    """A frame the serving peer sent back: chunk, result or error."""
    _check_vocab_size(vocab_size)
    mapping, kind = _kind(obj)
    if kind == KIND_REQUEST:
        raise RemoteProtocolError("got an infer request where a response was expected")
    return _build_response(kind, mapping, vocab_size)


def parse_frame(obj: object, vocab_size: int) -> Frame:
    """Any infer frame; prefer parse_request / parse_response, which check the direction."""
    _check_vocab_size(vocab_size)
    mapping, kind = _kind(obj)
    if kind == KIND_REQUEST:
        return _build_request(mapping, vocab_size)
    return _build_response(kind, mapping, vocab_size)
