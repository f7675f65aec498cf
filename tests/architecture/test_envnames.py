"""The ``FLASHCKPT_*`` variables are named in one module, :mod:`flashckpt.envnames`; their names
are public and must not change."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flashckpt import envnames

ROOT = Path(__file__).resolve().parents[2]


def test_the_public_names_are_unchanged() -> None:
    assert envnames.ALL == (
        "FLASHCKPT_JOB",
        "FLASHCKPT_NODE",
        "FLASHCKPT_RUN_DIR",
        "FLASHCKPT_SHM_DIR",
        "FLASHCKPT_STORAGE",
        "FLASHCKPT_WORLD_ID",
        "FLASHCKPT_JOB_START",
        "FLASHCKPT_LAUNCHER_PID",
        "FLASHCKPT_PREWARM_SOCKET",
        "FLASHCKPT_WORKER_FAST_EXIT",
        "FLASHCKPT_INJECT_HEALTH_FAULT",
        "FLASHCKPT_WORKER_ERRORS",  # added (issue 41): the names above stay
        "FLASHCKPT_ETCD_CA",
        "FLASHCKPT_ETCD_CERT",
        "FLASHCKPT_ETCD_KEY",
        "FLASHCKPT_ETCD_USER",
        "FLASHCKPT_ETCD_PASSWORD",
        "FLASHCKPT_ETCD_PASSWORD_FILE",
        "FLASHCKPT_STORAGE_OPTIONS_FILE",
    )


def test_readers_treat_empty_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envnames.JOB, "")
    assert envnames.job() is None
    monkeypatch.delenv(envnames.NODE, raising=False)
    assert envnames.node() is None
    for reader, name in (
        (envnames.job, envnames.JOB),
        (envnames.node, envnames.NODE),
        (envnames.run_dir, envnames.RUN_DIR),
        (envnames.shm_dir, envnames.SHM_DIR),
        (envnames.world_id, envnames.WORLD_ID),
    ):
        monkeypatch.setenv(name, f"v-{name}")
        assert reader() == f"v-{name}"


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    # Attribute docstrings (a string statement after an assignment) are documentation too.
    docstrings |= {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_no_variable_name_is_spelled_outside_envnames() -> None:
    found = []
    for pkg in ("flashckpt",):
        for path in sorted((ROOT / pkg).glob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "flashckpt/envnames.py":
                continue
            found += [
                f"{rel}:{line}: {text!r}"
                for line, text in _code_strings(path)
                if "FLASHCKPT_" in text
            ]
    assert found == []
