"""The peer-reload benchmark's bookkeeping (benchmarks/peer_reload.py), without running it: the
agent's push log line it reads the replication bandwidth from, and the time lost per checkpoint
it derives. Nothing here is timed."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


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
    import flashckpt.agent.replicas.holder as ar

    log = tmp_path / "agent.log"
    handler = logging.FileHandler(log)
    lg = logging.getLogger("flashckpt.agent.daemon")
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


def test_the_failover_measure_reports_steady_and_first_step_times() -> None:
    """failover.py's _measure puts the first step after the resume next to a steady step (from
    one rank's consecutive steps before the kill) and gives each new rank's own first step, so a
    slow first step can be told from a slow job. Synthetic events; nothing is timed."""
    import argparse

    sys.path.insert(0, str(BENCH))
    try:
        import failover
    finally:
        sys.path.remove(str(BENCH))

    def ev(t: float, event: str, pid: int, rank: int, **kw: Any) -> dict[str, Any]:
        return {"t": t, "event": event, "pid": pid, "rank": rank, **kw}

    t_kill = 100.0
    events = [ev(0.0, "start", 1, 0, t_process=0.0), ev(0.0, "start", 2, 1, t_process=0.0)]
    for i in range(5):  # old workers step every 0.2 s until the kill
        events += [
            ev(99.0 + 0.2 * i, "step", 1, 0, step=i),
            ev(99.0 + 0.2 * i, "step", 2, 1, step=i),
        ]
    events += [
        ev(101.0, "start", 3, 0, t_process=101.0),
        ev(101.0, "start", 4, 1, t_process=101.0),
        ev(101.5, "pg_ready", 3, 0),
        ev(101.5, "pg_ready", 4, 1),
        ev(101.7, "ddp_ready", 3, 0),
        ev(101.8, "ddp_ready", 4, 1),
        ev(102.0, "restored", 3, 0, start_step=4, restored_from="memory"),
        ev(102.5, "restored", 4, 1, start_step=4, restored_from="peer-memory"),
        ev(103.0, "step", 3, 0, step=4),
        ev(104.0, "step", 4, 1, step=4),
    ]

    class FakeJob:
        flashckpt = False

        def events(self) -> list[dict[str, Any]]:
            return events

    args = argparse.Namespace(every=5, step_sleep=0.05)
    r = failover._measure("flashckpt-peer", FakeJob(), t_kill, args)
    assert r["steady_step_s"] == pytest.approx(0.2)
    assert r["first_step_s"] == pytest.approx(1.5)
    assert r["first_step_by_rank_s"] == {"0": pytest.approx(1.0), "1": pytest.approx(1.5)}
    assert r["step_sleep_s"] == 0.05
    # The restore splits at the slowest worker's model built: 0.3 s building, 0.7 s entering.
    assert r["restore_s"] == pytest.approx(1.0)
    assert r["model_s"] == pytest.approx(0.3) and r["entry_s"] == pytest.approx(0.7)
    # The kill's random point spans ``every`` steps of the job as it runs (0.2 s each here).
    assert failover._step_interval(events[:12]) == pytest.approx(0.2)
    assert failover._step_interval(events[:2]) == 0.0
