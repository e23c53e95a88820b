"""Invites: one copyable string that hands a swarm to someone.

An invite names the model the swarm serves (its model id, which includes the weights hash
where the peer computed one), a few bootstrap multiaddrs of peers in it, and optionally
the swarm's name. Wire form: ``prefixswarm:`` followed by the unpadded base64url of one
CBOR map ``{"v": 1, "model": str, "bootstrap": [str, ...], "name": str}``; no other key.

An invite comes from a stranger (pasted from a chat, a web page), so `decode_invite`
checks every bound and raises only `InviteError` (a ValueError) with a line a user can
act on.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from protocols.errors import RemoteProtocolError
from protocols.framing import decode_cbor, encode_cbor
from protocols.ids import validate_model_id

__all__ = ["INVITE_PREFIX", "MAX_INVITE_ADDRS", "Invite", "InviteError", "decode_invite",
           "encode_invite", "is_invite_addr"]  # fmt: skip

INVITE_PREFIX = "prefixswarm:"
INVITE_VERSION = 1
MAX_INVITE_ADDRS = 8  # a few long-lived peers are enough to join; more is only length
MAX_ADDR_CHARS = 256  # an /ip6/.../tcp/.../p2p/<id> multiaddr is ~120 characters
MAX_NAME_CHARS = 64
MAX_INVITE_CHARS = 4096  # 8 addresses and a model id fit in ~2 KB of base64
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]*")
# A dialable peer address: /ip4|ip6|dns*/host/tcp/port/.../p2p/<id> (relayed ones too).
_ADDR_RE = re.compile(r"/(ip4|ip6|dns|dns4|dns6)/[^/\s]+/tcp/\d{1,5}(/[^\s]*)?/p2p/[A-Za-z0-9]+")
_KEYS = frozenset({"v", "model", "bootstrap", "name"})


def is_invite_addr(addr: object) -> bool:
    """Whether an invite may carry `addr`: a bounded /ip4|ip6|dns.../tcp/PORT/.../p2p/ID."""
    return type(addr) is str and len(addr) <= MAX_ADDR_CHARS and bool(_ADDR_RE.fullmatch(addr))


class InviteError(ValueError):
    """An invite string that cannot be used, with the reason."""


@dataclass(frozen=True)
class Invite:
    """A swarm to join. Construction validates every field (InviteError)."""

    model_id: str
    bootstrap: tuple[str, ...]
    name: str = ""

    def __post_init__(self) -> None:
        try:
            validate_model_id(self.model_id)
        except (TypeError, ValueError) as exc:
            raise InviteError(f"invite: {exc}") from None
        if type(self.bootstrap) is not tuple or not 1 <= len(self.bootstrap) <= MAX_INVITE_ADDRS:
            raise InviteError(f"invite: needs 1..{MAX_INVITE_ADDRS} bootstrap addresses")
        for addr in self.bootstrap:
            if not is_invite_addr(addr):
                raise InviteError(
                    f"invite: {str(addr)[:80]!r} is not a peer multiaddr "
                    "(/ip4/HOST/tcp/PORT/p2p/ID)"
                )
        if type(self.name) is not str or len(self.name) > MAX_NAME_CHARS or (
            self.name and not _NAME_RE.fullmatch(self.name)
        ):
            raise InviteError(
                f"invite: a swarm name has at most {MAX_NAME_CHARS} letters, digits, "
                "spaces and ._-"
            )


def encode_invite(invite: Invite) -> str:
    """The invite as one string to copy."""
    wire = {
        "v": INVITE_VERSION, "model": invite.model_id,
        "bootstrap": list(invite.bootstrap), "name": invite.name,
    }  # fmt: skip
    body = base64.urlsafe_b64encode(encode_cbor(wire)).rstrip(b"=").decode("ascii")
    return INVITE_PREFIX + body


def decode_invite(text: str) -> Invite:
    """An Invite from its string; InviteError (with the reason) for anything else."""
    text = text.strip()
    if len(text) > MAX_INVITE_CHARS:
        raise InviteError(f"invite: longer than {MAX_INVITE_CHARS} characters")
    if not text.startswith(INVITE_PREFIX):
        raise InviteError(f"invite: expected a string starting with {INVITE_PREFIX!r}")
    body = text.removeprefix(INVITE_PREFIX)
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise InviteError("invite: not valid base64url (was it copied whole?)") from None
    try:
        wire = decode_cbor(raw)
    except RemoteProtocolError:
        raise InviteError("invite: damaged (was it copied whole?)") from None
    if not isinstance(wire, dict) or wire.keys() != _KEYS:
        raise InviteError("invite: damaged or from an incompatible version")
    if wire["v"] != INVITE_VERSION:
        raise InviteError(f"invite: version {wire['v']!r}; this peer reads {INVITE_VERSION}")
    bootstrap = wire["bootstrap"]
    if not isinstance(bootstrap, list):
        raise InviteError("invite: damaged (bootstrap is not a list)")
    return Invite(model_id=wire["model"], bootstrap=tuple(bootstrap), name=wire["name"])
