"""The peer-reload benchmark's bookkeeping (benchmarks/peer_reload.py), without running it: the
agent's push log line it reads the replication bandwidth from, and the time lost per checkpoint
it derives. Nothing here is timed."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import peer_reload

        yield peer_reload
    finally:
        sys.path.remove(str(BENCH))


def test_the_push_parser_reads_the_agents_own_log_line(bench: Any, tmp_path: Path) -> None:
    """The line is produced by the agent's own format string (agent_replica.Replicator.push),
    so a change of its wording fails here instead of leaving the benchmark without bandwidth."""
    import flashckpt.agent_replica as ar

    log = tmp_path / "agent.log"
    handler = logging.FileHandler(log)
    lg = logging.getLogger("flashckpt.agent")
    old = lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    try:
        src = Path(ar.__file__).read_text()
        fmt = '"replica of rank %d step %d (%.1f MiB) sent to %s in %.2f s"'
        assert fmt in src, "the agent's push log line changed: update peer_reload.SENT_RE"
        lg.info(fmt.strip('"'), 1, 8, 256.0, "a", 0.5)
        lg.info("replica of rank 0 step 2 to b superseded")
    finally:
        lg.removeHandler(handler)
        handler.close()
        lg.setLevel(old)
    got = bench._pushes(str(log))
    assert got == [
        {"rank": 1, "step": 8, "mib": 256.0, "seconds": 0.5, "target": "a", "gib_s": 0.5}
    ]


def test_time_lost_per_checkpoint_is_the_slower_ranks_against_its_best_baseline(
    bench: Any,
) -> None:
    res = {
        "ranks": {
            0: {"base1_s": 4.0, "base2_s": 4.4, "ckpt_s": 8.0, "checkpoints": 4},
            1: {"base1_s": 4.2, "base2_s": 4.1, "ckpt_s": 9.0, "checkpoints": 4},
        }
    }
    got = bench._lost_per_ckpt(res)
    assert got["lost_per_ckpt_s"] == pytest.approx((9.0 - 4.1) / 4)
    assert got["noise_per_ckpt_s"] == pytest.approx(0.4 / 4)
    assert got["base_step_s"] == pytest.approx(4.1 / 8)
