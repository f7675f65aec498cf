"""The trainer's step ring: its byte format and the writer a rank drives on the hot path.

This is the only monitoring module a trainer imports (no psutil, no HTTP server, no goodput): the
node agent reads the rings (:mod:`flashckpt.monitor.rankview`,
:mod:`flashckpt.monitor.step_monitor`).

Trainer side (:class:`StepRecorder`, driven by the checkpointer): each rank owns a small ring
file in the agent's shared-memory directory, ``fc.<job>.<node>.r<rank>.mon``, mapped into the
trainer. ``ckpt.step()`` appends one fixed-size record per iteration (step, end time and the
iteration's parts in milliseconds) with one ``struct.pack_into`` into the mapping and then
publishes the record count: no syscall, no lock, no allocation on the hot path. Forward and
optimizer hooks time the parts:

- ``step``: from the end of the previous iteration (or of ``checkpointing()`` entry) to this one;
- ``data``: from the start of the iteration to the model's first forward (fetching the batch);
- ``forward``: inside the model's forward calls; ``forward_backward``: from the first forward to
  ``optimizer.step()`` (to the end of the iteration without an optimizer);
- ``optimizer``: inside ``optimizer.step()``, less checkpoint waits;
- ``checkpoint``: blocked in flashckpt: snapshot copies, waits for a copy, flushes.

The ring header carries what the agent needs to know about the process: pid and creation time,
when it entered ``checkpointing()`` and when its first step began (the restore time), the step
it resumed at, its phase (entering, running, paused in a flush, finishing, exited), and whether
a ``SIGUSR1`` stack dump handler is installed (``faulthandler`` writes every thread's Python
stack to ``<run_dir>/<job>.<node>.r<rank>.stacks.log``).

Liveness across PID namespaces: the writer holds a Linux open-file-description write lock
(``F_OFD_SETLK``) on its ring file for as long as it lives (:data:`FLAG_LOCK`), and the ring
records the writer's PID namespace (:data:`PIDNS_OFF`). The agent asks ``F_OFD_GETLK`` on a
read-only descriptor (it never takes a lock): the lock is released when the process ends, kill -9
included, and the question works on a shared tmpfs from any PID namespace, where the ring's pid
means nothing (a node agent DaemonSet and its trainer pods). Forked children (data loader
workers) drop their copy of the descriptor (``os.register_at_fork``), so a lock held means the
writer itself runs. A ring without :data:`FLAG_LOCK` (a trainer of an earlier version, or a
platform without OFD locks) is judged by its pid and start time.

A rank's next process (a restart) keeps the previous process's ring for the agent under
``fc.<job>.<node>.r<rank>.mon.<token>`` (a hard link, made before the new ring replaces the
old name): records the agent had not read yet (it was down, or had not polled since) stay
readable, and the agent removes the file once it has read it to its end and reported it
(issue 41: a restart used to destroy the killed process's last iterations, and the goodput
missed them). At most :data:`RETIRED_KEEP` of them per rank are kept where no agent reads them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import logging
import mmap
import os
import signal
import stat
import struct
import time
import uuid
from typing import Any

from flashckpt.names import RETIRED_RING_SUFFIX_RE, retired_ring_path, ring_path, stacks_path

__all__ = [
    "StepRecorder",
    "open_recorder",
    "ring_path",
]

log = logging.getLogger("flashckpt.monitor.step_monitor")


MAGIC = b"FLCKMON1"
VERSION = 1
CAPACITY = 4096
"""Records per ring (a power of two): 4096 x 64 B = 256 KiB; at 1 ms per step the agent has
4 s to read them."""

HEADER_SIZE = 4096
# step, t_end (CLOCK_MONOTONIC s), step, data, forward, forward_backward, optimizer, checkpoint
# (ms), flags
REC = struct.Struct("<qdffffffI20x")
REC_SIZE = REC.size
# magic, version, record size, capacity, rank, world size, pid, flags
FIXED = struct.Struct("<8sIIIIIII")
PHASE = struct.Struct("<I")
PHASE_OFF = 36
TOKEN = struct.Struct("<Q")
TOKEN_OFF = 40
COUNT = struct.Struct("<Q")
COUNT_OFF = 64
# proc_start, enter, ready (wall s), ready (monotonic s), exit (wall s), resume step, exit code,
# restored_from
INFO = struct.Struct("<dddddqi16s")
INFO_OFF = 128
# the inode of the writer's PID namespace (/proc/self/ns/pid); 0: unknown (an earlier writer)
PIDNS = struct.Struct("<Q")
PIDNS_OFF = 48
STACKS_OFF = 512
STACKS_LEN = 512

RETIRED_KEEP = 8
"""Rings of earlier processes of one rank kept for the node agent at most: an agent that runs
reads and removes each within a poll, so more of them means none reads them; the writer then
removes the oldest (and says so)."""

FLAG_ELASTIC = 1  # runs under an elastic launcher (torchelastic): a killed worker is restarted
FLAG_STACKS = 2  # SIGUSR1 dumps the Python stacks (faulthandler)
FLAG_LOCK = 4  # the writer holds an OFD write lock on the ring file while it lives
REC_SNAPSHOT = 1  # a snapshot was taken at the end of this iteration

ENTERING, RUNNING, PAUSED, FINISHING, EXITED = range(5)
PHASES = ("entering", "running", "paused", "finishing", "exited")

PARTS = ("step", "data", "forward", "forward_backward", "optimizer", "checkpoint")
# index of each part in a record tuple
PART_INDEX = {p: i + 2 for i, p in enumerate(PARTS)}


def _under_elastic_launcher() -> bool:
    # torchrun and `flashckpt run` (torchelastic's LocalElasticAgent) set this for their workers.
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def _proc_start_time() -> float:
    """This process's creation time (wall s), the value ``psutil.Process().create_time()``
    gives on Linux, without importing psutil on the trainer's path: ``starttime`` of
    ``/proc/self/stat`` (clock ticks since boot) plus ``btime`` of ``/proc/stat``.

    Raises:
        OSError: ``/proc`` cannot be read or does not have the expected fields.
    """
    with open("/proc/self/stat", "rb") as f:
        data = f.read()
    try:
        start_ticks = int(data[data.rfind(b")") + 2 :].split()[19])
    except (IndexError, ValueError):
        raise OSError(f"/proc/self/stat has no start time: {data[:200]!r}") from None
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime"):
                return start_ticks / os.sysconf("SC_CLK_TCK") + float(line.split()[1])
    raise OSError("/proc/stat has no btime line")


def pid_namespace() -> int:
    """The inode of this process's PID namespace (``/proc/self/ns/pid``); 0 when it cannot be
    read (then nobody can compare it: see :func:`flashckpt.monitor.rankview.RingReader`)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


