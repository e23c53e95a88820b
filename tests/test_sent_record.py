"""peer.net.sent_record: the signed record on every RPC is rebuilt at most once per
RECHECK_S per host, and every py-libp2p module that sends one uses the memo."""

from __future__ import annotations

import importlib

from peer.net import libp2p_fixes, sent_record


class Host:
    """Stands for a py-libp2p host (the memo only keys on it)."""


def test_a_record_is_built_once_per_recheck_period_per_host() -> None:
    now = [100.0]
    built: list[Host] = []

    def build(host: Host) -> tuple[bytes, bool]:
        built.append(host)
        return f"record {len(built)}".encode(), True

    send = sent_record.remembering(build, clock=lambda: now[0])
    a, b = Host(), Host()
    assert send(a) == (b"record 1", True)
    now[0] += sent_record.RECHECK_S * 0.9
    assert send(a) == (b"record 1", False)  # remembered: no rebuild
    assert send(b) == (b"record 2", True)  # another host has its own
    now[0] += sent_record.RECHECK_S * 0.2
    assert send(a) == (b"record 3", True)  # a's period is over: built again
    assert built == [a, b, a]


def test_every_sending_module_uses_the_memo_once_the_fixes_are_applied() -> None:
    assert sent_record.problem() is None
    libp2p_fixes.apply()
    assert sent_record.installed()
    functions = {importlib.import_module(m).env_to_send_in_RPC for m in sent_record.MODULES}
    assert len(functions) == 1  # one memo, shared: one record per host, not one per module
