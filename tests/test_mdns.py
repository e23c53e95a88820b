"""mDNS: two peers with no bootstrap address find each other on one LAN.

The peers run in a network namespace built here (a veth pair standing for the LAN),
so the multicast stays inside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAN_IP = "10.98.0.1"


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="building a network namespace needs root")
def test_two_peers_find_each_other_by_mdns():
    ns = f"psr-mdns-{os.getpid()}"
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "link", "add", "lan0", "type", "veth", "peer", "name", "lan1")
        _sh("ip", "-n", ns, "link", "set", "lan1", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{LAN_IP}/24", "dev", "lan0")
        _sh("ip", "-n", ns, "link", "set", "lan0", "up")
        _sh("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", "lan0")
        done = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.helpers_mdns", LAN_IP],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True, text=True, timeout=120, check=False,
        )
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["a_knows"] == [result["b"]]
    assert result["b_knows"] == [result["a"]]
