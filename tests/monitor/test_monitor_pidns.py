"""The step monitor's view of a trainer's liveness: the lock the trainer holds on its ring file,
not its pid, so a trainer in another PID namespace (a node agent DaemonSet and its trainer pods)
is seen running, exiting and dying as it does, and is never signalled by a pid that is not its.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from waiting import wait_until

from flashckpt.monitor.goodput import read_events
from flashckpt.monitor.rankview import RingReader
from flashckpt.monitor.ring import FIXED, FLAG_LOCK, StepRecorder, ring_path
from flashckpt.monitor.step_monitor import AgentMonitor, MonitorConfig

# One rank in a PID namespace of its own (it is pid 1 there): steps, waits at a gate, exits.
_RANK = r"""
import os, sys, time
from pathlib import Path
from flashckpt.monitor.ring import StepRecorder, ring_path
shm, run, rank, gate = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
assert os.getpid() == 1, os.getpid()
rec = StepRecorder(ring_path(shm, "j", "n", rank), rank=rank, world=2, enter_wall=time.time(),
                   stacks_path=os.path.join(run, f"r{rank}.stacks.log"))
rec.ready(resume_step=0, restored_from=None)
for s in range(5):
    rec.step(s)
Path(f"{gate}.at{rank}").touch()
while not gate.exists():
    time.sleep(0.02)
rec.finishing()
rec.close(exit_code=0)
"""


def _pidns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "a PID namespace of its own needs root here (unshare --pid)"
    if shutil.which("unshare") is None:
        return "'unshare' is not installed (apt-get install util-linux)"
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "true"], capture_output=True
    )
    if done.returncode != 0:
        return f"cannot create PID namespaces: {done.stderr.decode().strip()}"
    return None


def _pid1(unshare: subprocess.Popen[bytes]) -> int | None:
    """The host pid of the namespace's pid 1 (the rank)."""
    try:
        children = psutil.Process(unshare.pid).children()
    except psutil.Error:
        return None
    return children[0].pid if children else None


@pytest.fixture
def namespaced() -> Iterator[list[subprocess.Popen[bytes]]]:
    why = _pidns_unavailable()
    if why:
        pytest.skip(why)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            pid = _pid1(p)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)  # pid 1: the kernel ends its namespace with it
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


@pytest.mark.slow
def test_a_trainer_in_another_pid_namespace_is_followed_by_its_lock_and_never_signalled(
    tmp_path: Path, namespaced: list[subprocess.Popen[bytes]]
) -> None:
    shm, run = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    run.mkdir()
    gate = tmp_path / "gate"
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    # Under an elastic launcher and with kills on: a hang kill is due for each rank.
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "pidns"}
    cfg = MonitorConfig(
        poll_s=0.05, hang_floor_s=1.0, hang_factor=5.0, hang_dump_wait_s=0.2, hang_kill="on"
    )
    mon = AgentMonitor(job="j", node="n", shm_dir=str(shm), run_dir=str(run), config=cfg)
    mon.start()
    try:
        for rank in (0, 1):
            argv = ["unshare", "--pid", "--fork", "--mount", "--mount-proc"]
            argv += [sys.executable, str(script), str(shm), str(run), str(rank), str(gate)]
            namespaced.append(subprocess.Popen(argv, env=env, cwd=str(tmp_path)))

        def states() -> dict[str, str]:
            return {r: v["state"] for r, v in mon.summary()["ranks"].items()}

        def refused() -> list[dict]:
            evs = read_events([mon.events_path])
            return [e for e in evs if e["event"] == "hang_kill_refused"]

        # Both wait at the gate; both are hung (not dead), and their kills are refused.
        wait_until(lambda: len(refused()) == 2, "both hang kills refused", timeout=60)
        assert states() == {"0": "hung", "1": "hung"}
        assert all("another PID namespace" in e["why"] for e in refused())
        assert [p.poll() for p in namespaced] == [None, None]

        pid1 = _pid1(namespaced[1])
        assert pid1 is not None
        os.kill(pid1, signal.SIGKILL)  # rank 1, kill -9 from outside its namespace
        wait_until(lambda: states()["1"] == "died", "rank 1 reported died", timeout=30)
        assert states()["0"] == "hung"

        gate.touch()  # rank 0 runs to its end
        assert namespaced[0].wait(timeout=60) == 0
        wait_until(lambda: states()["0"] == "exit", "rank 0 reported exited", timeout=30)
    finally:
        mon.close()
    events = read_events([mon.events_path])
    ends = {e["rank"]: e["reason"] for e in events if e["event"] == "end"}
    assert ends == {0: "exit", 1: "died"}
    starts = [e for e in events if e["event"] == "start"]
    assert [e["other_pid_ns"] for e in starts] == [True, True]
    assert {e["pid"] for e in starts} == {1}  # the pid each wrote: its own namespace's
    assert not [e for e in events if e["event"] in ("hang_kill", "stacks")]


