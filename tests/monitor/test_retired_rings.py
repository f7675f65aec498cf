"""A rank's next process keeps the previous process's step ring for the node agent (issue 41,
row 7): iterations the agent had not read when the rank restarted (the agent was down, or had
not polled since) are counted by the agent that reads next, then the kept ring is removed."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from flashckpt.monitor.goodput import compute_goodput, incarnations_from_events, read_events
from flashckpt.monitor.ring import RETIRED_KEEP, StepRecorder, ring_path
from flashckpt.monitor.step_monitor import AgentMonitor, MonitorConfig


class _Trainer:
    """A forked trainer process of rank 0: runs iterations when told, until killed."""

    def __init__(self, path: str, first_step: int) -> None:
        ctl_r, self._ctl = os.pipe()
        self._ack, ack_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                rec = StepRecorder(path, rank=0, world=1, enter_wall=time.time())
                rec.ready(resume_step=first_step, restored_from=None)
                os.write(ack_w, b"r")
                step = first_step
                while True:
                    for _ in range(os.read(ctl_r, 1)[0]):
                        rec.step(step)
                        step += 1
                    os.write(ack_w, b"x")
            finally:
                os._exit(1)
        os.close(ctl_r)
        os.close(ack_w)
        self.pid = pid
        assert os.read(self._ack, 1) == b"r"  # its ring is in place

    def run(self, n: int) -> None:
        os.write(self._ctl, bytes([n]))
        assert os.read(self._ack, 1) == b"x"

    def kill(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            os.close(self._ctl)
            os.close(self._ack)
            self.pid = 0


def _monitor(shm: Path, run: Path) -> AgentMonitor:
    return AgentMonitor(
        job="j", node="n", shm_dir=str(shm), run_dir=str(run), config=MonitorConfig()
    )


def test_iterations_of_a_ring_replaced_before_the_agent_read_them_are_counted(
    tmp_path: Path,
) -> None:
    shm, run = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    run.mkdir()
    path = ring_path(str(shm), "j", "n", 0)
    trainers: list[_Trainer] = []
    second: AgentMonitor | None = None
    try:
        # Process 1 runs 3 iterations; the agent reads them, then dies (no final read).
        trainers.append(p1 := _Trainer(path, 0))
        p1.run(3)
        first = _monitor(shm, run)
        first.start()
        first.poll()
        assert first.summary()["ranks"]["0"]["steps"] == 3
        first._stop.set()
        assert first._thread is not None and first._events is not None
        first._thread.join(timeout=30)
        first._events.close()
        first._events = None  # its events file stays as the killed agent left it
        # While no agent runs: process 1 runs 2 more iterations nobody reads and is killed;
        # process 2 (resumed at step 3: 2 recomputed) replaces its ring, runs 4 and is killed;
        # process 3 replaces that one and runs 1. No agent ever saw process 2.
        p1.run(2)
        p1.kill()
        trainers.append(p2 := _Trainer(path, 3))
        p2.run(4)
        p2.kill()
        trainers.append(p3 := _Trainer(path, 7))
        p3.run(1)
        assert len(list(shm.glob("*.mon.*"))) == 2  # both kept for the agent

        second = _monitor(shm, run)
        second.start()
        second.poll()
        rank = second.summary()["ranks"]["0"]
        # Its view: process 3 runs, at iteration 7; it read 2 + 4 + 1 iterations itself.
        assert (rank["pid"], rank["state"], rank["step"], rank["steps"]) == (
            p3.pid,
            "running",
            7,
            7,
        ), rank
        assert list(shm.glob("*.mon.*")) == []  # read to their ends, reported, removed
        # The agent watches process 3 when it is killed and replaced (process 4): the ring
        # it reads is kept too, read to its end and removed.
        p3.run(2)
        p3.kill()
        trainers.append(p4 := _Trainer(path, 10))
        p4.run(2)
        second.poll()
        assert list(shm.glob("*.mon.*")) == []
        rank = second.summary()["ranks"]["0"]
        assert (rank["pid"], rank["state"], rank["step"], rank["steps"]) == (
            p4.pid,
            "running",
            11,
            11,
        ), rank
    finally:
        for t in trainers:
            t.kill()
        if second is not None:
            second.close()
    events = read_events([second.events_path])
    incs = incarnations_from_events(events)[0]
    got = [(i.n, i.recomputed_n, i.end_reason) for i in incs]
    assert got == [(5, 0, "died"), (4, 2, "died"), (3, 0, "died"), (2, 0, "died")], got
    assert compute_goodput({0: incs}).steps == {0: 14}
    ends = [e["last_step"] for e in events if e["event"] == "end"]
    assert ends == [5, 7, 10, 12], ends


def test_rings_no_agent_reads_are_kept_up_to_a_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = ring_path(str(tmp_path), "j", "n", 3)
    caplog.set_level(logging.WARNING, logger="flashckpt.monitor.step_monitor")
    for n in range(RETIRED_KEEP + 3):
        rec = StepRecorder(path, rank=3, world=4, enter_wall=time.time())
        rec.ready(resume_step=n, restored_from=None)
        rec.step(n)
        rec.close()
    kept = sorted(tmp_path.glob("*.r00003.mon.*"))
    assert len(kept) == RETIRED_KEEP, kept
    removed = [r for r in caplog.records if "that no node agent read" in r.getMessage()]
    assert len(removed) == 2, [r.getMessage() for r in caplog.records]
    assert {p.name for p in tmp_path.iterdir()} == {Path(path).name, *(p.name for p in kept)}
