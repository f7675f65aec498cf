"""The reference pages of docs/reference/ are what ``scripts/gen_reference.py`` makes of the code
now, and the CLI's flag set is the one pinned in ``tests/docs/cli_flags.txt`` (as torchtitan pins
its command line): a flag added, renamed or removed is a deliberate change to that file."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIN = ROOT / "tests" / "docs" / "cli_flags.txt"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "scripts" / "gen_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_reference", module)
    spec.loader.exec_module(module)
    return module


def pinned() -> list[str]:
    lines = (line.strip() for line in PIN.read_text().splitlines())
    return sorted(line for line in lines if line and not line.startswith("#"))


def pin_diff(pin: list[str], current: list[str]) -> str:
    """What differs between the pinned flag set and the parsers', as a message ('' if equal)."""
    added = sorted(set(current) - set(pin))
    removed = sorted(set(pin) - set(current))
    if not added and not removed:
        return ""
    lines = ["the flashckpt CLI's flags differ from tests/docs/cli_flags.txt:"]
    lines += [f"  new:  {f}" for f in added] + [f"  gone: {f}" for f in removed]
    lines.append(
        "a flag changes users' command lines: if this is on purpose, update "
        "tests/docs/cli_flags.txt (python scripts/gen_reference.py --flags prints the set) and "
        "regenerate the docs "
        "(python scripts/gen_reference.py)"
    )
    return "\n".join(lines)


def test_reference_pages_are_current(gen: ModuleType) -> None:
    wrong = gen.stale(gen.render())
    assert not wrong, (
        f"stale generated pages: {', '.join(wrong)}; regenerate them with "
        "`python scripts/gen_reference.py` and commit the result"
    )


def test_a_stale_page_is_found(gen: ModuleType, tmp_path: Path) -> None:
    pages = {"a.md": "one\n", "b.md": "two\n"}
    (tmp_path / "a.md").write_text("one\n")
    (tmp_path / "b.md").write_text("two, edited by hand\n")
    assert gen.stale(pages, tmp_path) == [(tmp_path / "b.md").as_posix()]
    (tmp_path / "a.md").unlink()
    assert len(gen.stale(pages, tmp_path)) == 2


def test_cli_flag_set_is_pinned(gen: ModuleType) -> None:
    message = pin_diff(pinned(), gen.flag_set())
    assert not message, message


def test_a_changed_flag_fails_the_pin() -> None:
    pin = ["agent --keep", "run --nnodes"]
    assert pin_diff(pin, pin) == ""
    message = pin_diff(pin, ["agent --keep", "run --nnodes", "run --new-flag"])
    assert "new:  run --new-flag" in message
    assert "gone:  " not in message
    assert "gone: agent --keep" in pin_diff(pin, ["run --nnodes"])


def test_every_verb_has_a_section(gen: ModuleType) -> None:
    verbs = [verb for verb, _ in gen.parsers()]
    cli = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert len(verbs) > 5
    for verb in verbs[1:]:
        assert f"\n## flashckpt {verb}\n" in cli


def test_every_flag_has_a_description(gen: ModuleType) -> None:
    assert gen.undescribed() == [], (
        "flags without a description (help=...): the reference would show nothing for them"
    )


def test_the_generator_refuses_an_undescribed_flag(gen: ModuleType) -> None:
    parser = argparse.ArgumentParser(prog="flashckpt demo")
    parser.add_argument("--quiet-flag", action="store_true")
    (action,) = [a for a in parser._actions if a.dest == "quiet_flag"]
    with pytest.raises(gen.UndescribedFlag, match="flashckpt demo --quiet-flag has no description"):
        gen._help(action, parser.prog, None)
