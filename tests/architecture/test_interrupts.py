"""A Ctrl-C (SIGINT) to pytest stops the run: no test code catches ``KeyboardInterrupt``.

A test that stops a training loop with its own interruption raises and catches
``interrupts.SimulatedInterrupt`` (tests/support); ``except KeyboardInterrupt`` or
``pytest.raises(KeyboardInterrupt)`` would also take a real Ctrl-C for the test's own, and the
run would go on.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _names(node: ast.expr | None) -> list[str]:
    if node is None:
        return []
    if isinstance(node, ast.Tuple):
        return [n for elt in node.elts for n in _names(elt)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def swallowed_interrupts(source: str) -> list[int]:
    """The lines of ``source`` that catch a real ``KeyboardInterrupt``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler):
            caught = _names(node.type)
        elif isinstance(node, ast.Call) and _names(node.func) == ["raises"] and node.args:
            caught = _names(node.args[0])  # pytest.raises(...)
        else:
            continue
        if "KeyboardInterrupt" in caught:
            lines.append(node.lineno)
    return sorted(lines)


def test_no_test_code_catches_a_real_ctrl_c() -> None:
    found = [
        f"{path.relative_to(TESTS)}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        for line in swallowed_interrupts(path.read_text())
    ]
    assert not found, (
        f"{found} catch KeyboardInterrupt, so a Ctrl-C to pytest would not stop the run: raise "
        "and catch interrupts.SimulatedInterrupt (tests/support/interrupts.py) instead"
    )


def test_the_check_finds_each_form() -> None:
    source = """
try:
    pass
except KeyboardInterrupt:
    pass
try:
    pass
except (OSError, builtins.KeyboardInterrupt):
    pass
with pytest.raises(KeyboardInterrupt):
    pass
try:
    pass
except SimulatedInterrupt:
    pass
with pytest.raises(SimulatedInterrupt):
    pass
"""
    assert swallowed_interrupts(source) == [4, 8, 10]