def test_the_lock_lives_with_the_writer_not_its_forked_children(tmp_path: Path) -> None:
    """Same namespace: the lock says alive until close(); a forked child (a data loader worker)
    does not keep it held; a ring without the lock (an earlier writer) is judged by its pid."""
    path = str(tmp_path / "fc.j.n.r00000.mon")
    rec = StepRecorder(path, rank=0, world=1, enter_wall=time.time())
    ring = RingReader(path)
    start = ring.info()["proc_start"]
    assert ring.flags & FLAG_LOCK and not ring.other_pid_ns
    assert ring.alive(start)
    assert ring.signal_refusal(start) is None  # this process's own pid: it may be signalled
    r, w = os.pipe()
    r2, w2 = os.pipe()
    child = os.fork()
    if child == 0:  # forked (its at-fork handlers ran): holds on until the parent says
        os.write(w2, b"x")
        os.read(r, 1)
        os._exit(0)
    try:
        assert os.read(r2, 1) == b"x"
        rec.close(exit_code=0)
        assert not ring.alive(start)  # the child still runs, but holds no lock
    finally:
        os.write(w, b"x")
        os.waitpid(child, 0)
        for fd in (r, w, r2, w2):
            os.close(fd)
    ring.close()

    # An earlier writer's ring: no lock flag; judged by pid (this process: alive).
    rec = StepRecorder(path, rank=0, world=1, enter_wall=time.time())
    with open(path, "r+b") as f:
        fixed = list(FIXED.unpack(f.read(FIXED.size)))
        fixed[7] &= ~FLAG_LOCK
        f.seek(0)
        f.write(FIXED.pack(*fixed))
    ring = RingReader(path)
    try:
        assert not ring.flags & FLAG_LOCK
        rec.close(exit_code=0)
        assert ring.alive(ring.info()["proc_start"])  # by pid: this process runs
    finally:
        ring.close()


def test_a_trainer_that_died_between_two_agents_is_reported_by_the_second(tmp_path: Path) -> None:
    """The agent watching a trainer is killed, then the trainer dies (kill -9) before a new
    agent looks: the new agent finds its ring unlocked and reports the death the first one
    could not (before, no ``end`` event was ever written for it)."""
    shm, run = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    run.mkdir()
    path = ring_path(str(shm), "j", "n", 0)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # the trainer: 3 steps, then waits to be killed
        try:
            rec = StepRecorder(path, rank=0, world=1, enter_wall=time.time())
            rec.ready(resume_step=0, restored_from=None)
            for s in range(3):
                rec.step(s)
            os.write(w, b"x")
            time.sleep(600)
        finally:
            os._exit(1)
    try:
        assert os.read(r, 1) == b"x"
        first = AgentMonitor(
            job="j", node="n", shm_dir=str(shm), run_dir=str(run), config=MonitorConfig()
        )
        first.start()
        first.poll()
        assert first.summary()["ranks"]["0"]["state"] == "running"
        first._stop.set()  # the agent is gone (its events file stays as it was)
        assert first._thread is not None
        first._thread.join(timeout=30)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(r)
        os.close(w)
    second = AgentMonitor(
        job="j", node="n", shm_dir=str(shm), run_dir=str(run), config=MonitorConfig()
    )
    second.start()
    try:
        second.poll()
        assert second.summary()["ranks"]["0"]["state"] == "died"
    finally:
        second.close()
        first._events.close()
    ends = [e for e in read_events([second.events_path]) if e["event"] == "end"]
    assert [(e["reason"], e["last_step"]) for e in ends] == [("died", 3)]


def test_a_trainer_over_before_the_agents_first_look_is_reported(tmp_path: Path) -> None:
    """A trainer that starts after its agent and ends before the agent's first poll (1 s when
    idle: a short run, one killed at once) is the agent's to report: its ring's lock is gone by
    then, however it ended. Before, the first scan took every unlocked ring for one a previous
    agent had reported: state ``died`` and no event at all, for a trainer that exited cleanly
    too (the full suite's ``test_steps_batches_count_steps_completed`` after a warm-up). One that
    ended before the agent started and that no events line knows is reported too: no agent did
    (its own died before its start line, or none ran), and its iterations ran (issue 41)."""
    shm, run = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    run.mkdir()
    # Rank 2: ended before the agent started, unknown to the events: nobody reported it.
    old = StepRecorder(
        ring_path(str(shm), "j", "n", 2), rank=2, world=3, enter_wall=time.time() - 1
    )
    old.ready(resume_step=0, restored_from=None)
    old.step(0)
    old.close(exit_code=0)
    mon = AgentMonitor(
        job="j", node="n", shm_dir=str(shm), run_dir=str(run), config=MonitorConfig()
    )
    # Rank 0 exits cleanly (this process), rank 1 dies (a forked child, no close): both before
    # the agent's first poll.
    rec = StepRecorder(ring_path(str(shm), "j", "n", 0), rank=0, world=3, enter_wall=time.time())
    rec.ready(resume_step=0, restored_from=None)
    for s in range(3):
        rec.step(s)
    rec.finishing()
    rec.close(exit_code=0)
    child = os.fork()
    if child == 0:
        try:
            dying = StepRecorder(
                ring_path(str(shm), "j", "n", 1), rank=1, world=3, enter_wall=time.time()
            )
            dying.ready(resume_step=0, restored_from=None)
            for s in range(2):
                dying.step(s)
        finally:
            os._exit(0)  # no close: the ring stays RUNNING, the lock goes with the process
    os.waitpid(child, 0)
    mon.start()
    try:
        mon.poll()
        ranks = mon.summary()["ranks"]
        got = {r: (v["state"], v["steps"]) for r, v in ranks.items()}
        assert got == {"0": ("exit", 3), "1": ("died", 2), "2": ("exit", 1)}, got
    finally:
        mon.close()
    events = read_events([mon.events_path])
    ends = [(e["rank"], e["reason"], e["last_step"]) for e in events if e["event"] == "end"]
    assert sorted(ends) == [(0, "exit", 3), (1, "died", 2), (2, "exit", 1)]
    assert sorted(e["rank"] for e in events if e["event"] == "start") == [0, 1, 2]
    steps = {
        r: sum(e["n"] for e in events if e["event"] == "steps" and e["rank"] == r)
        for r in (0, 1, 2)
    }
    assert steps == {0: 3, 1: 2, 2: 1}
