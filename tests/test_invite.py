"""Invites (protocols/invite.py) and what `serve` does with one (peer/settings.py)."""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.settings import ConfigError, load_settings
from protocols.framing import encode_cbor
from protocols.ids import split_model_id
from protocols.invite import (
    INVITE_PREFIX,
    MAX_INVITE_ADDRS,
    Invite,
    InviteError,
    decode_invite,
    encode_invite,
    is_invite_addr,
)

PEER_ID = "12D3KooWB6PzxQXEXn92xeid7cMs5b95zWLBTKtVWna97ap37gq9"
ADDR = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER_ID}"


def _raw(wire: object) -> str:
    return INVITE_PREFIX + base64.urlsafe_b64encode(encode_cbor(wire)).decode().rstrip("=")


addrs = st.builds(
    lambda a, b, port: f"/ip4/10.{a}.{b}.1/tcp/{port}/p2p/{PEER_ID}",
    st.integers(0, 255), st.integers(0, 255), st.integers(1, 65535),
)


@given(
    model=st.sampled_from(["smollm2-135m", "tiny-random@bfloat16", "org/name+w0123abcd"]),
    bootstrap=st.lists(addrs, min_size=1, max_size=MAX_INVITE_ADDRS, unique=True),
    name=st.sampled_from(["", "lab swarm", "a.b-c_d"]),
)
def test_an_invite_round_trips(model: str, bootstrap: list[str], name: str) -> None:
    invite = Invite(model, tuple(bootstrap), name)
    text = encode_invite(invite)
    assert text.startswith(INVITE_PREFIX) and text.isascii() and " " not in text
    assert decode_invite(text) == invite
    assert decode_invite(f"  {text}\n") == invite  # pasted with whitespace


@given(st.text(max_size=300))
def test_random_text_is_an_invite_or_an_invite_error(text: str) -> None:
    with contextlib.suppress(InviteError):  # anything else fails the test
        decode_invite(text)


@given(st.binary(max_size=300))
def test_random_bytes_after_the_prefix_give_an_invite_error(data: bytes) -> None:
    text = INVITE_PREFIX + base64.urlsafe_b64encode(data).decode().rstrip("=")
    with pytest.raises(InviteError):
        decode_invite(text)


@pytest.mark.parametrize(
    "text,reason",
    [
        ("", "starting with"),
        ("/ip4/1.2.3.4/tcp/1/p2p/x", "starting with"),
        (INVITE_PREFIX + "!!!", "base64url"),
        (INVITE_PREFIX + "A" * 5000, "longer than"),
        (_raw({"v": 1, "model": "m", "bootstrap": [ADDR]}), "damaged"),
        (_raw({"v": 1, "model": "m", "bootstrap": [ADDR], "name": "", "x": 1}), "damaged"),
        (_raw({"v": 2, "model": "m", "bootstrap": [ADDR], "name": ""}), "version 2"),
        (_raw({"v": 1, "model": "m", "bootstrap": ADDR, "name": ""}), "not a list"),
        (_raw({"v": 1, "model": "m", "bootstrap": [], "name": ""}), "1..8"),
        (_raw({"v": 1, "model": "m", "bootstrap": [ADDR] * 9, "name": ""}), "1..8"),
        (_raw({"v": 1, "model": "../x", "bootstrap": [ADDR], "name": ""}), "model id"),
        (_raw({"v": 1, "model": 7, "bootstrap": [ADDR], "name": ""}), "model id"),
        (_raw({"v": 1, "model": "m", "bootstrap": ["/ip4/1.2.3.4/tcp/1"], "name": ""}),
         "not a peer multiaddr"),
        (_raw({"v": 1, "model": "m", "bootstrap": [ADDR], "name": "<script>"}), "swarm name"),
    ],
)
def test_a_bad_invite_says_why(text: str, reason: str) -> None:
    with pytest.raises(InviteError, match=reason):
        decode_invite(text)


def test_invite_addresses() -> None:
    assert is_invite_addr(ADDR)
    assert is_invite_addr(f"/dns4/peer.example/tcp/4001/p2p/{PEER_ID}")
    assert is_invite_addr(f"/ip4/1.2.3.4/tcp/4001/p2p/{PEER_ID}/p2p-circuit/p2p/{PEER_ID}")
    assert not is_invite_addr("/ip4/1.2.3.4/tcp/4001")  # no peer id: cannot be checked
    assert not is_invite_addr(f"/ip4/1.2.3.4/udp/4001/p2p/{PEER_ID}")
    assert not is_invite_addr(f"/ip4/1.2.3.4/tcp/4001/p2p/{PEER_ID} rm -rf")
    assert not is_invite_addr(None)


