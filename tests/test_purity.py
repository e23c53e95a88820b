"""The pure cores import no I/O or ML framework, so the simulator runs the live code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"trio", "torch", "libp2p", "transformers", "anyio", "socket", "asyncio"}
PURE = [
    *sorted((ROOT / "protocols").glob("*.py")),
    ROOT / "peer" / "peer_table.py",
    *(ROOT / "peer" / "engine" / f"{m}.py" for m in ("api", "scheduler", "radix", "speeds")),
]
ENGINE_CORES = [f"peer.engine.{m}" for m in ("api", "scheduler", "radix", "speeds")]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_the_check_sees_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import trio\nfrom torch.nn import Module\nimport os.path as p\n")
    assert imported_modules(probe) == {"trio", "torch.nn", "os.path"}


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_module_imports_nothing_forbidden(path: Path) -> None:
    roots = {name.split(".")[0] for name in imported_modules(path)}
    assert not roots & FORBIDDEN, f"{path.name} imports {sorted(roots & FORBIDDEN)}"
    internal = {r for r in roots if r in {"peer", "bench"}}
    if path.parent.name == "protocols":
        assert not internal, f"{path.name} depends on {internal}: protocols/ stands alone"


def test_importing_the_pure_cores_loads_no_forbidden_package() -> None:
    # Catches transitive imports (e.g. through a package __init__), in a fresh interpreter.
    modules = [f"protocols.{p.stem}" for p in PURE if p.parent.name == "protocols"]
    modules = [m.removesuffix(".__init__") for m in modules]
    code = (
        f"import sys\nimport {', '.join([*modules, 'peer.peer_table', *ENGINE_CORES])}\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(FORBIDDEN)!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_http_face_pipeline_and_simulator_import_no_torch() -> None:
    # They use the engine through peer.engine.api; only loading a model imports torch.
    code = (
        "import sys\nimport peer.http, peer.pipeline, peer.serving, peer.node, bench.sim.model\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
