"""Every teardown of the node agent persists or keeps (issue 30): real processes, a trainer whose
newest snapshots are not marked for storage (``persist_every="5m"``), then the agent stopped the
ways a run ends: SIGTERM to the agent, or SIGKILL of the process that started it (its launcher:
the agent gets its parent-death SIGTERM). Storage must then hold the newest snapshot memory held,
or (storage failing) the segments stay and the rerun resumes from them, bitwise equal to an
uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import safetensors.torch
import torch
from agentproc import agent_command, agent_status, start_agent, wait_agent
from fchelpers import (
    FcEnv,
    finish_tinytrain,
    kill_job_processes,
    start_tinytrain,
)
from waiting import wait_until

from flashckpt.agent.daemon import EXIT_KEPT
from flashckpt.format.storage import Storage

pytestmark = pytest.mark.slow

STEPS = 60


def _train(env: FcEnv, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    return start_tinytrain(env, log, "--steps", str(STEPS), "--every", "1", "--quiet", *extra)


def _reference(tmp_path: Path, env: FcEnv) -> dict[str, torch.Tensor]:
    ref = env.reference(tmp_path)
    log = tmp_path / "ref.log"
    try:
        finish_tinytrain(_train(ref, log), log, 240)
    finally:
        kill_job_processes(ref.job)
    return safetensors.torch.load_file(str(log) + ".final.safetensors")


_status = agent_status


def _newest_slot(env: FcEnv) -> int:
    steps = [s for s in _status(env)["ranks"]["0"]["slots"] if s is not None]
    return max(steps, default=-1)


def _slot_files(env: FcEnv) -> list[str]:
    return [n for n in os.listdir(env.shm_dir) if n.startswith(f"fc.{env.job}.") and ".s" in n[-3:]]


@pytest.mark.parametrize("how", ["sigterm", "parent_killed"])
def test_stop_persists_the_newest_unmarked_snapshot(
    tmp_path: Path, fc_env: FcEnv, how: str
) -> None:
    """The newest snapshot is not marked for storage (persist_every=5m): the stop writes it
    anyway, commits it, then frees the memory; the rerun resumes from it, bitwise equal."""
    ref_final = _reference(tmp_path, fc_env)
    log, report = tmp_path / "run.log", tmp_path / "report.txt"
    agent_log = open(tmp_path / "agent.log", "ab")  # noqa: SIM115
    if how == "sigterm":
        agent = start_agent(fc_env, log=tmp_path / "agent.log", ready=False)
        parent = None
    else:
        # A stand-in launcher: spawns the agent with PR_SET_PDEATHSIG=SIGTERM, as elastic does.
        code = (
            "import subprocess,sys,time\n"
            "from flashckpt.elastic.procutil import die_with_parent\n"
            "import signal\n"
            f"p=subprocess.Popen({agent_command(fc_env)!r},"
            "preexec_fn=die_with_parent(signal.SIGTERM))\n"
            "print(p.pid,flush=True)\n"
            "time.sleep(3600)\n"
        )
        parent = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=agent_log
        )
        assert parent.stdout is not None
        agent = None
    agent_log.close()
    try:
        pid = wait_agent(fc_env, proc=agent or parent)
        proc = psutil.Process(pid)
        t = _train(fc_env, log, "--persist-every", "5m", "--step-sleep", "0.05")
        st = Storage(fc_env.storage)
        # The first snapshot is marked (persist_every's first); later ones are not for 5 min.
        wait_until(lambda: st.committed_steps() != [], "the first commit", timeout=120.0)
        wait_until(lambda: _newest_slot(fc_env) >= 12, "snapshots in memory", timeout=120.0)
        t.send_signal(signal.SIGSTOP)  # connected, frozen: its snapshots stay unmarked
        wait_until(
            lambda: _status(fc_env)["ranks"]["0"]["slots"].count(None) == 0,
            "2 slots",
            timeout=120.0,
        )
        newest = _newest_slot(fc_env)
        assert max(st.committed_steps()) < newest  # what the stop must write
        if parent is None:
            assert agent is not None
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(timeout=120) == 0
        else:
            parent.send_signal(signal.SIGKILL)
            parent.wait(timeout=30)
            proc.wait(timeout=120)
        t.send_signal(signal.SIGKILL)
        t.wait(timeout=30)
        assert st.committed_steps()[-1] == newest
        assert _slot_files(fc_env) == []  # storage holds it: the memory is freed
        finish_tinytrain(_train(fc_env, log, "--report", str(report)), log, 240)
        assert report.read_text().split() == [str(newest), "storage"]
    finally:
        kill_job_processes(fc_env.job)
    final = safetensors.torch.load_file(str(log) + ".final.safetensors")
    assert final.keys() == ref_final.keys()
    for k in final:
        assert torch.equal(final[k], ref_final[k]), k


def test_stop_with_failing_storage_keeps_the_segments(tmp_path: Path, fc_env: FcEnv) -> None:
    """Storage fails at the stop: the segments stay (exit code EXIT_KEPT, the log says so and
    where); the next agent adopts them and the rerun resumes from memory, bitwise equal."""
    ref_final = _reference(tmp_path, fc_env)
    log, report = tmp_path / "run.log", tmp_path / "report.txt"
    agent_log = tmp_path / "agent.log"
    agent = start_agent(fc_env, log=agent_log)
    try:
        t = _train(fc_env, log, "--persist-every", "5m", "--step-sleep", "0.05")
        st = Storage(fc_env.storage)
        wait_until(lambda: st.committed_steps() != [], "the first commit", timeout=120.0)
        wait_until(lambda: _newest_slot(fc_env) >= 12, "snapshots in memory", timeout=120.0)
        t.send_signal(signal.SIGSTOP)
        wait_until(
            lambda: _status(fc_env)["ranks"]["0"]["slots"].count(None) == 0,
            "2 slots",
            timeout=120.0,
        )
        newest = _newest_slot(fc_env)
        committed = st.committed_steps()
        # Storage fails: its root becomes a file (every write under it fails).
        root = fc_env.storage_path
        root.rename(tmp_path / "ckpt-away")
        root.write_text("not a directory")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=120) == EXIT_KEPT
        t.send_signal(signal.SIGKILL)
        t.wait(timeout=30)
        text = agent_log.read_text()
        assert "kept 2 snapshot segment(s)" in text and fc_env.shm_dir in text, text[-3000:]
        assert len(_slot_files(fc_env)) == 2
        root.unlink()
        (tmp_path / "ckpt-away").rename(root)
        assert st.committed_steps() == committed
        # The rerun (its own auto-started agent adopts the kept slots) resumes from memory.
        finish_tinytrain(_train(fc_env, log, "--report", str(report)), log, 240)
        assert report.read_text().split() == [str(newest), "memory"]
    finally:
        kill_job_processes(fc_env.job)
    final = safetensors.torch.load_file(str(log) + ".final.safetensors")
    for k in final:
        assert torch.equal(final[k], ref_final[k]), k
