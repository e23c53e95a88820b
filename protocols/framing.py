"""Length-prefixed CBOR frames, an incremental frame decoder, and strict CBOR decoding.

A frame is a 4-byte big-endian length followed by that many bytes of one CBOR item.
`decode_cbor` accepts only the subset our messages use, checked by a pre-scan before
cbor2 builds objects: definite lengths, no tags (cbor2 would otherwise build datetimes,
Decimals with huge exponents or cyclic shared references from a few bytes), simple values
false/true/null only, str or int map keys, at most MAX_CBOR_DEPTH nesting, every claimed
length within the remaining input (so a tiny input cannot make anyone allocate much), and
exactly one item with no trailing bytes.
"""

from __future__ import annotations

import cbor2

from protocols.errors import RemoteProtocolError

__all__ = [
    "FRAME_HEADER_BYTES",
    "MAX_CBOR_DEPTH",
    "MAX_FRAME_BYTES",
    "FrameDecoder",
    "decode_cbor",
    "encode_cbor",
    "encode_frame",
    "message_map",
]

FRAME_HEADER_BYTES = 4
# 1 MiB: the largest frame is a request carrying a 128k-token prompt (~640 KB of CBOR).
MAX_FRAME_BYTES = 1 << 20
_MAX_HEADER_LENGTH = (1 << (8 * FRAME_HEADER_BYTES)) - 1
MAX_CBOR_DEPTH = 16  # our messages nest at most 3 deep; bounds the decoder's stack

_MAJOR_UINT, _MAJOR_NINT, _MAJOR_BYTES, _MAJOR_TEXT = 0, 1, 2, 3
_MAJOR_ARRAY, _MAJOR_MAP, _MAJOR_TAG, _MAJOR_SIMPLE = 4, 5, 6, 7
_SIMPLE_OK = frozenset({20, 21, 22})  # false, true, null
_FLOAT_BYTES = {25: 2, 26: 4, 27: 8}  # half, single, double
_ARG_BYTES = {24: 1, 25: 2, 26: 4, 27: 8}


class _Open:
    """A container being scanned: items still expected and, for a map, the keys seen."""

    __slots__ = ("keys", "left")

    def __init__(self, left: int, is_map: bool) -> None:
        self.left = left
        self.keys: set[bytes] | None = set() if is_map else None


def _scan(data: bytes) -> None:
    """Check that `data` is exactly one CBOR item of the accepted subset."""
    end = len(data)
    pos = 0
    # A map of n pairs expects 2n items; an item read while the count is even is a key.
    stack = [_Open(1, is_map=False)]
    while stack:
        top = stack[-1]
        if top.keys is None:  # fast path for runs of unsigned ints (token ids) in an array
            while top.left and pos < end and data[pos] < 0x1C:
                initial = data[pos]
                pos += 1 if initial < 0x18 else 1 + (1 << (initial - 0x18))
                top.left -= 1
            if pos > end:
                raise RemoteProtocolError("CBOR header truncated")
        if top.left == 0:
            stack.pop()
            continue
        key_set = top.keys if top.left % 2 == 0 else None  # set when this item is a map key
        top.left -= 1
        if pos >= end:
            raise RemoteProtocolError("CBOR item truncated")
        start = pos
        initial = data[pos]
        pos += 1
        major, info = initial >> 5, initial & 0x1F
        if key_set is not None and major not in (_MAJOR_UINT, _MAJOR_NINT, _MAJOR_TEXT):
            raise RemoteProtocolError("CBOR map keys must be strings or integers")
        if major == _MAJOR_SIMPLE:
            if info in _FLOAT_BYTES:
                pos += _FLOAT_BYTES[info]
                if pos > end:
                    raise RemoteProtocolError("CBOR float truncated")
            elif info not in _SIMPLE_OK:
                raise RemoteProtocolError(f"CBOR simple value {info} not accepted")
            continue
        if info < 24:
            arg = info
        elif info in _ARG_BYTES:
            size = _ARG_BYTES[info]
            if pos + size > end:
                raise RemoteProtocolError("CBOR header truncated")
            arg = int.from_bytes(data[pos : pos + size], "big")
            pos += size
        else:
            raise RemoteProtocolError("CBOR indefinite lengths and reserved values not accepted")
        remaining = end - pos
        if major in (_MAJOR_BYTES, _MAJOR_TEXT):
            if arg > remaining:
                raise RemoteProtocolError(f"CBOR string claims {arg} bytes, {remaining} left")
            pos += arg
        elif major in (_MAJOR_ARRAY, _MAJOR_MAP):
            items = arg * 2 if major == _MAJOR_MAP else arg
            if items > remaining:  # every item takes at least one byte
                raise RemoteProtocolError(
                    f"CBOR container claims {items} items, {remaining} bytes left"
                )
            if items:
                if len(stack) > MAX_CBOR_DEPTH:
                    raise RemoteProtocolError(f"CBOR nesting deeper than {MAX_CBOR_DEPTH}")
                stack.append(_Open(items, is_map=major == _MAJOR_MAP))
        elif major == _MAJOR_TAG:
            raise RemoteProtocolError("CBOR tags not accepted")
        if key_set is not None:
            key = data[start:pos]
            if key in key_set:
                raise RemoteProtocolError("CBOR map has a duplicate key")
            key_set.add(key)
    if pos != end:
        raise RemoteProtocolError(f"{end - pos} trailing bytes after the CBOR item")


