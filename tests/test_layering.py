"""The package layering, read from the imports (every import, lazy ones inside functions too).

From the bottom: errors and environment names -> byte formats -> storage and the agent protocol
-> the torch state codec, planning and the trainer's step ring -> the node agent, monitoring and
offline reading/export -> the trainer side -> ``elastic/`` (membership, launcher) -> the CLI.

- no import cycle (``tests/test_import_cycles.py``);
- a module imports only modules of its own layer or below;
- ``flashckpt`` imports ``elastic`` only in the CLI dispatch (``flashckpt/cli.py``);
- ``elastic`` imports the core, never the other way.

A module missing from ``LAYERS`` fails the test: a new module says where it belongs.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flashckpt", "elastic")

# Layer of every module, bottom first (a module may import its own layer and those below).
BOTTOM, FORMATS, IO, CODEC, AGENT, TRAINER, ELASTIC, CLI = range(8)
LAYERS: dict[str, int] = {}


def _assign(layer: int, *modules: str) -> None:
    for m in modules:
        LAYERS[m] = layer


_assign(BOTTOM, "flashckpt.errors", "flashckpt.envnames", "flashckpt.names", "flashckpt.cliargs")
_assign(
    FORMATS,
    "flashckpt.layout",
    "flashckpt.shm",
    "flashckpt.manifest",
    "flashckpt.snapmeta",
    "flashckpt.messages",
)
_assign(IO, "flashckpt.storage", "flashckpt.protocol", "flashckpt.replica")
_assign(
    CODEC,
    "flashckpt.codec",
    "flashckpt.rng",
    "flashckpt.sharded",
    "flashckpt.ddp",
    "flashckpt.jsonstate",
    "flashckpt.peers",
    "flashckpt.ring",
    "flashckpt.planner",
    "flashckpt.planconfig",
    "flashckpt.planmath",
    "flashckpt.planreport",
    "flashckpt.plancli",
    "flashckpt.goodput",
)
_assign(
    AGENT,
    "flashckpt.agent",
    "flashckpt.agent_config",
    "flashckpt.agent_state",
    "flashckpt.agent_segments",
    "flashckpt.agent_persist",
    "flashckpt.agent_commit",
    "flashckpt.agent_mirror",
    "flashckpt.agent_server",
    "flashckpt.agent_replica",
    "flashckpt.agent_pull",
    "flashckpt.monitor",
    "flashckpt.alerts",
    "flashckpt.metrics",
    "flashckpt.rankview",
    "flashckpt.statusview",
    "flashckpt.reading",
    "flashckpt.export",
)
# The package face re-exports the trainer API (lazily, see flashckpt/__init__.py).
_assign(
    TRAINER,
    "flashckpt",
    "flashckpt.checkpointer",
    "flashckpt.interval",
    "flashckpt.config",
    "flashckpt.rankctx",
    "flashckpt.link",
    "flashckpt.snapshot",
    "flashckpt.saved",
    "flashckpt.sources",
    "flashckpt.restore",
    "flashckpt.reshard",
    "flashckpt.apply",
    "flashckpt.storageroot",
    # one module per framework, imported only when used (each imports its framework)
    "flashckpt.integrations",
    "flashckpt.integrations.huggingface",
    "flashckpt.integrations.lightning",
)
_assign(ELASTIC, *(f"elastic.{p.stem}" for p in (ROOT / "elastic").glob("*.py")))
LAYERS["elastic"] = LAYERS.pop("elastic.__init__")
_assign(CLI, "flashckpt.cli", "flashckpt.__main__")

# Imports up the layers that are known and still to be removed (issue 13's later steps). Each
# entry must still exist: remove it here when the import goes, so the list only shrinks.
KNOWN_UPWARD: set[tuple[str, str]] = set()

# flashckpt modules allowed to import elastic: the CLI's dispatch only.
CORE_TO_ELASTIC = {"flashckpt.cli"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (module level or lazily), resolved to modules."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        # ``from pkg import mod`` names a module; ``from mod import func`` names its module.
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in known else base)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def test_every_module_has_a_layer() -> None:
    missing = sorted(set(_modules()) - set(LAYERS))
    assert not missing, f"modules without a layer in tests/test_layering.py: {missing}"
    stale = sorted(set(LAYERS) - set(_modules()))
    assert not stale, f"LAYERS names modules that no longer exist: {stale}"


def test_imports_go_down_the_layers() -> None:
    graph = _graph()
    upward = {
        (m, d)
        for m, deps in graph.items()
        for d in deps
        if m in LAYERS and d in LAYERS and LAYERS[d] > LAYERS[m]
    }
    wrong = [
        f"{m} (layer {LAYERS[m]}) imports {d} (layer {LAYERS[d]})"
        for m, d in sorted(upward - KNOWN_UPWARD)
    ]
    assert not wrong, "imports up the layers:\n" + "\n".join(wrong)
    gone = sorted(KNOWN_UPWARD - upward)
    assert not gone, f"fixed, remove from KNOWN_UPWARD: {gone}"


def test_core_imports_elastic_only_in_the_cli_dispatch() -> None:
    graph = _graph()
    wrong = [
        f"{m} imports {d}"
        for m, deps in sorted(graph.items())
        if m.startswith("flashckpt") and m not in CORE_TO_ELASTIC
        for d in sorted(deps)
        if d.startswith("elastic")
    ]
    assert not wrong, "flashckpt imports elastic outside the CLI dispatch:\n" + "\n".join(wrong)