# struct flock: l_type, l_whence, l_start, l_len, l_pid (+ padding), as Linux x86-64/arm64 lay it
_FLOCK = struct.Struct("hhqqi4x")
_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)
_OFD_GETLK: int | None = getattr(fcntl, "F_OFD_GETLK", None)
_LOCK_FDS: set[int] = set()
"""The descriptors holding this process's ring locks (a forked child closes its copies)."""


def _drop_inherited_locks() -> None:
    # In a forked child: its copies of the lock descriptors would keep the parent's locks held
    # after the parent died (an OFD lock lives while any descriptor of it is open).
    for fd in _LOCK_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _take_lock(fd: int) -> bool:
    """Takes an OFD write lock on the whole file open at ``fd``; False where the platform or
    the file system has none (the ring is then judged by its pid)."""
    if _OFD_SETLK is None:
        return False
    try:
        fcntl.fcntl(fd, _OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError as e:
        log.warning(
            "flashckpt: no lock on the monitor ring (%s): the node agent judges this rank alive "
            "by its pid, which is wrong when it runs in another PID namespace",
            e,
        )
        return False
    return True


def lock_held(fd: int) -> bool:
    """Whether some open file description holds a lock on the file open at ``fd`` (any mode:
    ``F_OFD_GETLK`` only asks, it never takes a lock).

    Raises:
        OSError: the platform has no OFD locks or the query failed.
    """
    if _OFD_GETLK is None:
        raise OSError("this platform has no open-file-description locks (F_OFD_GETLK)")
    got = fcntl.fcntl(fd, _OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    return int(_FLOCK.unpack(got)[0]) != fcntl.F_UNLCK


def _ring_token(path: str) -> str | None:
    """The token of the ring file at ``path`` (not followed if a link), or None: no such file,
    or not a ring (then nothing of it is worth keeping)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.pread(fd, TOKEN_OFF + TOKEN.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(head) < TOKEN_OFF + TOKEN.size or head[: len(MAGIC)] != MAGIC:
        return None
    return f"{TOKEN.unpack_from(head, TOKEN_OFF)[0]:016x}"


def _retire(path: str) -> str | None:
    """Keeps the ring now at ``path`` (a previous process of this rank) for the node agent
    (:func:`~flashckpt.names.retired_ring_path`); returns where, or None where there was nothing
    to keep. Kept rings of this rank beyond :data:`RETIRED_KEEP` go first, the oldest first,
    with a warning: no agent read them."""
    token = _ring_token(path)
    if token is None:
        return None
    directory, base = os.path.split(path)
    try:
        names = [n for n in os.listdir(directory or ".") if n.startswith(base + ".")]
    except OSError:
        names = []
    old: list[tuple[float, str]] = []
    for name in names:
        if RETIRED_RING_SUFFIX_RE.fullmatch(name[len(base) :]):
            full = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                old.append((os.lstat(full).st_mtime, full))
    old.sort()
    for _, full in old[: max(0, len(old) - RETIRED_KEEP + 1)]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(full)
            log.warning(
                "flashckpt: removed %s, the step ring of an earlier process of this rank that no "
                "node agent read (%d are kept): its iterations are missing from the goodput "
                "report",
                full,
                RETIRED_KEEP,
            )
    kept = retired_ring_path(path, token)
    try:
        os.link(path, kept, follow_symlinks=False)
    except FileExistsError:
        pass  # kept already (this process retries after a failed start)
    except OSError as e:
        log.warning(
            "flashckpt: cannot keep the previous step ring %s for the node agent (%s): the "
            "iterations of the process before this one that it did not read yet are not counted",
            path,
            e,
        )
        return None
    return kept


# -- trainer side ------------------------------------------------------------------------------
class StepRecorder:
    """A rank's writer end of its monitor ring. Single-threaded: the training loop's thread.

    Args:
        path: the ring file (created, or atomically replaced: a new process is a new ring; the
            one it replaces is kept for the node agent: see
            :func:`~flashckpt.names.retired_ring_path`).
        rank: the rank.
        world: the world size.
        enter_wall: when ``checkpointing()`` was entered (``time.time()``).
        stacks_path: where ``SIGUSR1`` dumps the Python stacks (None: no handler installed).
        capacity: records in the ring (a power of two).

    Raises:
        OSError: the ring cannot be created (e.g. no room in the shared-memory directory).
    """

    __slots__ = (
        "_ck",
        "_ck_at_opt",
        "_closed",
        "_count",
        "_flags",
        "_fwd",
        "_lock_fd",
        "_mask",
        "_mm",
        "_opt",
        "_pause_phase",
        "_pause_t0",
        "_phase",
        "_stacks_file",
        "_t_fwd",
        "_t_fwd0",
        "_t_iter",
        "_t_opt",
        "_t_opt0",
        "path",
    )

    def __init__(
        self,
        path: str,
        *,
        rank: int,
        world: int,
        enter_wall: float,
        stacks_path: str | None = None,
        capacity: int = CAPACITY,
    ) -> None:
        if capacity <= 0 or capacity & (capacity - 1):
            raise ValueError(f"capacity={capacity}: use a power of two")
        self.path = path
        self._mask = capacity - 1
        self._count = 0
        self._closed = False
        self._t_iter = time.monotonic()
        self._t_fwd = self._t_fwd0 = self._t_opt = self._t_opt0 = 0.0
        self._fwd = self._opt = self._ck = self._ck_at_opt = 0.0
        self._flags = 0
        self._phase = ENTERING
        self._pause_phase = RUNNING
        self._pause_t0 = 0.0
        self._stacks_file: Any = None
        flags = FLAG_ELASTIC if _under_elastic_launcher() else 0
        if stacks_path is not None and self._install_stack_dump(stacks_path):
            flags |= FLAG_STACKS
        size = HEADER_SIZE + capacity * REC_SIZE
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # Reserve every page now: a full tmpfs is an error here, never a SIGBUS mid-run.
            os.posix_fallocate(fd, 0, size)
            self._mm = mmap.mmap(fd, size)
            proc_start = _proc_start_time()
        except BaseException:
            if hasattr(self, "_mm"):
                self._mm.close()
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._remove_stack_dump()
            raise
        os.close(fd)
        # An open file description of its own holds the lock for the process's lifetime (the
        # mapping keeps a duplicate of ``fd``, which a forked child would inherit).
        self._lock_fd: int | None = None
        try:
            lock_fd = os.open(tmp, os.O_RDWR)
        except OSError as e:
            log.warning("flashckpt: no lock on the monitor ring: cannot open %s: %s", tmp, e)
        else:
            if _take_lock(lock_fd):
                self._lock_fd = lock_fd
                _LOCK_FDS.add(lock_fd)
                flags |= FLAG_LOCK
            else:
                os.close(lock_fd)
        FIXED.pack_into(
            self._mm, 0, MAGIC, VERSION, REC_SIZE, capacity, rank, world, os.getpid(), flags
        )
        PIDNS.pack_into(self._mm, PIDNS_OFF, pid_namespace())
        PHASE.pack_into(self._mm, PHASE_OFF, ENTERING)
        TOKEN.pack_into(self._mm, TOKEN_OFF, uuid.uuid4().int & (2**64 - 1))
        INFO.pack_into(self._mm, INFO_OFF, proc_start, enter_wall, 0.0, 0.0, 0.0, -1, 0, b"")
        if flags & FLAG_STACKS and stacks_path is not None:
            raw = stacks_path.encode()[: STACKS_LEN - 1]
            self._mm[STACKS_OFF : STACKS_OFF + len(raw)] = raw
        kept = _retire(path)
        try:
            os.replace(tmp, path)
        except BaseException:
            if kept is not None:  # the previous ring stays where it was: not retired
                with contextlib.suppress(OSError):
                    os.unlink(kept)
            self._mm.close()
            self._release_lock()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._remove_stack_dump()
            raise

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None and fd in _LOCK_FDS:  # not in a forked child, which closed its copy
            _LOCK_FDS.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def _install_stack_dump(self, stacks_path: str) -> bool:
        try:
            f = open(stacks_path, "a")  # noqa: SIM115 (kept open: faulthandler writes to its fd)
        except OSError as e:
            log.warning("flashckpt: no stack dumps on SIGUSR1: cannot open %s: %s", stacks_path, e)
            return False
        f.write(f"== pid {os.getpid()}: Python stacks are dumped here on SIGUSR1 (hang)\n")
        f.flush()
        try:
            faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
        except (AttributeError, ValueError, RuntimeError) as e:  # no SIGUSR1 on this platform
            f.close()
            log.warning("flashckpt: no stack dumps on SIGUSR1: %s", e)
            return False
        self._stacks_file = f
        return True

    def _remove_stack_dump(self) -> None:
        if self._stacks_file is None:
            return
        with contextlib.suppress(Exception):
            faulthandler.unregister(signal.SIGUSR1)
        with contextlib.suppress(OSError):
            self._stacks_file.close()
        self._stacks_file = None

    def attach(self, model: Any, optimizer: Any) -> list[Any]:
        """Installs the forward and optimizer timing hooks; returns their removable handles.

        The optimizer pre-hook must be registered before the checkpointer's own (which waits
        for a pending copy), so that wait is measured as checkpoint time, not optimizer time.
        """
        handles = [
            model.register_forward_pre_hook(self._fwd_pre),
            model.register_forward_hook(self._fwd_post),
        ]
        if optimizer is not None:
            handles.append(optimizer.register_step_pre_hook(self._opt_pre))
            handles.append(optimizer.register_step_post_hook(self._opt_post))
        return handles

    def ready(self, resume_step: int, restored_from: str | None) -> None:
        """Entry is done: the first iteration starts now (restore time = now - enter)."""
        now_m = time.monotonic()
        info = list(INFO.unpack_from(self._mm, INFO_OFF))
        info[2], info[3], info[5] = time.time(), now_m, resume_step
        info[7] = (restored_from or "").encode()[:16]
        INFO.pack_into(self._mm, INFO_OFF, *info)
        self._t_iter = now_m
        self._set_phase(RUNNING)  # after the info: a reader that sees RUNNING sees the info

    # -- hot path ------------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """Records iteration ``step`` as done now (a few microseconds, no syscall)."""
        now = time.monotonic()
        t0 = self._t_iter
        f0 = self._t_fwd0
        if f0:
            data = f0 - t0
            o0 = self._t_opt0
            fb = (o0 or now) - f0
        else:
            data = fb = 0.0
        i = self._count
        REC.pack_into(
            self._mm,
            HEADER_SIZE + (i & self._mask) * REC_SIZE,
            step,
            now,
            (now - t0) * 1e3,
            data * 1e3,
            self._fwd * 1e3,
            fb * 1e3,
            self._opt * 1e3,
            self._ck * 1e3,
            self._flags,
        )
        self._count = i + 1
        COUNT.pack_into(self._mm, COUNT_OFF, i + 1)  # publish after the record (x86 TSO)
        self._t_iter = now
        self._t_fwd0 = self._t_opt0 = 0.0
        self._fwd = self._opt = self._ck = 0.0
        self._flags = 0

    def ckpt_stall(self, seconds: float, snapshot: bool = False) -> None:
        """Adds time the loop was blocked by flashckpt to the current iteration."""
        self._ck += seconds
        if snapshot:
            self._flags |= REC_SNAPSHOT

    def _fwd_pre(self, module: Any, args: Any) -> None:
        now = time.monotonic()
        if not self._t_fwd0:
            self._t_fwd0 = now
        self._t_fwd = now

    def _fwd_post(self, module: Any, args: Any, output: Any) -> None:
        self._fwd += time.monotonic() - self._t_fwd

    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        now = time.monotonic()
        if not self._t_opt0:
            self._t_opt0 = now
        self._t_opt = now
        self._ck_at_opt = self._ck

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._opt += time.monotonic() - self._t_opt - (self._ck - self._ck_at_opt)

    # -- phases --------------------------------------------------------------------------------
    def _set_phase(self, phase: int) -> None:
        self._phase = phase
        if not self._closed:
            PHASE.pack_into(self._mm, PHASE_OFF, phase)

    def pause(self) -> None:
        """The loop blocks in flashckpt (a flush): not a hang; the time counts as checkpoint."""
        self._pause_phase = self._phase
        self._pause_t0 = time.monotonic()
        self._set_phase(PAUSED)

    def resume(self) -> None:
        """Ends :meth:`pause`."""
        self._ck += time.monotonic() - self._pause_t0
        self._set_phase(self._pause_phase)

    def finishing(self) -> None:
        """The loop is over; the final save and commit follow (not a hang)."""
        self._set_phase(FINISHING)

    def close(self, exit_code: int = 0) -> None:
        """Marks the process exited (0: cleanly) and unmaps the ring; idempotent."""
        if self._closed:
            return
        info = list(INFO.unpack_from(self._mm, INFO_OFF))
        info[4], info[6] = time.time(), exit_code
        INFO.pack_into(self._mm, INFO_OFF, *info)
        self._set_phase(EXITED)
        self._closed = True
        self._remove_stack_dump()
        with contextlib.suppress(BufferError):
            self._mm.close()
        # After EXITED is written: an agent that finds the lock gone reads EXITED, not a death.
        self._release_lock()


def open_recorder(
    *,
    shm_dir: str,
    run_dir: str,
    job: str,
    node: str,
    rank: int,
    world: int,
    enter_wall: float,
) -> StepRecorder | None:
    """Creates a rank's ring; on failure warns and returns None: monitoring never stops training."""
    path = ring_path(shm_dir, job, node, rank)
    try:
        return StepRecorder(
            path,
            rank=rank,
            world=world,
            enter_wall=enter_wall,
            stacks_path=stacks_path(run_dir, job, node, rank),
        )
    except OSError as e:
        log.warning(
            "flashckpt: step monitoring is off for rank %d: cannot create %s (%s); free room in "
            "%s to get step metrics and hang detection",
            rank,
            path,
            e,
            shm_dir,
        )
        return None
