"""``Checkpointer`` has no members only tests use: a private member (``_name``) is read by the
package itself, and tests reach the collaborators (``ck._snap``, the snapshotter; ``ck._link``,
the node agent link) rather than forwarding members kept for them. Public members are API.

By attribute name: a member whose name another class also uses (``_slots``, ``_client``) counts
as used; the check catches the others."""

from __future__ import annotations

import ast
from pathlib import Path

import flashckpt

ROOT = Path(flashckpt.__file__).parent


def _private_members(tree: ast.Module, cls: str) -> set[str]:
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {
        n.name
        for n in node.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and n.name.startswith("_")
        and not n.name.startswith("__")
    }


def test_every_private_member_of_the_checkpointer_is_used_by_the_package() -> None:
    members = _private_members(
        ast.parse((ROOT / "trainer" / "checkpointer.py").read_text()), "Checkpointer"
    )
    assert "_setup" in members  # the walk sees the class (an empty set would pass vacuously)
    used: set[str] = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
    unused = sorted(members - used)
    assert unused == [], (
        f"Checkpointer members no package code uses (test-only?): {unused}; let tests use the "
        "object that owns the state (ck._snap, ck._link) and delete them"
    )
