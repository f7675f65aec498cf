"""The failover benchmark's step accounting (benchmarks/failover.py), on made-up events: which
workers are the job's first, each worker's first ``train()`` against its later ones. Nothing here
runs a job or is timed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "failover.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("failover_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("failover_bench", mod)
    spec.loader.exec_module(mod)
    return mod


def _step(pid: int, rank: int, t: float, train_s: float) -> dict[str, Any]:
    return {"event": "step", "pid": pid, "rank": rank, "t": t, "train_s": train_s}


def test_first_steps_of_fresh_and_resumed_workers_against_the_later_ones() -> None:
    fo = _bench()
    events = [
        {"event": "start", "pid": 10, "rank": 0, "t": 0.0},
        {"event": "start", "pid": 11, "rank": 1, "t": 0.1},
        _step(10, 0, 1.0, 2.0),
        _step(11, 1, 1.0, 2.5),
        _step(10, 0, 2.0, 1.0),
        _step(11, 1, 2.0, 1.2),
        _step(10, 0, 3.0, 1.4),
        # rank 1's machine killed; its replacement and the survivor's new worker resume
        {"event": "start", "pid": 20, "rank": 0, "t": 4.0},
        {"event": "start", "pid": 21, "rank": 1, "t": 4.0},
        _step(21, 1, 6.0, 1.9),
        _step(20, 0, 6.0, 1.7),
        _step(21, 1, 7.0, 1.1),
    ]
    assert fo._first_pids(events) == {10, 11}
    before = [e for e in events if e.get("pid") in (10, 11)]
    after = [e for e in events if e.get("pid") in (20, 21)]
    assert fo._first_train_s(before) == 2.5  # the slowest worker's first step
    assert fo._first_train_s(after) == 1.9
    assert [e["train_s"] for e in fo._after_first_steps(before)] == [1.0, 1.2, 1.4]
    # A worker that logs no train_s (torch.save mode) gives none.
    assert fo._first_train_s([{"event": "step", "pid": 1, "rank": 0, "t": 0.0}]) is None
