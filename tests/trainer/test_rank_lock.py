"""The rank lock is not kept by a dead trainer's children (issue 41).

A forked child (a data loader worker) closes its copy of the lock at once, so a restart of the
rank is not refused while the worker outlives the trainer. Children that hold the lock without
Python's fork hooks (here: the descriptor passed at exec) are waited for while the process the
lock file names is dead, then refused, naming them."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import threading
from pathlib import Path

import pytest

from flashckpt import names
from flashckpt.monitor.ring import pid_namespace
from flashckpt.trainer.checkpointer import _RankLock


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _orphan_holding(path: str) -> subprocess.Popen[bytes]:
    """A process holding the lock's open file description (passed at exec, so no fork hook of
    Python's closed it), the lock file naming a dead process of this PID namespace: what a
    SIGKILLed trainer leaves when a child it forked outside Python outlives it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, f"{_dead_pid()} {pid_namespace()}\n".encode(), 0)
        return subprocess.Popen(
            ["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=[fd]
        )
    finally:
        os.close(fd)


class _Seen(logging.Handler):
    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text, self.event, self.messages = text, threading.Event(), []  # type: list[str]

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if self.text in self.messages[-1]:
            self.event.set()


def test_a_forked_child_does_not_keep_the_rank_lock(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    lock = _RankLock.take(run_dir, "j", "n", 0)
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a loader worker that outlives its trainer: blocked until the pipe closes
        os.close(w)
        os.write(ready_w, b"x")  # its code runs: the fork hooks have run
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"x"
        lock.release()  # the trainer is gone; its child lives on
        again = _RankLock.take(run_dir, "j", "n", 0, orphan_wait_s=0)
        again.release()
    finally:
        os.close(ready_r)
        os.close(w)
        os.waitpid(pid, 0)


def test_a_dead_trainers_leftover_holders_are_waited_for_then_named(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir, mode=0o700)
    path = names.rank_lock_path(run_dir, "j", "n", 1)
    orphan = _orphan_holding(path)
    seen = _Seen("waiting up to")
    logging.getLogger("flashckpt").addHandler(seen)
    try:
        with pytest.raises(RuntimeError) as err:
            _RankLock.take(run_dir, "j", "n", 1, orphan_wait_s=0.2)
        text = str(err.value)
        assert "its previous process" in text and "is dead" in text, text
        assert f"End them (kill {orphan.pid})" in text, text
        # Waited for: the rank enters once the leftover exits.
        got: list[object] = []
        seen.event.clear()
        t = threading.Thread(target=lambda: got.append(_RankLock.take(run_dir, "j", "n", 1)))
        t.start()
        assert seen.event.wait(60), seen.messages
        assert f"left behind ({orphan.pid})" in seen.messages[-1], seen.messages
        assert orphan.stdin is not None
        orphan.stdin.close()
        assert orphan.wait(timeout=60) == 0
        t.join(timeout=60)
        assert len(got) == 1 and isinstance(got[0], _RankLock), got
        assert Path(path).read_text().split()[0] == str(os.getpid())
        got[0].release()
    finally:
        logging.getLogger("flashckpt").removeHandler(seen)
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
