"""A long-lived node agent (the DaemonSet's, the systemd unit's: ``flashckpt agent
--free-finished``, which never exits for lack of trainers) frees a finished job's snapshot slots
once storage holds its newest step, and says so (issue 44): the host memory the slots held is
returned when the job ends, not when someone deletes the agent."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from agentproc import start_agent
from fchelpers import FcEnv, kill_job_processes, tinytrain_command

from flashckpt.format.storage import Storage


def _slot_bytes(env: FcEnv) -> int:
    """Bytes of the job's snapshot slots in its shared-memory directory."""
    total = 0
    for name in os.listdir(env.shm_dir):
        if name.startswith(f"fc.{env.job}.") and ".s" in name[-3:]:
            try:
                total += os.stat(os.path.join(env.shm_dir, name)).st_blocks * 512
            except FileNotFoundError:
                pass  # freed between the listing and the stat
    return total


def test_a_daemon_agent_frees_the_slots_of_a_finished_job(fc_env: FcEnv, tmp_path: Path) -> None:
    env = fc_env
    log = tmp_path / "agent.log"
    agent = start_agent(env, "--free-finished", "--log-file", str(log), idle_timeout=600)
    try:
        train_log = tmp_path / "train.log"
        cmd = tinytrain_command(env, train_log, "--steps", "12", "--every", "3", "--quiet")
        with open(str(train_log) + ".err", "ab") as err:
            trainer = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        # The slots hold memory while the job runs (seen at least once before it ends).
        held = 0
        while trainer.poll() is None:
            held = max(held, _slot_bytes(env))
            time.sleep(0.01)
        assert trainer.returncode == 0, Path(str(train_log) + ".err").read_text()[-3000:]
        held = max(held, _slot_bytes(env))
        # The agent ends by itself: the job finished and storage holds its newest step.
        assert agent.wait(timeout=120) == 0, agent.log_tail()
    finally:
        agent.kill9()
        kill_job_processes(env.job)
    assert held > 0, "the job's slots never held memory"
    assert _slot_bytes(env) == 0, "the finished job's slots still hold memory"
    assert Storage(env.storage).committed_steps()[-1] == 12
    text = log.read_text()
    assert (
        "the job finished and storage holds its newest step (12): freeing its snapshot slots"
        in text
    ), text[-2000:]
