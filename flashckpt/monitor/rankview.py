"""The node agent's view of its local ranks: the reader of a trainer's step ring (the format is
:mod:`flashckpt.monitor.ring`) and the per-rank state the monitor and its alerts share.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import psutil

from flashckpt.monitor.goodput import Incarnation
from flashckpt.monitor.ring import (
    COUNT,
    COUNT_OFF,
    ENTERING,
    FIXED,
    FLAG_LOCK,
    HEADER_SIZE,
    INFO,
    INFO_OFF,
    MAGIC,
    PHASE,
    PHASE_OFF,
    PIDNS,
    PIDNS_OFF,
    REC,
    REC_SIZE,
    STACKS_LEN,
    STACKS_OFF,
    TOKEN,
    TOKEN_OFF,
    VERSION,
    lock_held,
    pid_namespace,
)

__all__ = ["Batch", "RankState", "RingReader", "quantile"]

log = logging.getLogger("flashckpt.monitor.step_monitor")

_OWN_PID_NS = pid_namespace()
"""This (the agent's) process's PID namespace: a ring written from another one carries a pid
that means nothing here."""


class RingReader:
    """The agent's read-only view of one ring file (see :mod:`flashckpt.monitor.ring`).

    Liveness (:meth:`alive`): by the writer's lock on the ring file where the ring says it holds
    one (any PID namespace), else by its pid and start time (an earlier writer). Signals
    (:meth:`signal_refusal`): only to a writer in this process's PID namespace.
    """

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if st.st_size < HEADER_SIZE:
                raise ValueError(f"{path}: too small for a monitor ring")
            self.mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        self.path = path
        self.ino = st.st_ino
        magic, version, rec_size, cap, rank, world, pid, flags = FIXED.unpack_from(self.mm, 0)
        if magic != MAGIC or version != VERSION or rec_size != REC_SIZE:
            self.mm.close()
            os.close(fd)
            raise ValueError(f"{path} is not a version-{VERSION} flashckpt monitor ring")
        if cap <= 0 or HEADER_SIZE + cap * rec_size > st.st_size:
            self.mm.close()
            os.close(fd)
            raise ValueError(f"{path}: capacity {cap} exceeds the file size")
        self.cap, self.rank, self.world, self.pid, self.flags = cap, rank, world, pid, flags
        self.pid_ns = int(PIDNS.unpack_from(self.mm, PIDNS_OFF)[0])
        """The writer's PID namespace (its inode); 0: not recorded (an earlier writer)."""
        # A read-only descriptor to ask about the writer's lock (never to take one).
        self._fd: int | None = fd if flags & FLAG_LOCK else None
        if self._fd is None:
            os.close(fd)
        self._lock_error_logged = False
        self.token = f"{TOKEN.unpack_from(self.mm, TOKEN_OFF)[0]:016x}"
        raw = bytes(self.mm[STACKS_OFF : STACKS_OFF + STACKS_LEN]).split(b"\0", 1)[0]
        self.stacks_path = raw.decode(errors="replace") or None
        self.read_idx = 0
        self._proc: psutil.Process | None = None

    def phase(self) -> int:
        return int(PHASE.unpack_from(self.mm, PHASE_OFF)[0])

    def info(self) -> dict[str, Any]:
        f = INFO.unpack_from(self.mm, INFO_OFF)
        return {
            "proc_start": f[0],
            "enter": f[1],
            "ready": f[2] or None,
            "ready_mono": f[3] or None,
            "exit": f[4] or None,
            "resume_step": f[5],
            "exit_code": f[6],
            "restored_from": f[7].split(b"\0", 1)[0].decode(errors="replace") or None,
        }

    def count(self) -> int:
        return int(COUNT.unpack_from(self.mm, COUNT_OFF)[0])

    def read_new(self) -> tuple[list[tuple[Any, ...]], int]:
        """Records published since the last call, and how many were overwritten unread."""
        c1 = self.count()
        if c1 < self.read_idx:  # cannot happen with one writer; resynchronise
            self.read_idx = c1
        start = max(self.read_idx, c1 - self.cap)
        recs = [
            REC.unpack_from(self.mm, HEADER_SIZE + (i % self.cap) * REC_SIZE)
            for i in range(start, c1)
        ]
        c2 = self.count()
        # The writer fills record i + cap (the same place as i) once it has published i + cap
        # records: a record read while that may have happened is dropped.
        first_valid = max(start, c2 - self.cap + 1)
        drop = first_valid - start
        lost = start - self.read_idx + drop
        self.read_idx = c1
        return recs[drop:], lost

    @property
    def other_pid_ns(self) -> bool:
        """The writer runs in another PID namespace than this process (or either namespace is
        unknown while the ring records one): its pid cannot be checked or signalled from here."""
        return self.pid_ns != 0 and self.pid_ns != _OWN_PID_NS

    def alive(self, proc_start: float) -> bool:
        """Whether the writing process still runs: its lock on the ring file is held (any PID
        namespace; released when it exits or is killed), or, for a ring without the lock, its
        pid runs and was created at ``proc_start`` (not reused by another process)."""
        if self._fd is not None:
            try:
                return lock_held(self._fd)
            except OSError as e:
                if not self._lock_error_logged:
                    self._lock_error_logged = True
                    log.warning(
                        "monitor: cannot ask for the lock on %s (%s): rank %d is judged by its "
                        "pid%s",
                        self.path,
                        e,
                        self.rank,
                        ", which is another PID namespace's: it counts as running"
                        if self.other_pid_ns
                        else "",
                    )
                if self.other_pid_ns:
                    return True  # its end is seen when it writes EXITED
        return self._pid_alive(proc_start)

    def _pid_alive(self, proc_start: float) -> bool:
        try:
            if self._proc is None:
                p = psutil.Process(self.pid)
                if abs(p.create_time() - proc_start) > 1.0:
                    return False
                self._proc = p
            return self._proc.is_running() and self._proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def signal_refusal(self, proc_start: float) -> str | None:
        """Why the writer's pid must not be signalled from here (None: it may be): another PID
        namespace, or the pid is no longer the writer's."""
        if self.other_pid_ns:
            return (
                f"it runs in another PID namespace than this agent (pid {self.pid} there; "
                f"namespace pid:[{self.pid_ns}], the agent's "
                f"{f'pid:[{_OWN_PID_NS}]' if _OWN_PID_NS else 'unknown'}), where its pid means "
                "nothing here; run the agent in its trainers' PID namespace (the host's, or a "
                "pod with shareProcessNamespace) for hang kills and stack dumps"
            )
        if not self._pid_alive(proc_start):
            return f"pid {self.pid} is no longer the trainer that wrote {self.path}"
        return None

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass(slots=True)
class Batch:
    """Iterations read since the last ``steps`` line of a rank."""

    n: int = 0
    first: int | None = None
    last: int | None = None
    t1: float = 0.0
    step_s: float = 0.0
    ckpt_s: float = 0.0
    recomputed_s: float = 0.0
    recomputed_n: int = 0
    snapshots: int = 0
    lost: int = 0
    step_ms: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RankState:
    """What the monitor knows of one local rank: its ring, its current incarnation, its recent
    iterations and its active alerts."""

    rank: int
    ring: RingReader | None = None
    inc: Incarnation | None = None
    info: dict[str, Any] = field(default_factory=dict)
    started: bool = False
    ended: bool = True
    phase: int = ENTERING
    window: deque[tuple[Any, ...]] = field(default_factory=deque)
    batch: Batch = field(default_factory=Batch)
    high_water: int = -1
    last_step: int | None = None
    last_progress_mono: float = 0.0
    steps_total: int = 0
    ckpt_total_s: float = 0.0
    lost_total: int = 0
    incarnations: int = 0
    hang: dict[str, Any] | None = None
    kill_at: float | None = None
    killed: bool = False
    straggler: dict[str, Any] | None = None
    end_reason: str | None = None

    @property
    def steps_done(self) -> int | None:
        """Steps completed (``ckpt.steps_done``, as every step flashckpt prints or records for
        a person): ``last_step`` is the 0-based index of the newest iteration in the ring."""
        return None if self.last_step is None else self.last_step + 1


def quantile(sorted_xs: list[float], q: float) -> float | None:
    """The ``q`` quantile of sorted values (nearest rank); None for no values."""
    if not sorted_xs:
        return None
    i = min(len(sorted_xs) - 1, max(0, round(q * (len(sorted_xs) - 1))))
    return float(sorted_xs[i])
