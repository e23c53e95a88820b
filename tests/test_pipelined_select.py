"""Protocol negotiation in one round trip (peer/net/pipelined_select.py): the header and
the first proposal leave before any answer is read; a refused first proposal falls back to
one proposal at a time; a wrong header is an error, as in py-libp2p."""

from __future__ import annotations

from unittest.mock import Mock

import pytest
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.protocol_muxer.multiselect_client import MultiselectClient

from peer.net import libp2p_fixes, pipelined_select

HEADER = "/multistream/1.0.0"


class Scripted:
    """A communicator on a stream that answers from a script and logs writes and reads."""

    def __init__(self, answers: list[str], on_stream: bool = True) -> None:
        self.answers = answers
        self.log: list[str] = []
        self.read_writer = Mock(spec=INetStream) if on_stream else object()

    async def write(self, message: str) -> None:
        self.log.append(f"w {message}")

    async def read(self) -> str:
        self.log.append("r")
        return self.answers.pop(0)


async def test_header_and_first_proposal_go_in_one_flight() -> None:
    comm = Scripted([HEADER, "/a/1"])
    chosen = await pipelined_select.select_one_of(MultiselectClient(), [TProtocol("/a/1")], comm)
    assert chosen == "/a/1"
    assert comm.log == [f"w {HEADER}", "w /a/1", "r", "r"]  # one round trip


async def test_a_refused_first_proposal_falls_back_to_the_next() -> None:
    comm = Scripted([HEADER, "na", "/b/1"])
    protocols = [TProtocol("/a/1"), TProtocol("/b/1")]
    assert await pipelined_select.select_one_of(MultiselectClient(), protocols, comm) == "/b/1"
    assert comm.log == [f"w {HEADER}", "w /a/1", "r", "r", "w /b/1", "r"]
    with pytest.raises(MultiselectClientError, match="not supported"):
        await pipelined_select.select_one_of(MultiselectClient(), protocols,
                                             Scripted([HEADER, "na", "na"]))


async def test_a_wrong_header_or_answer_is_an_error() -> None:
    with pytest.raises(MultiselectClientError, match="mismatch"):
        await pipelined_select.select_one_of(MultiselectClient(), [TProtocol("/a/1")],
                                             Scripted(["/other/1", "/a/1"]))
    with pytest.raises(MultiselectClientError, match="unrecognized"):
        await pipelined_select.select_one_of(MultiselectClient(), [TProtocol("/a/1")],
                                             Scripted([HEADER, "/b/1"]))


async def test_a_connection_upgrade_negotiates_as_py_libp2p_does() -> None:
    comm = Scripted([HEADER, "/noise"], on_stream=False)
    assert await pipelined_select.select_one_of(MultiselectClient(), [TProtocol("/noise")],
                                                comm) == "/noise"
    assert comm.log == [f"w {HEADER}", "r", "w /noise", "r"]  # header echo awaited first


def test_the_fix_installs_the_pipelined_client() -> None:
    assert "select-rtt" in libp2p_fixes.apply()
    assert pipelined_select.installed()
