"""Real processes, real SIGKILL: trainers and agents die at arbitrary instants; nothing is lost."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import safetensors.torch
from fchelpers import (
    FcEnv,
    agent_process,
    finish_tinytrain,
    kill_job_processes,
    start_tinytrain,
)
from tinytrain import assert_same_run, logged_losses
from waiting import wait_until

from flashckpt.format.storage import Storage

pytestmark = pytest.mark.slow


def _trainer(
    env: FcEnv, log: Path, *extra: str, steps: int = 40, width: int = 32, every: int = 3
) -> subprocess.Popen[bytes]:
    flags = ("--steps", str(steps), "--width", str(width), "--every", str(every), *extra)
    return start_tinytrain(env, log, *flags)


def _finish(p: subprocess.Popen[bytes], log: Path) -> None:
    finish_tinytrain(p, log, 240)


def _reference(tmp_path: Path, env: FcEnv, steps: int, width: int) -> tuple[dict[int, str], dict]:
    ref_env = env.reference(tmp_path)
    log = tmp_path / "ref.log"
    _finish(_trainer(ref_env, log, steps=steps, width=width), log)
    ref = dict(logged_losses(log))
    assert sorted(ref) == list(range(steps))
    return ref, safetensors.torch.load_file(str(log) + ".final.safetensors")


def test_random_sigkills_of_the_trainer_lose_nothing(tmp_path: Path, fc_env: FcEnv) -> None:
    steps, width = 60, 200_000  # ~50 MB of state: copies and persistence take real time
    ref, ref_final = _reference(tmp_path, fc_env, steps, width)
    log, report = tmp_path / "run.log", tmp_path / "report.txt"
    rng = random.Random(1234)
    kills = 0
    for _ in range(4):
        p = _trainer(fc_env, log, "--report", str(report), steps=steps, width=width)
        # Wait until it trains, then kill at a random instant (in a copy, in persistence, ...).
        n0 = len(logged_losses(log))
        wait_until(
            lambda: len(logged_losses(log)) >= n0 + 2 or p.poll() is not None,  # noqa: B023
            "two more steps logged, or the trainer's exit",
            120,
            0.01,
        )
        time.sleep(rng.uniform(0.0, 0.6))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait(timeout=60)
    assert kills >= 2
    _finish(_trainer(fc_env, log, "--report", str(report), steps=steps, width=width), log)
    assert_same_run(log, ref, ref_final, steps)
    starts = [line.split() for line in report.read_text().splitlines()]
    assert any(src == "memory" for _, src in starts), starts  # hot reload happened
    st = Storage(fc_env.storage)
    assert st.committed_steps() and all(st.verify(s) == [] for s in st.committed_steps())


def test_sigkill_in_the_middle_of_a_snapshot_copy(tmp_path: Path, fc_env: FcEnv) -> None:
    steps = 30
    ref, ref_final = _reference(tmp_path, fc_env, steps, 32)
    log, report = tmp_path / "run.log", tmp_path / "report.txt"
    # Save #4 (label 12) is torn halfway by SIGKILL; the newest complete one is label 9.
    p = _trainer(fc_env, log, "--kill-in-copy", "4", "--mode", "sync", steps=steps)
    p.wait(timeout=120)
    assert p.returncode == -signal.SIGKILL
    _finish(_trainer(fc_env, log, "--report", str(report), steps=steps), log)
    assert report.read_text().split() == ["9", "memory"]
    assert_same_run(log, ref, ref_final, steps)


def test_sigkill_of_the_agent_during_persistence(tmp_path: Path, fc_env: FcEnv) -> None:
    steps, width = 24, 1_500_000  # ~400 MB per snapshot: persistence takes a while
    log, report = tmp_path / "run.log", tmp_path / "report.txt"
    agent = agent_process(fc_env)
    trainer = _trainer(fc_env, log, "--report", str(report), steps=steps, width=width, every=4)
    st = Storage(fc_env.storage)
    # Kill the agent while a step directory exists without a manifest (a write in flight).

    def in_flight() -> list[int]:
        dirs, done = st.all_step_dirs(), st.committed_steps()
        return [d for d in dirs if d not in done]

    wait_until(in_flight, "a step being persisted (its directory, no manifest)", 180, 0.005)
    # Both at once: a trainer outlives its agent and would start the next one (issue 12),
    # which would finish the half-written step this test wants to see left.
    agent.send_signal(signal.SIGKILL)
    trainer.send_signal(signal.SIGKILL)
    agent.wait(timeout=30)
    trainer.wait(timeout=30)
    kill_job_processes(fc_env.job)  # an agent the trainer may have started in between
    committed = st.committed_steps()
    partial = [d for d in st.all_step_dirs() if d not in committed]
    assert partial, "the kill should have left a half-written step behind"
    for s in committed:
        assert st.verify(s) == []
    # The next agent adopts the surviving snapshots; the trainer resumes from memory.
    agent2 = agent_process(fc_env)
    try:
        _finish(
            _trainer(fc_env, log, "--report", str(report), steps=steps, width=width, every=4), log
        )
        assert report.read_text().splitlines()[-1].split()[1] == "memory"
        committed = st.committed_steps()
        assert committed[-1] == steps
        assert all(st.verify(s) == [] for s in committed)
    finally:
        agent2.send_signal(signal.SIGTERM)
        agent2.wait(timeout=60)
    assert fc_env.segments() == []  # SIGTERM: clean shutdown removes the segments


def test_next_agent_keeps_segments_of_dead_jobs(tmp_path: Path, fc_env: FcEnv) -> None:
    """A dead agent's snapshots may still be wanted by its job (issue 12): another job's agent
    keeps them; only abandoned ones go, by age or `flashckpt clean` (tests/test_local_trust)."""
    log = tmp_path / "run.log"
    dead = FcEnv(
        job=fc_env.job + "d",
        node="n0",
        run_dir=fc_env.run_dir,
        storage=f"file://{tmp_path}/dead",
        storage_path=tmp_path / "dead",
    )
    a = agent_process(dead)
    t = _trainer(dead, log, steps=6, every=2)
    t.wait(timeout=120)
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=30)
    try:
        # exit_when_done is off for a hand-started agent: its segments stay after SIGKILL.
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"fc.{dead.job}.")]
        assert left
        b = agent_process(fc_env)
        try:
            kept = [n for n in os.listdir("/dev/shm") if n.startswith(f"fc.{dead.job}.")]
            assert kept == left
        finally:
            b.send_signal(signal.SIGTERM)
            b.wait(timeout=60)
    finally:
        for n in os.listdir("/dev/shm"):
            if n.startswith(f"fc.{dead.job}."):
                os.unlink(f"/dev/shm/{n}")


def test_breakpoint_save_then_clean_sigterm(tmp_path: Path, fc_env: FcEnv) -> None:
    """A trainer dies: the agent alone persists its newest complete snapshot; SIGTERM cleans up."""
    from flashckpt.format.shm import Slot

    log = tmp_path / "run.log"
    agent = agent_process(fc_env)
    t = _trainer(fc_env, log, steps=10_000, every=5, width=100_000)
    wait_until(lambda: len(logged_losses(log)) >= 23, "step 23 in the trainer's log", 120, 0.01)
    t.send_signal(signal.SIGKILL)
    t.wait(timeout=30)
    newest = -1
    for name in fc_env.segments():
        if ".r00000.s" in name and not name.endswith(".owner"):
            slot = Slot(f"/dev/shm/{name}")
            info = slot.header()
            if info is not None and info.complete:
                newest = max(newest, info.step)
            slot.close()
    assert newest >= 20
    st = Storage(fc_env.storage)
    wait_until(
        lambda: st.committed_steps()[-1:] >= [newest],
        f"the newest snapshot (step {newest}) committed",
        60,
        0.05,
        state=st.committed_steps,
    )
    assert st.committed_steps()[-1] == newest
    proc = psutil.Process(agent.pid)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=60) == 0
    assert not proc.is_running()
    assert fc_env.segments() == []


def test_back_to_back_runs_with_auto_started_agents(tmp_path: Path, fc_env: FcEnv) -> None:
    """A run that starts while the previous run's agent is shutting down still gets an agent."""
    log, report = tmp_path / "run.log", tmp_path / "report.txt"
    for steps in (6, 12, 18):
        _finish(_trainer(fc_env, log, "--report", str(report), steps=steps, every=3), log)
    starts = [line.split() for line in report.read_text().splitlines()]
    assert [int(s) for s, _ in starts] == [0, 6, 12]
    assert Storage(fc_env.storage).committed_steps()[-1] == 18
