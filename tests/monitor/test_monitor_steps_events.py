"""The events file's ``steps`` batches count steps completed (issue 30: one step convention):
``first``/``last`` are ``ckpt.steps_done`` after the batch's first and last iteration, as
status, the metrics, the launcher's summary and the logs print, marked ``"v": 2``. Lines written
before (no ``v``: 0-based iteration indices) are still read right, by the agent's monitor (the
steps a restarted trainer re-runs) and the launcher's summary; a version this flashckpt does not
know is never guessed at."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_step
from waiting import wait_until

import flashckpt
from flashckpt.elastic.launch.restore_report import job_summary
from flashckpt.monitor.goodput import read_events, steps_span
from flashckpt.monitor.step_monitor import MonitorConfig


def _events_path(env: FcEnv) -> str:
    return os.path.join(env.run_dir, f"{env.job}.{env.node}.events.jsonl")


def _train(env: FcEnv, steps: int) -> RunningAgent:
    """``steps`` steps of rank 0 under an agent whose monitor writes a batch every 0.1 s; the
    agent is stopped (its events written) when this returns."""
    cfg = MonitorConfig(poll_s=0.05, metrics_port=None, events_interval_s=0.1)
    agent = RunningAgent(env.agent_config(monitor=cfg))
    try:
        model, opt, sched = make(0)
        kw = env.ckpt_kwargs(agent="connect")
        with flashckpt.checkpointing(model, opt, scheduler=sched, every=4, **kw) as ck:
            for step in range(steps):
                train_step(model, opt, sched, step)
                ck.step()
                time.sleep(0.02)  # several batches
        wait_until(
            lambda: agent.agent.status()["monitor"]["ranks"].get("0", {}).get("state") == "exit",
            "the exit (the monitor may not have seen the rank yet)",
            timeout=30.0,
        )
    finally:
        agent.stop()
    return agent


def test_steps_batches_count_steps_completed(fc_env: FcEnv) -> None:
    _train(fc_env, 12)
    batches = [e for e in read_events([_events_path(fc_env)]) if e["event"] == "steps"]
    assert batches and all(b["v"] == 2 for b in batches), batches
    # The first iteration completes step 1, the last step 12; the batches tile 1..12.
    assert batches[0]["first"] == 1 and batches[-1]["last"] == 12, batches
    for a, b in itertools.pairwise(batches):
        assert b["first"] == a["last"] + 1, (a, b)
    assert sum(b["n"] for b in batches) == 12
    assert [steps_span(b) for b in batches] == [(b["first"], b["last"]) for b in batches]
    summary = job_summary(_events_path(fc_env), restarts=0)
    assert summary is not None and summary.startswith("summary: 12 steps completed"), summary


def _seed(env: FcEnv, steps_line: dict[str, Any]) -> None:
    """An earlier incarnation of rank 0 in the events file, as an earlier agent left it."""
    os.makedirs(env.run_dir, mode=0o700, exist_ok=True)
    t = time.time() - 100
    lines = [
        {"event": "start", "rank": 0, "token": "old", "proc_start": t, "enter": t, "ready": t},
        {"event": "steps", "rank": 0, "token": "old", "n": 6, "t1": t + 6, "step_s": 6.0,
         **steps_line},
        {"event": "end", "rank": 0, "token": "old", "reason": "died", "t": t + 7},
    ]  # fmt: skip
    Path(_events_path(env)).write_text("".join(json.dumps(e) + "\n" for e in lines))


@pytest.mark.parametrize(
    "line",
    [
        {"first": 0, "last": 5},  # written before "v": iterations 0..5 (6 steps done)
        {"v": 2, "first": 1, "last": 6},  # the same 6 steps, as written now
    ],
    ids=["old-indices", "v2-steps-done"],
)
def test_an_earlier_agents_batches_are_read_in_their_own_convention(
    fc_env: FcEnv, line: dict[str, Any]
) -> None:
    """A restarted trainer that starts over re-runs the 6 steps the file says were done: its
    first 6 iterations are recomputed (not 5, not 7), whichever convention the file used."""
    _seed(fc_env, line)
    _train(fc_env, 10)
    events = read_events([_events_path(fc_env)])
    new = [e for e in events if e["event"] == "steps" and e["token"] != "old"]
    assert sum(e["recomputed_n"] for e in new) == 6, new
    assert sum(e["n"] for e in new) == 10
    summary = job_summary(_events_path(fc_env), restarts=1)
    assert summary is not None and summary.startswith("summary: 10 steps completed"), summary
    # The old line alone: 6 steps completed, in both conventions.
    seeded = next(e for e in events if e["event"] == "steps" and e["token"] == "old")
    assert steps_span(seeded) == (1, 6)


def test_an_unknown_version_is_refused_not_guessed(
    fc_env: FcEnv, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match=r"version 3 .*newer flashckpt"):
        steps_span({"event": "steps", "v": 3, "first": 1, "last": 6})
    _seed(fc_env, {"v": 3, "first": 1, "last": 6})
    with caplog.at_level(logging.WARNING, logger="flashckpt.monitor.step_monitor"):
        _train(fc_env, 4)
    assert any("version 3" in r.getMessage() for r in caplog.records), caplog.text
    new = [
        e
        for e in read_events([_events_path(fc_env)])
        if e["event"] == "steps" and e["token"] != "old"
    ]
    assert sum(e["recomputed_n"] for e in new) == 0, new  # nothing taken from the v3 line
