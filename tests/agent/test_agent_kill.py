"""Real processes, real SIGKILL of the node agent under a running trainer (issue 12, finding 1):
the trainer goes on, starts or finds the next agent, and every run ends with exit 0, bitwise
equal to an uninterrupted one, with its last step committed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import safetensors.torch
import torch
from fchelpers import FcEnv, finish_tinytrain, start_tinytrain
from tinytrain import assert_same_run, logged_losses
from waiting import wait_until

from flashckpt.format.storage import Storage
from flashckpt.protocol.channel import AgentClient, AgentError, socket_path

pytestmark = pytest.mark.slow

STEPS, WIDTH, EVERY, SLEEP = 160, 50_000, 3, 0.03  # ~12 MB of state: a persist takes a while


def _env(base: FcEnv, tmp_path: Path, name: str) -> FcEnv:
    return FcEnv(
        job=f"{base.job}{name}",
        node=base.node,
        run_dir=base.run_dir,
        storage=f"file://{tmp_path}/{name}",
        storage_path=tmp_path / name,
        shm_dir=base.shm_dir,
    )


def _worker(env: FcEnv, log: Path, sleep: float = SLEEP) -> subprocess.Popen:
    return start_tinytrain(
        env,
        log,
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY),
        "--width",
        str(WIDTH),
        "--step-sleep",
        str(sleep),
        "--report",
        str(log) + ".report.start",
        "--final-report",
        str(log) + ".report",
        "--quiet",
    )


def _reference(tmp_path: Path, base: FcEnv) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    env = _env(base, tmp_path, "ref")
    log = tmp_path / "ref.log"
    finish_tinytrain(_worker(env, log, sleep=0.0), log)
    ref = dict(logged_losses(log))
    assert sorted(ref) == list(range(STEPS))
    return ref, safetensors.torch.load_file(str(log) + ".final.safetensors")


def _agent_pid(env: FcEnv) -> int | None:
    """The pid of the job's live agent, from its owner file in shared memory."""
    try:
        with open(os.path.join(env.shm_dir, f"fc.{env.job}.{env.node}.owner")) as f:
            owner = json.load(f)
        proc = psutil.Process(int(owner["pid"]))
        if abs(proc.create_time() - float(owner["create_time"])) < 1.0 and proc.status() not in (
            psutil.STATUS_ZOMBIE,
            psutil.STATUS_DEAD,
        ):
            return proc.pid
    except (OSError, ValueError, KeyError, psutil.Error):
        pass
    return None


def _wait(cond, p: subprocess.Popen, seconds: float = 120) -> bool:
    """Waits for ``cond()`` while the trainer runs; False if the trainer exited first."""
    met = wait_until(
        lambda: "met" if cond() else ("exited" if p.poll() is not None else None),
        "the condition, or the trainer's exit",
        seconds,
        0.001,
    )
    return met == "met"


def _partial_step(st: Storage) -> bool:
    try:
        done = set(st.committed_steps())
        return any(d not in done for d in st.all_step_dirs())
    except OSError:
        return False


def _linked(env: FcEnv, pid: int) -> bool:
    """Whether the agent ``pid`` answers and the trainer (local rank 0) is connected to it."""
    try:
        c = AgentClient(socket_path(env.run_dir, env.job, env.node), timeout=0.0)
    except (AgentError, OSError):
        return False
    try:
        st = c.request("status", timeout=10)
        return int(st["pid"]) == pid and bool(st["ranks"].get("0", {}).get("connected"))
    except AgentError:
        return False
    finally:
        c.close()


@pytest.mark.timeout(1500)
def test_agent_sigkilled_at_random_instants_costs_the_trainer_nothing(
    tmp_path: Path, fc_env_private: FcEnv
) -> None:
    base = fc_env_private
    ref, ref_final = _reference(tmp_path, base)
    rng = random.Random(20261201)
    kills = mid_persist = 0
    for run in range(10):
        if kills >= 20:
            break
        env = _env(base, tmp_path, f"k{run}")
        st = Storage(env.storage)
        log = tmp_path / f"k{run}.log"
        p = _worker(env, log)
        last, run_kills = None, 0
        while kills < 20:
            # The current agent: the first one, or the one the trainer started after a kill.
            if not _wait(lambda env=env, last=last: _agent_pid(env) not in (None, last), p):
                break
            pid = _agent_pid(env)
            assert pid is not None
            if not _wait(lambda env=env, pid=pid: _linked(env, pid), p):
                break
            n0 = len(logged_losses(log))
            if not _wait(lambda log=log, n0=n0: len(logged_losses(log)) >= n0 + 2, p):
                break
            if kills % 2 == 0:
                # Mid-persist: a step directory without its manifest is being written.
                if not _wait(lambda st=st: _partial_step(st), p, seconds=60):
                    break
                mid_persist += 1
            else:
                time.sleep(rng.uniform(0.0, 0.5))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            kills += 1
            run_kills += 1
            last = pid
        finish_tinytrain(p, log)
        assert_same_run(log, ref, ref_final, STEPS)
        start, source, restarts, _skips, committed = Path(str(log) + ".report").read_text().split()
        assert (start, source) == ("0", "None")
        # One new agent per kill (the last kill may come as the trainer leaves).
        assert run_kills - 1 <= int(restarts) <= run_kills, (restarts, run_kills)
        # The last snapshot reached storage, through whichever agent was alive at the end.
        assert int(committed) == STEPS
        assert st.committed_steps()[-1] == STEPS
        assert all(st.verify(s) == [] for s in st.committed_steps())
    assert kills >= 20 and mid_persist >= 5, (kills, mid_persist)


@pytest.mark.timeout(900)
def test_trainer_killed_right_after_its_agent_restarted_resumes_equal(
    tmp_path: Path, fc_env_private: FcEnv
) -> None:
    base = fc_env_private
    ref, ref_final = _reference(tmp_path, base)
    env = _env(base, tmp_path, "tk")
    log = tmp_path / "tk.log"
    p = _worker(env, log)
    assert _wait(lambda: _agent_pid(env) is not None and len(logged_losses(log)) >= 10, p)
    first = _agent_pid(env)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    # The trainer starts the next agent and links to it; then the trainer dies.
    assert _wait(lambda: _agent_pid(env) not in (None, first), p)
    second = _agent_pid(env)
    assert second is not None
    assert _wait(lambda: _linked(env, second), p)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert len(logged_losses(log)) < STEPS, "the trainer finished before it could be killed"
    p = _worker(env, log)
    # The new trainer did not start this agent (the dead one did): when it dies too, the
    # trainer still starts the next one (an agent started by a trainer is any trainer's).
    assert _wait(lambda: _linked(env, second), p)
    os.kill(second, signal.SIGKILL)
    assert _wait(lambda: _agent_pid(env) not in (None, second), p)
    finish_tinytrain(p, log)
    assert_same_run(log, ref, ref_final, STEPS)
    start, source = Path(str(log) + ".report.start").read_text().splitlines()[-1].split()
    assert int(start) > 0 and source in ("memory", "storage"), (start, source)
    st = Storage(env.storage)
    assert st.committed_steps()[-1] == STEPS
    restarts = Path(str(log) + ".report").read_text().splitlines()[-1].split()[2]
    assert restarts == "1", restarts
