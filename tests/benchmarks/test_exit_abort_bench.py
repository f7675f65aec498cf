"""The exit-abort benchmark (benchmarks/exit_abort.py) run tiny: one launch of the checkpointer
variant and one of torch's with ``destroy_process_group()``, no burners. Checks the JSON's shape
and that both ran to exit 0; how often the plain variant aborts is the benchmark's to measure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "exit_abort.py"


def test_an_unknown_variant_is_refused() -> None:
    p = subprocess.run(
        [sys.executable, str(BENCH), "--variants", "torch,nccl"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "unknown variant 'nccl'" in p.stderr


@pytest.mark.slow
def test_a_tiny_run_counts_each_variant(tmp_path: Path) -> None:
    out = tmp_path / "ea.json"
    cmd = [sys.executable, str(BENCH), "--runs", "1", "--burners", "0"]
    cmd += ["--variants", "torch-destroyed,flashckpt", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["benchmark"] == "exit_abort" and res["burners"] == 0
    assert set(res["variants"]) == {"torch-destroyed", "flashckpt"}
    for name, v in res["variants"].items():
        assert v["runs"] == 1 and v["other_failures"] == 0, (name, v["examples"])
    # Ended group: nothing left for a worker thread to drop at shutdown (the checkpointer's
    # variant may abort as torch alone does, rarely: the benchmark's to count, not a test's).
    assert res["variants"]["torch-destroyed"]["aborted"] == 0
