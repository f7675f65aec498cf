"""The package layering, read from the imports (every import, lazy ones inside functions too).

The rules are per package: a folder of ``flashckpt/`` tells where a module lives and what it may
import. From the bottom:

- the base modules ``flashckpt.errors``, ``envnames``, ``names``, ``cliargs``;
- ``format/`` (bytes in shared memory, on disk and in files);
- ``protocol/`` (trainer <-> node agent messages), ``state/`` (the torch codec), ``planning/``;
- ``monitor/`` (the step ring and everything that reads it);
- ``agent/`` (the node agent daemon) and ``offline/`` (reading and exporting committed steps);
- ``trainer/`` (the ``Checkpointer`` and its restore) and the package face ``flashckpt``;
- ``elastic/`` (etcd, rendezvous, membership, launch);
- the CLI (``flashckpt.cli``, ``flashckpt.__main__``);
- ``testing/``, which only tests and benchmarks use: no product module imports it.

A module may import its own package's modules, and those of packages of its layer or below.
``flashckpt.elastic`` is imported only by itself, the CLI dispatch and ``testing/``. Inside it
(``ELASTIC_LAYERS``), from the bottom: the modules directly under ``elastic/`` (``deadline``,
``procutil``); ``etcd/``; ``membership/`` and ``rendezvous/``, side by side: neither imports the
other; ``launch/``. A module there imports its own sub-package and the layers below only.
Nothing under ``agent/``, ``format/``, ``protocol/``, ``monitor/`` or ``planning/`` imports torch
at module level (``tests/test_agent_notorch.py`` checks the node agent's processes at run time).
A module in a folder this file does not know fails the test: a new package says where it
belongs.

No import cycles: ``tests/test_import_cycles.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Layer of every package (and base module), bottom first; a module may import its own layer and
# those below.
BASE, FORMAT, CODEC, MONITOR, AGENT, TRAINER, ELASTIC, CLI, TESTING = range(9)
PACKAGE_LAYERS: dict[str, int] = {
    "flashckpt.errors": BASE,
    "flashckpt.envnames": BASE,
    "flashckpt.names": BASE,
    "flashckpt.cliargs": BASE,
    "flashckpt.format": FORMAT,
    "flashckpt.protocol": CODEC,
    "flashckpt.state": CODEC,
    "flashckpt.planning": CODEC,
    "flashckpt.monitor": MONITOR,
    "flashckpt.agent": AGENT,
    "flashckpt.offline": AGENT,
    "flashckpt.integrations": TRAINER,
    "flashckpt.trainer": TRAINER,
    "flashckpt": TRAINER,  # the package face re-exports the trainer API (lazily)
    "flashckpt.elastic": ELASTIC,
    "flashckpt.cli": CLI,
    "flashckpt.__main__": CLI,
    "flashckpt.testing": TESTING,
}
TORCH_FREE = (
    "flashckpt.agent",
    "flashckpt.format",
    "flashckpt.protocol",
    "flashckpt.monitor",
    "flashckpt.planning",
)
# who may import flashckpt.elastic from outside it
ELASTIC_IMPORTERS = ("flashckpt.cli", "flashckpt.testing")
# Inside flashckpt.elastic, bottom first; the modules directly under elastic/ (deadline,
# procutil) are its base. A module imports its own sub-package and those of the layers below:
# membership/ and rendezvous/ share a layer and import neither each other (they meet in launch/).
ELASTIC_BASE, ELASTIC_ETCD, ELASTIC_PARTS, ELASTIC_LAUNCH = range(4)
ELASTIC_LAYERS: dict[str, int] = {
    "flashckpt.elastic": ELASTIC_BASE,
    "flashckpt.elastic.etcd": ELASTIC_ETCD,
    "flashckpt.elastic.membership": ELASTIC_PARTS,
    "flashckpt.elastic.rendezvous": ELASTIC_PARTS,
    "flashckpt.elastic.launch": ELASTIC_LAUNCH,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "flashckpt").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _package(module: str) -> str | None:
    """The entry of ``PACKAGE_LAYERS`` a module belongs to (the longest that contains it)."""
    if module == "flashckpt":
        return "flashckpt"
    found = [p for p in PACKAGE_LAYERS if p != "flashckpt" and _under(module, p)]
    return max(found, key=len) if found else None


def _elastic_package(module: str) -> str | None:
    """The entry of ``ELASTIC_LAYERS`` a module of ``flashckpt.elastic`` belongs to: its
    sub-package, or ``flashckpt.elastic`` for a module directly under ``elastic/``; None for a
    module of a sub-package this file does not know."""
    found = [p for p in ELASTIC_LAYERS if p != "flashckpt.elastic" and _under(module, p)]
    if found:
        return max(found, key=len)
    rest = module.removeprefix("flashckpt.elastic").lstrip(".")
    return "flashckpt.elastic" if "." not in rest else None


def _elastic_upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports inside ``flashckpt.elastic`` that do not go down its layers."""
    wrong = []
    for m, deps in sorted(graph.items()):
        mine = _elastic_package(m) if _under(m, "flashckpt.elastic") else None
        if mine is None:
            continue
        for d in sorted(deps):
            theirs = _elastic_package(d) if _under(d, "flashckpt.elastic") else None
            if theirs is None or theirs == mine:
                continue
            if ELASTIC_LAYERS[theirs] >= ELASTIC_LAYERS[mine]:
                wrong.append(
                    f"{m} ({mine}, layer {ELASTIC_LAYERS[mine]}) imports {d} "
                    f"({theirs}, layer {ELASTIC_LAYERS[theirs]})"
                )
    return wrong


