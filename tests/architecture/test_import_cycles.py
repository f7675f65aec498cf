"""No import cycles between the modules of ``flashckpt`` (subpackages included), counting the
imports
inside functions too: a lazy import is not a way around a cycle (issue 13)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("flashckpt",)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere in its body (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from flashckpt.elastic.membership import health`` imports that module.
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (package ``__init__`` modules excluded: a
    submodule's import runs its package's, which is not an edge of the design)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files) - set(PACKAGES)
    return {
        name: _imports(path, modules) - {name}
        for name, path in files.items()
        if name not in PACKAGES
    }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_lazy_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_inside_functions() -> None:
    graph = import_graph()
    # flashckpt.elastic.rendezvous.registry imports flashckpt.elastic.rendezvous.backend only when
    # torch calls it.
    assert "flashckpt.elastic.rendezvous.backend" in graph["flashckpt.elastic.rendezvous.registry"]
    assert "flashckpt.elastic.launch.session" in graph["flashckpt.elastic.launch.launcher"]


# Cycles known and still to be removed. Each entry must still exist: remove it when the cycle
# goes, so the list only shrinks.
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycles() -> None:
    assert find_cycles(import_graph()) == KNOWN_CYCLES


def test_product_modules_never_import_the_test_helpers() -> None:
    # flashckpt run --standalone starts its etcd with flashckpt.elastic.etcd.server, not a test
    # helper.
    users = sorted(
        name for name, deps in import_graph().items() if "flashckpt.testing.elastic" in deps
    )
    assert users == []


def test_the_standalone_etcd_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import flashckpt.elastic.etcd.server, flashckpt.elastic.etcd.standalone\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