# -- what `serve` takes from an invite ----------------------------------------------------


def test_join_takes_the_bootstrap_model_dtype_and_name_of_the_invite() -> None:
    invite = encode_invite(Invite("tiny-random@bfloat16", (ADDR,), "lab"))
    config, options = load_settings({"join": invite}, None)
    assert config.bootstrap == (ADDR,)
    assert (config.model, config.dtype, config.swarm_name) == ("tiny-random", "bfloat16", "lab")
    assert options.invite == decode_invite(invite)


def test_an_explicit_model_or_bootstrap_is_kept_beside_the_invite() -> None:
    other = f"/ip4/127.0.0.2/tcp/4001/p2p/{PEER_ID}"
    invite = encode_invite(Invite("smollm2-135m", (ADDR,)))
    config, _ = load_settings({"join": invite, "model": "tiny-random", "bootstrap": (other,)},
                              None)
    assert config.model == "tiny-random"  # checked against the invite once it has loaded
    assert config.bootstrap == (other, ADDR)


def test_a_bad_join_is_one_config_error_line() -> None:
    with pytest.raises(ConfigError, match="--join: invite: expected a string starting with"):
        load_settings({"join": "not an invite"}, None)


def test_public_says_that_no_public_peers_are_listed_yet() -> None:
    with pytest.raises(ConfigError, match="lists no public peers yet"):
        load_settings({"public": True}, None)


def test_the_invite_mismatch_check() -> None:
    from peer.cli import InviteMismatch, check_invite_model

    invite = Invite("tiny-random", (ADDR,))
    check_invite_model(invite, "tiny-random")
    check_invite_model(None, "anything")
    with pytest.raises(InviteMismatch, match="serves tiny-random, but this peer loaded x"):
        check_invite_model(invite, "x")


# -- real processes: status prints an invite, --join with it joins that swarm ------------

REPO = Path(__file__).resolve().parent.parent


def _serve(*args: str) -> subprocess.Popen[str]:
    """A peer process that stops when the test closes its stdin (or kills it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "peer.cli", "serve", "--config", "none", "--identity", "none",
         "--listen", "/ip4/127.0.0.1/tcp/0", "--report", "json", "--summary-interval", "0.5",
         *args],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )


def _event(process: subprocess.Popen[str], name: str, until: Any = None) -> dict[str, Any]:
    """The next JSON line on stdout whose event is `name` (and satisfies `until`)."""
    assert process.stdout is not None
    for line in process.stdout:
        event: dict[str, Any] = json.loads(line)
        if event["event"] == name and (until is None or until(event)):
            return event
    process.kill()
    raise AssertionError(f"no {name!r} event; stderr:\n{process.communicate()[1][-3000:]}")


def _stop(*processes: subprocess.Popen[str]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.mark.slow
def test_status_prints_an_invite_and_join_uses_it() -> None:
    first = _serve("--model", "tiny-random", "--http", "127.0.0.1:0", "--exit-with-stdin")
    joiner = mismatched = None
    try:
        up = _event(first, "up")
        status = subprocess.run(
            [sys.executable, "-m", "peer.cli", "status", "--url", up["http"]],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
        )
        line = next(x for x in status.stdout.splitlines() if "--join" in x)
        invite = line.split("--join ", 1)[1].strip()
        assert split_model_id(decode_invite(invite).model_id)[0] == "tiny-random"
        assert decode_invite(invite).bootstrap[0] in up["multiaddrs"]

        joiner = _serve("--join", invite, "--http", "", "--exit-with-stdin")  # its model
        joined = _event(joiner, "up")
        assert joined["model"] == decode_invite(invite).model_id
        _event(joiner, "peers", until=lambda e: up["peer_id"] in e["peer_ids"])

        mismatched = _serve("--join", invite, "--dtype", "bfloat16", "--http", "")
        _, err = mismatched.communicate(timeout=120)  # it stops by itself
        assert mismatched.returncode == 1
        assert f"the invite's swarm serves {joined['model']}, but this peer loaded " \
               "tiny-random@bfloat16+w" in err
    finally:
        _stop(*(p for p in (first, joiner, mismatched) if p is not None))
