"""The names of flashckpt's files on a machine are a format (other processes and versions find
each other's files by them): built in :mod:`flashckpt.names` only, byte for byte as before."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flashckpt import names
from flashckpt.elastic.launch import restore_report
from flashckpt.format import shm
from flashckpt.protocol import channel as protocol

ROOT = Path(__file__).resolve().parents[2]


def test_every_name_is_unchanged() -> None:
    assert names.slot_prefix("j", "n") == "fc.j.n."
    assert names.slot_path("/dev/shm", "j", "n", 3, 1) == "/dev/shm/fc.j.n.r00003.s1"
    assert names.ring_path("/dev/shm", "j", "n", 12) == "/dev/shm/fc.j.n.r00012.mon"
    assert names.owner_path("/dev/shm", "j", "n") == "/dev/shm/fc.j.n.owner"
    assert names.socket_path("/run", "j", "n") == "/run/j.n.sock"
    assert names.lock_path("/run", "j", "n") == "/run/j.n.lock"
    assert names.agent_log_path("/run", "j", "n") == "/run/j.n.log"
    assert names.stacks_path("/run", "j", "n", 7) == "/run/j.n.r00007.stacks.log"
    assert names.events_path("/ev", "j", "n") == "/ev/j.n.events.jsonl"
    assert names.goodput_report_path("/ev", "j", "n") == "/ev/j.n.goodput.txt"
    assert names.generation_run_dir("/run", "j", "n", 2) == "/run/j.n.g2"
    assert names.generation_log_path("/run", "j", "n", 2) == "/run/j.n.g2.log"
    assert names.generation_shm_dir("/dev/shm", "j", "n", 2) == "/dev/shm/flashckpt.j.n.g2"
    assert names.prewarm_socket_path("/run", "j", "n") == "/run/j.n.prewarm"
    assert names.prewarm_log_path("/run", "j", "n") == "/run/j.n.prewarm.log"


def test_the_old_homes_build_the_same_names() -> None:
    assert shm.slot_path("/d", "j", "n", 0, 0) == names.slot_path("/d", "j", "n", 0, 0)
    assert shm.slot_prefix("j", "n") == names.slot_prefix("j", "n")
    assert protocol.socket_path("/r", "j", "n") == names.socket_path("/r", "j", "n")
    assert restore_report.events_path("/r", "j", "n") == names.events_path("/r", "j", "n")


def test_the_patterns_parse_what_the_builders_build() -> None:
    slot = Path(names.slot_path("/d", "job-1", "node_2", 42, 1)).name
    m = names.SLOT_NAME_RE.match(slot)
    assert m is not None and m.groups() == ("job-1", "node_2", "00042", "1")
    suffix = slot[len(names.slot_prefix("job-1", "node_2")) :]
    m2 = names.SLOT_SUFFIX_RE.fullmatch(suffix)
    assert m2 is not None and m2.group(1) == "00042"
    for path in (
        names.owner_path("/d", "job-1", "node_2"),
        names.ring_path("/d", "job-1", "node_2", 0),
    ):
        g = names.GROUP_NAME_RE.match(Path(path).name)
        assert g is not None and g.groups() == ("job-1", "node_2")
    assert names.SLOT_NAME_RE.match(Path(names.ring_path("/d", "j", "n", 0)).name) is None


@pytest.mark.parametrize("bad", ["", "a.b", "a/b", "x" * 65, "é"])
def test_check_name_refuses_what_would_break_a_name(bad: str) -> None:
    with pytest.raises(ValueError, match="not a valid id"):
        names.check_name("job", bad)


def test_no_segment_or_file_name_is_spelled_outside_names() -> None:
    found = []
    for pkg in ("flashckpt",):
        for path in sorted((ROOT / pkg).glob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "flashckpt/names.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if not isinstance(node, ast.JoinedStr):
                    continue
                text = "".join(
                    v.value if isinstance(v, ast.Constant) else "{}" for v in node.values
                )
                if (
                    text.startswith("fc.")
                    or text.startswith("flashckpt.{}")
                    or any(
                        text.endswith(end)
                        for end in (".sock", ".lock", ".owner", ".mon", ".events.jsonl", ".prewarm")
                    )
                    or (text.startswith("{}.{}.") and not text.startswith("{}.{}.{}"))
                ):
                    found.append(f"{rel}:{node.lineno}: f{text!r}")
    assert found == []
