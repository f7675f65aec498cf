"""The error hierarchy a caller can catch by family (issue 45).

Every public exception class of the package derives from ``FlashckptError`` through exactly one
of the families in ``flashckpt.errors.FAMILIES`` (each exported from ``flashckpt`` and
documented with what to do); private control-flow signals (a ``_Name`` class, or any class of a
``_private`` module) stay outside the hierarchy, so catching a family never catches them. The
builtin bases stay, so code that catches ``ValueError``, ``OSError``... keeps catching what it
did. The test imports every module of the package (each one, so a module no other module
imports is seen too) and checks every exception class whose ``__module__`` is in the package:
one rule, no list of exceptions to keep up to date.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import flashckpt
from flashckpt.errors import FAMILIES, FlashckptError

ROOT = Path(flashckpt.__file__).parent
ERRORS_PAGE = ROOT.parent / "docs" / "reference" / "errors.md"


def _all_modules() -> list[str]:
    """Every module of the package but the ``__main__`` ones (importing those runs them)."""
    names = ["flashckpt"]
    for info in pkgutil.walk_packages([str(ROOT)], prefix="flashckpt."):
        if info.name.rpartition(".")[2] != "__main__":
            names.append(info.name)
    return sorted(names)


@pytest.fixture(scope="module")
def classes() -> set[type[BaseException]]:
    """Every subclass of BaseException defined in a flashckpt module (after importing them all)."""
    for name in _all_modules():
        importlib.import_module(name)
    found: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [BaseException]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub in found:
                continue
            if sub.__module__.split(".")[0] == "flashckpt":
                found.add(sub)
            todo.append(sub)
    return found


def _private(cls: type) -> bool:
    """A ``_Name`` class, or one of a ``_private`` module: no caller's to catch."""
    return cls.__name__.startswith("_") or any(
        part.startswith("_") for part in cls.__module__.split(".")
    )


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}{tuple(b.__name__ for b in cls.__bases__)}"


def test_every_module_is_imported() -> None:
    """The walk sees every source file (a module pkgutil missed would escape the checks below)."""
    files = {
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in ROOT.rglob("*.py")
        if p.name != "__main__.py"
    }
    assert files - set(_all_modules()) == set()


def test_every_public_error_is_in_exactly_one_family(classes: set[type[BaseException]]) -> None:
    public = {c for c in classes if not _private(c)} - {FlashckptError, *FAMILIES}
    # the walk sees the package's own classes, in every family (a walk that found nothing, or
    # a family nothing is in, would pass vacuously)
    assert len(public) > 20
    assert all(any(issubclass(c, f) for c in public) for f in FAMILIES)
    wrong = sorted(
        f"{_name(c)} is in {[f.__name__ for f in FAMILIES if issubclass(c, f)] or 'no family'}"
        for c in public
        if sum(issubclass(c, f) for f in FAMILIES) != 1
    )
    assert wrong == [], (
        "every public error derives from exactly one family of flashckpt.errors.FAMILIES "
        "(keep the builtin it derived from as a second base); make a private control-flow "
        f"signal a _Name deriving from Exception instead: {wrong}"
    )


def test_no_private_signal_is_in_the_hierarchy(classes: set[type[BaseException]]) -> None:
    private = {c for c in classes if _private(c)}
    # the known signals are seen (the gRPC transport's, the launcher's, the lease stream's)
    assert {"_AttemptFailed", "_RetryRendezvous", "_StreamBroken", "CallFailed"} <= {
        c.__name__ for c in private
    }
    inside = sorted(_name(c) for c in private if issubclass(c, FlashckptError))
    assert inside == [], (
        "private control-flow signals must not derive from FlashckptError (a caller catching a "
        "family would catch them): derive them from Exception in the module that uses them, "
        f"and wrap one that can reach a caller in a public error: {inside}"
    )


def test_the_families_are_exported_plain_and_documented() -> None:
    page = " ".join(ERRORS_PAGE.read_text().split())
    for family in FAMILIES:
        name = family.__name__
        # plain: catching a family changes nothing for code that catches a builtin
        assert family.__bases__ == (FlashckptError,), name
        assert getattr(flashckpt, name) is family and name in flashckpt.__all__, name
        paragraphs = [
            " ".join(p.split()) for p in inspect.cleandoc(family.__doc__ or "").split("\n\n")
        ]
        advice = [p for p in paragraphs if p.startswith("What to do:")]
        assert len(paragraphs) >= 2 and len(advice) == 1, f"{name}: no 'What to do:' paragraph"
        # the errors reference lists the family with what to do (tests/docs: the page is current)
        section = page.partition(f"### `{name}`")[2].partition("###")[0]
        assert "**What to do:**" in section and advice[0].split()[3] in section, name


def test_the_class_statements_the_walk_sees(classes: set[type[BaseException]]) -> None:
    """Cross-check by source: every ``class X(...Error/Exception...)`` statement is in the set."""
    seen = {(c.__module__, c.__name__) for c in classes}
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
            named = any(b.endswith(("Error", "Exception")) for b in bases)
            if named and (module, node.name) not in seen:
                missing.append(f"{module}.{node.name}")
    assert missing == []


def test_builtin_bases_stay_for_callers_that_catch_them() -> None:
    """The classes that were builtins before the families still are; the merged duplicates are
    one class each under every name they had."""
    from flashckpt import errors
    from flashckpt.agent import persist
    from flashckpt.agent.daemon import AgentRunning
    from flashckpt.elastic.etcd.client import EtcdError, EtcdTimeout
    from flashckpt.elastic.etcd.server import EtcdV3ServerError
    from flashckpt.elastic.etcd.standalone import StandaloneEtcdError
    from flashckpt.elastic.launch.agent_runner import NodeAgentError
    from flashckpt.elastic.launch.config import LaunchError
    from flashckpt.elastic.membership.nodes import NodeIdInUse
    from flashckpt.format.exclusive import ExclusiveCreateUnsupported
    from flashckpt.format.storage import CheckpointFileMissing
    from flashckpt.testing.s3 import S3ServerError
    from flashckpt.trainer.snapshot import BadMemory, TornSnapshot

    builtins: dict[type, type] = {
        errors.CorruptCheckpointError: ValueError,
        CheckpointFileMissing: ValueError,
        errors.CorruptSnapshotError: ValueError,
        errors.RestoreError: ValueError,
        errors.ProtocolError: ValueError,
        errors.StorageUnavailableError: OSError,
        ExclusiveCreateUnsupported: OSError,
        errors.UnsafeLocalStateError: PermissionError,
        errors.ShmSpaceError: RuntimeError,
        errors.AgentError: RuntimeError,
        errors.PersistError: RuntimeError,
        AgentRunning: RuntimeError,
        EtcdV3ServerError: RuntimeError,
        StandaloneEtcdError: RuntimeError,
        NodeAgentError: RuntimeError,
        LaunchError: RuntimeError,
        NodeIdInUse: RuntimeError,
        S3ServerError: RuntimeError,
        EtcdTimeout: TimeoutError,
    }
    lost = [c.__name__ for c, b in builtins.items() if not issubclass(c, b)]
    assert lost == []
    assert EtcdError is errors.EtcdError
    assert BadMemory is errors.CorruptSnapshotError and TornSnapshot is errors.TornSnapshot
    assert persist._Scribbled is errors.CorruptSnapshotError
    assert persist._Torn is errors.TornSnapshot
