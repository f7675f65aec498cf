"""The README stays a front page (issue 32): short, with the set-up commands CI and the demo run.
Topics go to docs/ pages, one line in the README's feature list each."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_readme_stays_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= 150, (
        f"README.md has {n} lines (at most 150): put the topic on its page under docs/ (index: "
        "docs/README.md) and give it one line in the README's feature list"
    )


def test_readme_names_the_commands_ci_and_the_demo_run() -> None:
    text = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for script in ("test.sh", "demo.sh"):
        command = f"bash scripts/{script}"
        assert (ROOT / "scripts" / script).exists()
        assert command in text, f"README.md lost its set-up command {command!r}"
    assert "bash scripts/test.sh" in ci, ".ci/run no longer runs the README's test command"
