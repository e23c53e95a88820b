"""The table scenarios of bench.adversary: registered, and their rogue's floods are what
honest validation accepts (so the defences, not validation, are what stop them)."""

from __future__ import annotations

from bench.adversary import SCENARIOS, parse_args
from bench.adversary_tables import CLIENT_ROGUES
from bench.rogue import Mode
from bench.rogues.table_filler import GHOSTS, ghost_summary
from peer.swarm.peer_table import MAX_PEERS, PeerTable, Verdict

MODEL = "m"


def test_the_scenarios_are_registered() -> None:
    args = parse_args(["--json", "x.json", "--scenarios", "private_evictor,table_filler"])
    assert args.scenarios == ["private_evictor", "table_filler"]
    assert {"private_evictor", "table_filler"} <= set(SCENARIOS)
    assert {"private_evictor"} == CLIENT_ROGUES  # a client: no rogue process
    assert Mode("table_filler") is Mode.TABLE_FILLER


def test_ghost_summaries_pass_validation_but_fill_only_the_unproven_share() -> None:
    table = PeerTable("12D3KooWHonest", MODEL, 16, expiry_s=3.0)
    verdicts = [
        table.apply(ghost_summary(f"Ghost{i}", MODEL, 16, seq=1), f"Ghost{i}", 0.0).reason
        for i in range(GHOSTS)
    ]
    assert GHOSTS == MAX_PEERS
    assert Verdict.NEW_PEER in verdicts  # valid: a table with room takes them
    assert verdicts.count(Verdict.UNPROVEN_FULL) == GHOSTS - MAX_PEERS // 4
    late = table.apply(ghost_summary("Late", MODEL, 16, seq=1), "Late", 0.5, reachable=True)
    assert late.accepted
