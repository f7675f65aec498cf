"""Every exception class flashckpt defines derives from ``FlashckptError``.

A caller that wants "anything flashckpt raised on purpose" catches one type; the stdlib mixins
(``RuntimeError``, ``ValueError``, ``TimeoutError``, ...) stay so that code catching those keeps
working. The test imports every module of the package (each one, so a module no other module
imports is seen too) and checks every exception class whose ``__module__`` is in the package,
private control-flow signals included: one rule, no list of exceptions to keep up to date.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import flashckpt
from flashckpt.errors import FlashckptError

ROOT = Path(flashckpt.__file__).parent


def _all_modules() -> list[str]:
    """Every module of the package but the ``__main__`` ones (importing those runs them)."""
    names = ["flashckpt"]
    for info in pkgutil.walk_packages([str(ROOT)], prefix="flashckpt."):
        if info.name.rpartition(".")[2] != "__main__":
            names.append(info.name)
    return sorted(names)


def _exception_classes() -> set[type[BaseException]]:
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


def test_every_module_is_imported() -> None:
    """The walk sees every source file (a module pkgutil missed would escape the check below)."""
    files = {
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in ROOT.rglob("*.py")
        if p.name != "__main__.py"
    }
    assert files - set(_all_modules()) == set()


def test_every_exception_class_derives_from_flashckpt_error() -> None:
    classes = _exception_classes()
    # the walk sees the package's own classes (a walk that found nothing would pass vacuously)
    assert FlashckptError in classes and len(classes) > 10
    outside = sorted(
        f"{c.__module__}.{c.__qualname__}{tuple(b.__name__ for b in c.__bases__)}"
        for c in classes
        if not issubclass(c, FlashckptError)
    )
    assert outside == [], (
        "exception classes outside the hierarchy: derive each from flashckpt.errors."
        f"FlashckptError (keep the builtin it derived from as a second base): {outside}"
    )


def test_the_walk_sees_every_class_statement_that_names_an_exception_base() -> None:
    """Cross-check by source: every ``class X(...Error/Exception...)`` statement is in the set."""
    seen = {(c.__module__, c.__name__) for c in _exception_classes()}
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


def test_builtin_mixins_stay_for_callers_that_catch_them() -> None:
    """The classes that were RuntimeError/TimeoutError before the hierarchy still are."""
    from flashckpt.agent.daemon import AgentRunning
    from flashckpt.elastic.etcd.client import EtcdError, EtcdTimeout
    from flashckpt.elastic.etcd.server import EtcdV3ServerError
    from flashckpt.elastic.etcd.standalone import StandaloneEtcdError
    from flashckpt.elastic.launch.agent_runner import NodeAgentError
    from flashckpt.elastic.launch.config import LaunchError
    from flashckpt.elastic.membership.nodes import NodeIdInUse

    for cls in (
        AgentRunning,
        EtcdV3ServerError,
        StandaloneEtcdError,
        NodeAgentError,
        LaunchError,
        NodeIdInUse,
    ):
        assert issubclass(cls, RuntimeError) and issubclass(cls, FlashckptError), cls
    assert issubclass(EtcdTimeout, TimeoutError) and issubclass(EtcdTimeout, EtcdError)
