"""The node agent's view of its local ranks: the reader of a trainer's step ring (the format is
:mod:`flashckpt.monitor.ring`) and the per-rank state the monitor and its alerts share.
"""

from __future__ import annotations

import contextlib
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
    HEADER_SIZE,
    INFO,
    INFO_OFF,
    MAGIC,
    PHASE,
    PHASE_OFF,
    REC,
    REC_SIZE,
    STACKS_LEN,
    STACKS_OFF,
    TOKEN,
    TOKEN_OFF,
    VERSION,
)

__all__ = ["Batch", "RankState", "RingReader", "quantile"]


class RingReader:
    """The agent's read-only view of one ring file (see :mod:`flashckpt.monitor.ring`)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if st.st_size < HEADER_SIZE:
                raise ValueError(f"{path}: too small for a monitor ring")
            self.mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.path = path
        self.ino = st.st_ino
        magic, version, rec_size, cap, rank, world, pid, flags = FIXED.unpack_from(self.mm, 0)
        if magic != MAGIC or version != VERSION or rec_size != REC_SIZE:
            self.mm.close()
            raise ValueError(f"{path} is not a version-{VERSION} flashckpt monitor ring")
        if cap <= 0 or HEADER_SIZE + cap * rec_size > st.st_size:
            self.mm.close()
            raise ValueError(f"{path}: capacity {cap} exceeds the file size")
        self.cap, self.rank, self.world, self.pid, self.flags = cap, rank, world, pid, flags
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

    def alive(self, proc_start: float) -> bool:
        """Whether the writing process still runs (the pid is not reused by another one)."""
        try:
            if self._proc is None:
                p = psutil.Process(self.pid)
                if abs(p.create_time() - proc_start) > 1.0:
                    return False
                self._proc = p
            return self._proc.is_running() and self._proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()


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