def decode_cbor(data: bytes | bytearray | memoryview) -> object:
    """One CBOR item from bytes that came from outside; RemoteProtocolError if not valid."""
    raw = bytes(data)
    _scan(raw)
    try:
        return cbor2.loads(raw)
    except cbor2.CBORDecodeError as exc:  # e.g. invalid UTF-8 in a text string
        raise RemoteProtocolError(f"invalid CBOR: {exc}") from exc


def encode_cbor(obj: object) -> bytes:
    """CBOR bytes of `obj` (TypeError/ValueError for values CBOR cannot carry)."""
    try:
        return cbor2.dumps(obj)
    except cbor2.CBOREncodeError as exc:
        raise ValueError(f"cannot encode as CBOR: {exc}") from exc


def _check_max_size(max_size: int) -> None:
    if not 1 <= max_size <= _MAX_HEADER_LENGTH:
        raise ValueError(f"max_size must be in [1, {_MAX_HEADER_LENGTH}], got {max_size}")


def encode_frame(obj: object, max_size: int = MAX_FRAME_BYTES) -> bytes:
    """A frame holding `obj`; ValueError if its CBOR exceeds `max_size` bytes or obj is None."""
    _check_max_size(max_size)
    if obj is None:
        raise ValueError("a frame cannot hold None (FrameDecoder returns None for 'no frame')")
    body = encode_cbor(obj)
    if len(body) > max_size:
        raise ValueError(f"frame of {len(body)} bytes exceeds the limit of {max_size}")
    return len(body).to_bytes(FRAME_HEADER_BYTES, "big") + body


class FrameDecoder:
    """Splits a byte stream fed in arbitrary chunks into decoded frames.

    `feed` buffers bytes; `next_frame` returns the next complete frame's object, or None
    until one is complete (so a frame holding a bare CBOR null is rejected). The caller
    drains frames after each `feed`; the buffer holds what it was fed. Errors raise
    RemoteProtocolError, and the decoder then stays failed (every later call raises the
    same error): the stream must be dropped.
    """

    def __init__(self, max_size: int = MAX_FRAME_BYTES) -> None:
        _check_max_size(max_size)
        self._max_size = max_size
        self._buffer = bytearray()
        self._error: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes."""
        if self._error is not None:
            raise self._error
        self._buffer += data
        self._check_header()

    def next_frame(self) -> object | None:
        """The next complete frame's object, or None if more bytes are needed."""
        if self._error is not None:
            raise self._error
        if not self._check_header():
            return None
        length = int.from_bytes(self._buffer[:FRAME_HEADER_BYTES], "big")
        end = FRAME_HEADER_BYTES + length
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[FRAME_HEADER_BYTES:end])
        del self._buffer[:end]
        try:
            obj = decode_cbor(body)
        except RemoteProtocolError as exc:
            self._error = exc
            raise
        if obj is None:  # None means "no frame yet"; no message of ours is a bare null
            self._error = RemoteProtocolError("a frame must not hold a bare CBOR null")
            raise self._error
        return obj

    def end_of_stream(self) -> None:
        """Call when the peer closed its side: RemoteProtocolError if a frame was cut off."""
        if self._error is not None:
            raise self._error
        if self._buffer:
            self._error = RemoteProtocolError(
                f"stream ended inside a frame ({len(self._buffer)} bytes pending)"
            )
            raise self._error

    def _check_header(self) -> bool:
        """Whether a header is buffered; fail at once if it announces an oversize frame."""
        if len(self._buffer) < FRAME_HEADER_BYTES:
            return False
        length = int.from_bytes(self._buffer[:FRAME_HEADER_BYTES], "big")
        if length > self._max_size:
            self._error = RemoteProtocolError(
                f"frame of {length} bytes exceeds the limit of {self._max_size}"
            )
            raise self._error
        return True


def message_map(obj: object, kind: str, version: int, family: str) -> dict[object, object]:
    """A decoded frame as one `family` message of `kind` at `version` (its "t" and "v"
    keys): the map, or RemoteProtocolError."""
    if not isinstance(obj, dict):
        raise RemoteProtocolError(
            f"a {family} message must be a CBOR map, got {type(obj).__name__}"
        )
    got = obj.get("t")
    if got != kind:
        raise RemoteProtocolError(f"expected a {kind} message, got kind {got!r}")
    got_version = obj.get("v")
    if type(got_version) is not int or got_version != version:
        raise RemoteProtocolError(f"unsupported {family} message version {got_version!r}")
    return obj
