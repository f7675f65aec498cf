"""An idle node agent wakes rarely: its threads wait for the event that gives them work (a
snapshot, a connection, a stop), not on short timeouts, so a machine whose cores train loses
next to nothing to an agent that has nothing to do.

Measured as the voluntary context switches of every thread of a real agent process
(``/proc/<pid>/task/*/status``) over an idle window: a count of wake-ups, not a timing (a loaded
machine delays them, it does not add any). The agent's threads polled at 4-10 Hz each before:
~72 a second in all with the main loop at 4 Hz, ~90 before that; the bound is generous against
the few wake-ups that remain (the main loop's 1 Hz look at its timeouts, the step monitor's
reads of the trainers' rings)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from agentproc import AgentProc, start_agent
from fchelpers import FcEnv, RunningAgent, agent_process
from tinytrain import trained
from waiting import wait_until

import flashckpt
import flashckpt.agent.daemon

WINDOW_S = 3.0
"""The idle window measured."""
MAX_PER_S = 15.0
"""The bound on wake-ups a second of the whole agent (the old code: ~72)."""


def _switches(pid: int) -> dict[int, int]:
    """Voluntary context switches so far of every thread of ``pid``: thread id -> count."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                out[int(task.name)] = int(line.split()[1])
    return out


def _wakeups_per_s(pid: int, window: float = WINDOW_S) -> tuple[float, dict[int, int]]:
    """Wake-ups a second of the process over ``window`` seconds, and those of each thread (a
    thread started meanwhile counts from zero)."""
    before = _switches(pid)
    t0 = time.monotonic()
    time.sleep(window)
    after = _switches(pid)
    dt = time.monotonic() - t0
    per = {tid: n - before.get(tid, 0) for tid, n in after.items()}
    return sum(per.values()) / dt, per


def _stop(p: AgentProc) -> None:
    assert p.stop(timeout=60) == 0, p.log_tail()


def test_an_agent_without_trainers_wakes_rarely(fc_env: FcEnv) -> None:
    a = agent_process(fc_env)
    try:
        time.sleep(1.0)  # warm-up: the start's work (adoption, the first scans) is done
        rate, per = _wakeups_per_s(a.pid)
        detail = sorted((n for n in per.values() if n), reverse=True)
        print(f"idle agent, no trainer: {rate:.1f} wake-ups/s; per thread {detail}")
        assert rate < MAX_PER_S, f"{rate:.1f} wake-ups a second (per thread: {detail})"
    finally:
        _stop(a)


def test_an_agent_whose_trainer_does_not_save_wakes_rarely(fc_env: FcEnv) -> None:
    """A trainer connected, its snapshots persisted, between two saves."""
    a = agent_process(fc_env)
    try:
        with trained(fc_env):
            time.sleep(1.0)  # warm-up: the hash, persist and commit of step 4 are done
            rate, per = _wakeups_per_s(a.pid)
            detail = sorted((n for n in per.values() if n), reverse=True)
            print(f"idle agent, trainer connected: {rate:.1f} wake-ups/s; per thread {detail}")
            assert rate < MAX_PER_S, f"{rate:.1f} wake-ups a second (per thread: {detail})"
    finally:
        _stop(a)


def test_a_stop_wakes_every_thread_of_the_agent(
    fc_env: FcEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waits are woken by the stop, not ended by their timeouts: with the main loop's tick
    and every thread's safety net an hour long, the agent and all its threads still end."""
    monkeypatch.setattr(flashckpt.agent.daemon, "MAIN_TICK_S", 3600.0)
    before = set(threading.enumerate())
    a = RunningAgent(fc_env.agent_config(poll_interval=3600.0))
    time.sleep(0.5)  # every thread is in its wait
    ours = [t for t in threading.enumerate() if t not in before and t.name.startswith("flashckpt")]
    assert len(ours) >= 8, [t.name for t in ours]  # accept, persist, ..., replica (+ monitor)
    a.stop()  # joins the main loop (60 s at most, not the hour)
    wait_until(
        lambda: not any(t.is_alive() for t in ours),
        "every agent thread to end after the stop",
        interval=0.05,
        state=lambda: f"still waiting: {[t.name for t in ours if t.is_alive()]}",
    )


def test_a_signal_stops_an_agent_whose_main_loop_would_sleep_an_hour(fc_env: FcEnv) -> None:
    """SIGTERM ends the main loop's wait at once (the handler writes to its pipe: a signal
    alone does not end a select(), Python resumes it), whatever the tick."""
    code = (
        "import sys, flashckpt.agent.daemon, flashckpt.cli; "
        "flashckpt.agent.daemon.MAIN_TICK_S = 3600.0; "
        "sys.exit(flashckpt.cli.main(sys.argv[1:]))"
    )
    p = start_agent(fc_env, idle_timeout=7200, launcher=(sys.executable, "-c", code))
    time.sleep(0.5)  # in its wait
    _stop(p)
