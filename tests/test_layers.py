"""The direction of imports between peer/'s layers, read from the source (ast).

Entry points -> api -> node -> request -> routing -> swarm -> net -> engine, with plain
utilities (config, logs, ...) and protocols/ usable from every layer. A module may import
its own layer and those below it, never one above; every import counts, lazy and
TYPE_CHECKING ones included, so the graph a reader draws from the files has no edge up.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_purity import ROOT, imported_modules, project_modules

# Layers from the top down; a module may import its own layer and those after it. "top"
# and "node" are modules at peer/'s root: the entry points, and the node that builds a
# peer (the faces reach it through api/face.py's FacePeer).
LAYERS = ["top", "api", "node", "request", "routing", "swarm", "net", "engine"]
ROOT_LAYER = {
    "cli": "top", "cli_clients": "top", "local_swarm": "top", "processes": "top",
    "node_runner": "top", "preflight": "top", "node": "node", "views": "node",
}  # fmt: skip
# Plain utilities every layer may use; they import only engine/ and each other.
UTILITIES = {"config", "settings", "logs", "progress", "version", "demo_data"}


def layer_of(module: str) -> str:
    """The layer of a peer module: one of LAYERS, or 'utility'."""
    parts = module.split(".")
    if len(parts) >= 3:
        assert parts[1] in LAYERS, f"{module}: peer/{parts[1]}/ is no layer"
        return parts[1]
    if parts[1] in ROOT_LAYER:
        return ROOT_LAYER[parts[1]]
    if parts[1] in UTILITIES:
        return "utility"
    raise AssertionError(f"{module} is in no layer: add it to tests/test_layers.py")


def allowed(importer: str, imported: str) -> bool:
    a, b = layer_of(importer), layer_of(imported)
    if b == "utility":
        return True
    if a == "utility":
        return b == "engine"
    return LAYERS.index(a) <= LAYERS.index(b)


def peer_modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted((ROOT / "peer").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            continue
        out.append((".".join(parts), path))
    return out


def test_every_module_has_a_layer() -> None:
    modules = [m for m, _ in peer_modules()]
    assert "peer.request.pipeline" in modules and "peer.net.host" in modules
    for module in modules:
        layer_of(module)


def test_the_rule_rejects_an_upward_import() -> None:
    assert not allowed("peer.net.host", "peer.request.pipeline")
    assert not allowed("peer.routing.router", "peer.node")
    assert not allowed("peer.engine.engine", "peer.swarm.gossip")
    assert allowed("peer.request.pipeline", "peer.routing.router")
    assert allowed("peer.api.http", "peer.request.generation")
    assert not allowed("peer.node", "peer.api.face") and allowed("peer.api.face", "peer.node")
    assert allowed("peer.engine.model", "peer.progress") and allowed("peer.cli", "peer.api.http")
    assert not allowed("peer.config", "peer.net.host")


@pytest.mark.parametrize("module,path", peer_modules(), ids=lambda v: str(v))
def test_imports_run_down_the_layers(module: str, path: Path) -> None:
    package = module.rsplit(".", 1)[0]
    imported = project_modules(imported_modules(path, package))
    peer_imports = {
        n for n in imported
        if n.startswith("peer.") and (ROOT / n.replace(".", "/")).with_suffix(".py").is_file()
    }  # fmt: skip
    upward = sorted(n for n in peer_imports if not allowed(module, n))
    assert not upward, f"{module} ({layer_of(module)}) imports upward: {upward}"
