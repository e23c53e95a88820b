"""The import rules, checked on the source (ast) and in fresh interpreters.

- protocols/ and the pure cores (the modules pyproject.toml type-checks with mypy
  --strict) import no trio, libp2p, torch or other I/O framework, and of this project
  only protocols/ and other pure cores: the simulator runs the live code.
- protocols/ stands alone: it imports nothing from peer/ or bench/.
- peer/ never imports bench/ (an installed peer has no bench/).
- The HTTP face (peer/api/http.py) loads no torch at import time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"trio", "torch", "libp2p", "transformers", "anyio", "socket", "asyncio"}


def pure_core_modules() -> list[str]:
    """Module names from pyproject.toml's first strict mypy override ("protocols.*"
    expanded); a later strict override lists shells typed as strictly, which do I/O."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names: list[str] = next(
        o["module"] for o in config["tool"]["mypy"]["overrides"] if o.get("strict")
    )
    modules: list[str] = []
    for name in names:
        if name.endswith(".*"):
            package = name.removesuffix(".*")
            folder = ROOT / package.replace(".", "/")
            modules += [f"{package}.{p.stem}" for p in sorted(folder.glob("*.py"))]
        else:
            modules.append(name)
    return [m.removesuffix(".__init__") for m in modules]


PURE = pure_core_modules()


def module_path(module: str) -> Path:
    base = ROOT / module.replace(".", "/")
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def names_of(node: ast.Import | ast.ImportFrom, package: str) -> set[str]:
    """The modules (and imported names) of one import statement, relative ones resolved
    against `package`."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1])
        module = f"{base}.{node.module}" if node.module else base
    else:
        module = node.module or ""
    return {module, *(f"{module}.{alias.name}" for alias in node.names)}


def imported_modules(path: Path, package: str = "") -> set[str]:
    """Every module `path` imports, anywhere in the file (functions included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= names_of(node, package)
    return found


def project_modules(names: set[str]) -> set[str]:
    """The names that are modules of this project (files or packages under ROOT)."""
    out = set()
    for name in names:
        if name.split(".")[0] in {"peer", "protocols", "bench"}:
            path = ROOT / name.replace(".", "/")
            if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
                out.add(name)
    return out


def test_the_check_sees_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import trio\nfrom torch.nn import Module\nimport os.path as p\n"
        "def f():\n    from bench import workloads\n"
        "from . import sibling\n"
    )
    assert imported_modules(probe, "peer.engine") == {
        "trio", "torch.nn", "torch.nn.Module", "os.path", "bench", "bench.workloads",
        "peer.engine", "peer.engine.sibling",
    }  # fmt: skip


def test_the_pure_cores_are_listed() -> None:
    assert "protocols.summary" in PURE and "peer.routing.router" in PURE
    assert "peer.swarm.peer_table" in PURE
    assert all(module_path(m).is_file() for m in PURE), PURE


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_nothing_forbidden(module: str) -> None:
    path = module_path(module)
    names = imported_modules(path, module.rsplit(".", 1)[0])
    roots = {name.split(".")[0] for name in names}
    assert not roots & FORBIDDEN, f"{module} imports {sorted(roots & FORBIDDEN)}"
    internal = project_modules(names) - {"peer", "protocols", "peer.engine"}
    if module.startswith("protocols"):
        others = {n for n in internal if not n.startswith("protocols")}
        assert not others, f"{module} depends on {sorted(others)}: protocols/ stands alone"
    impure = {n for n in internal if n not in PURE}
    assert not impure, f"{module} imports {sorted(impure)}, which are not pure cores"


def test_importing_the_pure_cores_loads_no_forbidden_package() -> None:
    # Catches transitive imports (e.g. through a package __init__), in a fresh interpreter.
    code = (
        f"import sys\nimport {', '.join(PURE)}\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(FORBIDDEN)!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


PEER_FILES = sorted((ROOT / "peer").rglob("*.py"))


@pytest.mark.parametrize("path", PEER_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_peer_never_imports_bench(path: Path) -> None:
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    bench = {n for n in imported_modules(path, package) if n.split(".")[0] == "bench"}
    assert not bench, f"{path.relative_to(ROOT)} imports {sorted(bench)}: peer/ ships alone"


def test_the_lint_command_type_checks_every_pure_core() -> None:
    lint = (ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    lines = lint.replace("\\\n", " ").splitlines()
    mypy_line = next(line for line in lines if line.strip().startswith("$(BIN)/mypy"))
    for module in PURE:
        top = module.split(".")[0]
        assert f" {top} " in f"{mypy_line} " or str(
            module_path(module).relative_to(ROOT)
        ) in mypy_line, f"make lint does not type-check {module}"


def import_time_imports(module: str, seen: set[str] | None = None) -> set[str]:
    """Every module that importing `module` loads, followed through this project's
    modules: imports at module level (not in functions, not under TYPE_CHECKING)."""
    seen = set() if seen is None else seen
    if module in seen:
        return set()
    seen.add(module)
    path = module_path(module)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue  # runs when called, not when imported
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(names_of(node, package))
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child])
                    elif isinstance(child, ast.ExceptHandler):
                        visit(child.body)

    visit(tree.body)
    loaded = set(names)
    for name in project_modules(names):
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # a module's packages are imported first
            loaded |= import_time_imports(".".join(parts[:i]), seen)
    return loaded


def test_import_time_imports_follow_the_project_and_skip_functions() -> None:
    loaded = {n.split(".")[0] for n in import_time_imports("peer.node")}
    assert {"trio", "libp2p"} <= loaded  # through peer.net.host, peer.swarm.gossip, ...
    assert "torch" not in loaded  # serving (torch) is imported only under TYPE_CHECKING
    assert "torch" in {n.split(".")[0] for n in import_time_imports("peer.engine.engine")}


def test_the_http_face_loads_no_torch() -> None:
    torch = {n for n in import_time_imports("peer.api.http") if n.split(".")[0] == "torch"}
    assert not torch, f"importing peer.api.http loads {sorted(torch)}"


def test_the_http_face_pipeline_and_simulator_import_no_torch() -> None:
    # They use the engine through peer.engine.api; only loading a model imports torch.
    code = (
        "import sys\nimport peer.api.http, peer.request.pipeline, peer.request.serving, peer.node\n"
        "import bench.sim.model\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


FACE_FILES = [
    "peer/api/http.py", "peer/api/responses.py", "peer/api/auth.py", "peer/api/web/routes.py",
]
# What the HTTP face and the page may import of the project: the generation service and
# its types, the FacePeer protocol, their own parts, and the settings' address rules. Not
# the engine, the table, the pipeline or the node: they reach a peer only through FacePeer.
FACE_MAY_IMPORT = {
    "peer.request.admission", "peer.engine.api", "peer.api.face", "peer.request.generation",
    "peer.api.auth",
    "peer.api.responses", "peer.api.metrics", "peer.api.openai_schema", "peer.request.request_log",
    "peer.version", "peer.api.web.routes", "peer.settings",
}


@pytest.mark.parametrize("name", FACE_FILES)
def test_the_http_face_reaches_the_peer_only_through_its_protocols(name: str) -> None:
    path = ROOT / name
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    used = project_modules(imported_modules(path, package))
    assert used <= FACE_MAY_IMPORT, f"{name} imports {sorted(used - FACE_MAY_IMPORT)}"