def _imports(name: str, text: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (module level or lazily), resolved to modules."""
    tree = ast.parse(text, name)
    package = name if is_package else name.rpartition(".")[0]
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
    return {
        name: _imports(name, path.read_text(), path.name == "__init__.py", known)
        for name, path in mods.items()
    }


def _module_level_imports(text: str) -> set[str]:
    """Top-level names imported when the module is imported (``TYPE_CHECKING`` blocks and
    function bodies excluded)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(ast.parse(text).body)
    return found


def test_every_module_is_in_a_known_package() -> None:
    missing = sorted(m for m in _modules() if _package(m) is None)
    assert not missing, (
        f"modules outside every package tests/test_layering.py knows: {missing}; put them in a "
        "package of PACKAGE_LAYERS (or add the new package there, with its layer)"
    )


def test_imports_go_down_the_layers() -> None:
    wrong = []
    for m, deps in sorted(_graph().items()):
        mine = _package(m)
        assert mine is not None
        for d in sorted(deps):
            theirs = _package(d)
            assert theirs is not None
            if theirs != mine and PACKAGE_LAYERS[theirs] > PACKAGE_LAYERS[mine]:
                wrong.append(
                    f"{m} ({mine}, layer {PACKAGE_LAYERS[mine]}) imports {d} "
                    f"({theirs}, layer {PACKAGE_LAYERS[theirs]})"
                )
    assert not wrong, "imports up the layers:\n" + "\n".join(wrong)


def test_elastic_imports_go_down_its_layers() -> None:
    unknown = sorted(
        m for m in _modules() if _under(m, "flashckpt.elastic") and _elastic_package(m) is None
    )
    assert not unknown, (
        f"modules of flashckpt.elastic in a sub-package tests/test_layering.py does not know: "
        f"{unknown}; add it to ELASTIC_LAYERS, with its layer"
    )
    wrong = _elastic_upward(_graph())
    assert not wrong, "imports up (or across) the layers of flashckpt.elastic:\n" + "\n".join(wrong)


def test_only_the_cli_dispatch_imports_elastic() -> None:
    wrong = [
        f"{m} imports {d}"
        for m, deps in sorted(_graph().items())
        if not _under(m, "flashckpt.elastic") and not m.startswith(ELASTIC_IMPORTERS)
        for d in sorted(deps)
        if _under(d, "flashckpt.elastic")
    ]
    assert not wrong, "flashckpt.elastic imported outside the CLI dispatch:\n" + "\n".join(wrong)


def test_no_product_module_imports_testing() -> None:
    wrong = [
        f"{m} imports {d}"
        for m, deps in sorted(_graph().items())
        if not _under(m, "flashckpt.testing")
        for d in sorted(deps)
        if _under(d, "flashckpt.testing")
    ]
    assert not wrong, "product modules import flashckpt.testing:\n" + "\n".join(wrong)


def test_torch_free_packages_do_not_import_torch() -> None:
    mods = _modules()
    wrong = [
        f"{m} imports {name}"
        for m, path in sorted(mods.items())
        if m.startswith(TORCH_FREE)
        for name in sorted(_module_level_imports(path.read_text()))
        if name == "torch" or name.startswith("torch.")
    ]
    assert not wrong, "torch imported at module level in a torch-free package:\n" + "\n".join(wrong)


def test_the_rules_can_fail() -> None:
    """The helpers above see what the rules look for: a planted upward import and a planted
    module-level torch import in a ``format/`` module are both found."""
    planted = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "if TYPE_CHECKING:\n"
        "    import torch.distributed\n"
        "def f():\n"
        "    from flashckpt.trainer import checkpointer\n"
    )
    assert _module_level_imports(planted) == {"typing", "torch"}
    deps = _imports("flashckpt.format.planted", planted, False, set(_modules()))
    assert deps == {"flashckpt.trainer.checkpointer"}
    assert _package("flashckpt.format.planted") == "flashckpt.format"
    assert PACKAGE_LAYERS["flashckpt.trainer"] > PACKAGE_LAYERS["flashckpt.format"]
    # Inside elastic/: an etcd module importing launch/ (up), a membership module importing
    # rendezvous/ (across, lazily), both found; a rendezvous module importing etcd/ is not.
    known = set(_modules())
    up = _imports(
        "flashckpt.elastic.etcd.planted",
        planted.replace("trainer", "elastic.launch").replace("checkpointer", "config"),
        False,
        known,
    )
    across = _imports(
        "flashckpt.elastic.membership.planted",
        "def f():\n    from flashckpt.elastic.rendezvous.name import BACKEND_NAME\n",
        False,
        known,
    )
    down = _imports(
        "flashckpt.elastic.rendezvous.planted",
        "from flashckpt.elastic.etcd.client import EtcdClient\n",
        False,
        known,
    )
    graph = {
        "flashckpt.elastic.etcd.planted": up,
        "flashckpt.elastic.membership.planted": across,
        "flashckpt.elastic.rendezvous.planted": down,
    }
    assert up == {"flashckpt.elastic.launch.config"}
    assert down == {"flashckpt.elastic.etcd.client"}
    wrong = _elastic_upward(graph)
    assert len(wrong) == 2, wrong
    assert wrong[0].startswith("flashckpt.elastic.etcd.planted ")
    assert wrong[1].startswith("flashckpt.elastic.membership.planted ")
    assert _elastic_package("flashckpt.elastic.newpkg.mod") is None
    assert _elastic_package("flashckpt.elastic.deadline") == "flashckpt.elastic"
