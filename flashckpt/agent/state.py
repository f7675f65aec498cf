"""The node agent's shared state: its trainer positions, connections, locks, and what it knows
of storage (committed steps, errors), used by every part of the agent (server, segments,
persistence, commit). One object, handed to each part: the parts compose, none inherits another.

Lock order: ``io_lock`` (a persist reads slot bytes) before ``lock`` (positions, connections,
bookkeeping) before ``map_lock`` (a slot is hashed or unmapped).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import queue
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flashckpt.agent.config import AgentConfig
from flashckpt.errors import CorruptCheckpointError
from flashckpt.format.shm import Slot, SlotInfo
from flashckpt.format.snapmeta import SnapshotMeta
from flashckpt.format.storage import Storage
from flashckpt.protocol.channel import send_msg
from flashckpt.protocol.messages import Event, PersistErrorEvent

__all__ = [
    "BACKGROUND_CHUNK",
    "BACKGROUND_NICE",
    "RETRY_SOON_S",
    "AgentState",
    "Conn",
    "Pacer",
    "RankRecord",
    "header_ok",
    "lower_thread_priority",
    "read_meta",
    "slots_busy",
]

log = logging.getLogger("flashckpt.agent.daemon")

BACKGROUND_NICE = 15
"""The nice value of the agent's background threads (hashing, persisting): below the agent's
other threads (10, set for the whole agent by :func:`~flashckpt.agent.daemon.run_agent`), far below
training (0). A lower priority only, never a cap: on an idle core they run at full speed."""
BACKGROUND_CHUNK = 16 << 20
"""Bytes the background threads hash or write between two looks at the trainers (~2 ms of
hashing): how long a trainer's copy shares the memory bus with them at most, uninvited."""
PACE_MAX_PAUSE_S = 0.25
"""The longest one pause waits for a trainer's copy to end (a 0.5 GB copy takes 50-100 ms):
then one more chunk goes, so a trainer that copies all the time slows background work but never
stops it."""
PACE_BUDGET_S = 2.0
"""Pauses of one pass (one snapshot hashed, one shard written) add up to this at most."""
RETRY_SOON_S = 0.2
"""How soon a background thread looks again at work it left unfinished and nobody will wake it
for (a persist that gave way to a trainer or found a slot torn, a commit waiting for the other
nodes' parts in storage): otherwise the threads wait for their event (or ``poll_interval``)."""

_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "riscv64": 30}
"""ioprio_set(2) system call numbers (glibc has no wrapper)."""
_IOPRIO_WHO_PROCESS = 1  # with a thread id: that thread only
_IOPRIO_CLASS_BE = 2
_refused_logged: set[str] = set()


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> dict[str, str]:
    """Lowers the calling thread's CPU priority to ``nice`` (never raises it) and its IO priority
    to the lowest best-effort level (7: served after every other best-effort request, never
    starved the way the idle class is by a dataloader reading all the time).

    On Linux both are per thread: ``setpriority(PRIO_PROCESS, tid)`` and ``ioprio_set(
    IOPRIO_WHO_PROCESS, tid)`` apply to the thread ``tid`` alone, and threads it starts inherit
    them (the shard writer's worker). Lowering one's own priority needs no privilege; where the
    system refuses it anyway (a seccomp filter, another OS) it is logged once and work goes on.

    Returns:
        ``{"nice": ..., "ioprio": ...}``: ``"ok"`` or why not, for the log and the tests.
    """
    out = {}
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        out["nice"] = "ok"
    except (OSError, AttributeError) as e:
        out["nice"] = f"refused: {e}"
    nr = _IOPRIO_SET.get(platform.machine()) if sys.platform == "linux" else None
    if nr is None:
        out["ioprio"] = f"not supported on {sys.platform}/{platform.machine()}"
    else:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            rc = libc.syscall(nr, _IOPRIO_WHO_PROCESS, tid, (_IOPRIO_CLASS_BE << 13) | 7)
            out["ioprio"] = "ok" if rc == 0 else f"refused: {os.strerror(ctypes.get_errno())}"
        except (OSError, AttributeError) as e:
            out["ioprio"] = f"refused: {e}"
    for what, how in out.items():
        if how != "ok" and what not in _refused_logged:
            _refused_logged.add(what)
            log.warning("background threads keep their %s priority: %s", what, how)
    return out


def slots_busy(slots: list[Slot], *, wanted: bool = False) -> bool:
    """Whether a trainer copies into one of ``slots`` now (its seqlock is odd), or, with
    ``wanted``, waits for one. Closed slots are skipped."""
    for s in slots:
        with contextlib.suppress(ValueError):  # closed meanwhile
            if s.seq() % 2 == 1 or (wanted and s.wanted()):
                return True
    return False


class Pacer:
    """Called between the bounded chunks of one pass of background work (hashing a snapshot,
    writing a shard): waits while ``busy()`` says a trainer copies, at most ``max_pause_s`` a
    pause and ``budget_s`` a pass, so a trainer that copies all the time slows the pass but never
    stops it. Stops waiting at once when ``stop`` is set (the agent exits).

    Args:
        busy: whether to give way now (e.g. ``lambda: slots_busy(slots)``).
        stop: when set, no more waiting.
        poll_s: how often ``busy`` is asked during a pause.
    """

    def __init__(
        self,
        busy: Callable[[], bool],
        *,
        stop: threading.Event | None = None,
        max_pause_s: float = PACE_MAX_PAUSE_S,
        budget_s: float = PACE_BUDGET_S,
        poll_s: float = 0.002,
    ) -> None:
        if max_pause_s < 0 or budget_s < 0 or poll_s <= 0:
            raise ValueError("pacer times must be >= 0 (poll_s > 0)")
        self.busy = busy
        self.stop = stop or threading.Event()
        self.max_pause_s = max_pause_s
        self.budget_s = budget_s
        self.poll_s = poll_s
        self.paused = 0
        """Pauses so far (the calls that found a trainer copying)."""
        self.waited_s = 0.0
        """Seconds waited so far."""
        self.pausing = threading.Event()
        """Set while a pause waits (tests see the pass stand still)."""

    def __call__(self) -> None:
        if self.waited_s >= self.budget_s or not self.busy():
            return
        self.paused += 1
        t0 = time.monotonic()
        end = t0 + min(self.max_pause_s, self.budget_s - self.waited_s)
        self.pausing.set()
        try:
            while not self.stop.is_set() and time.monotonic() < end and self.busy():
                self.stop.wait(self.poll_s)
        finally:
            self.pausing.clear()
            self.waited_s += time.monotonic() - t0


def header_ok(slot: Slot) -> bool:
    """Whether a slot's header passes its check (a torn read of a header being rewritten is
    retried: the writer rewrites it in one short copy)."""
    for _ in range(5):
        try:
            if slot.header() is not None:
                return True
        except ValueError:  # closed
            return False
        time.sleep(0.002)
    return False


def read_meta(slot: Slot, info: SlotInfo) -> SnapshotMeta | None:
    """The validated snapshot meta of a complete header, or None (torn, or not a valid meta:
    such a snapshot is never persisted nor adopted, and the reason is logged)."""
    doc = slot.read_meta(info)
    if doc is None:
        return None
    try:
        return SnapshotMeta.from_json(doc, slot.path)
    except CorruptCheckpointError as e:
        log.warning("snapshot of step %d not used: %s", info.step, e)
        return None


class Conn:
    """One trainer's (or tool's) connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.ranks: set[int] = set()
        """The positions this connection said hello for."""
        self.peer_pid = _peer_pid(sock)
        """The process that connected (``SO_PEERCRED``; None where it cannot be had)."""

    def peer_alive(self) -> bool:
        """Whether the process that opened this connection still runs (not a zombie): a
        killed trainer's socket may outlive it a moment, or in children that inherited it."""
        if self.peer_pid is None:
            return True
        try:
            with open(f"/proc/{self.peer_pid}/stat", "rb") as f:
                stat_line = f.read()
        except OSError:
            return False
        return stat_line[stat_line.rfind(b")") + 2 :][:1] not in (b"Z", b"X")

    def send(self, obj: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            send_msg(self.sock, obj, self.lock)


def _peer_pid(sock: socket.socket) -> int | None:
    """The pid of a Unix socket's peer at connect time, or None."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    pid = struct.unpack("3i", raw)[0]
    return pid if pid > 0 else None


@dataclass(slots=True)
class RankRecord:
    """One local trainer position: keyed by its local rank, so a trainer that comes back with
    another global rank (a new world after a membership change) finds its snapshots."""

    rank: int
    """The key: the local rank on this node (its slot files are named after it)."""
    global_rank: int = -1
    """The trainer's global rank (-1: not known yet)."""
    world_id: str = ""
    """The world (rendezvous round) the trainer in this position belongs to."""
    world_size: int = 0
    local_world_size: int = 1
    shard: int = 0
    num_shards: int = 1
    replica: int = 0
    slots: list[Slot | None] = field(default_factory=lambda: [None, None])
    conn: Conn | None = None
    done: bool = False


def slot_room(st: AgentState, after: Callable[[RankRecord, int, int], int]) -> tuple[int, int]:
    """(bytes of every slot file of this agent once a planned change is done, bytes of the slot
    files that exist now): the replicas' capacity check's figures. ``after(position, index,
    bytes)`` gives a slot's bytes after the change, from its bytes without it: a pull's incoming
    file counts as the slot it will replace (it exists already)."""
    own = present = 0
    with st.lock:
        pending = {(id(r), i): n for r, i, n in st.incoming.values()}
        for rec in st.ranks.values():
            for i, s in enumerate(rec.slots):
                size = 0
                with contextlib.suppress(ValueError):  # closed meanwhile
                    size = s.size if s is not None else 0
                coming = pending.get((id(rec), i))
                present += size + (coming or 0)
                own += after(rec, i, size if coming is None else coming)
    return own, present


class AgentState:
    """What the parts of one node agent share."""

    def __init__(self, config: AgentConfig) -> None:
        self.cfg = config
        self.storage: Storage | None = (
            Storage(config.storage, file_mode=config.storage_file_mode) if config.storage else None
        )
        self.ranks: dict[int, RankRecord] = {}
        self.conns: set[Conn] = set()
        self.lock = threading.RLock()  # guards ranks/conns, the bookkeeping and slot (re)mapping
        self.io_lock = threading.Lock()  # held while slot bytes are read for persistence
        # Held while a slot is hashed or closed (after io_lock when both are taken): hashing
        # never waits for a persist, and a slot is never unmapped under the hasher.
        self.map_lock = threading.Lock()
        self.hash_wake = threading.Event()
        self.replica_wake = threading.Event()  # a hash was recorded: a replica may be due
        # Called at a trainer's alloc with (own slot bytes after it, of those already in the
        # tmpfs): the replicas' up-front capacity check (ShmSpaceError); None without replicas.
        self.capacity_check: Callable[[int, int], None] | None = None
        # Held while the room of new slot files is checked and taken (a trainer's alloc, a
        # pull's incoming file; inside io_lock when both are held): two at once would each
        # pass the check counting only their own files.
        self.room_lock = threading.Lock()
        # The pulls' slot files allocated but not installed yet: incoming path -> (position,
        # slot index, bytes). They count in the capacity check as the slots they will become.
        self.incoming: dict[str, tuple[RankRecord, int, int]] = {}
        # Slot files refused (foreign owner, loose mode) or discarded (bad header): path -> why.
        self.refused: dict[str, str] = {}
        # Snapshots whose data no longer matches their hash: (path, seq) -> step. Never persisted.
        self.corrupt: dict[tuple[str, int], int] = {}
        self.wake = threading.Event()  # wakes the persister (a snapshot completed, a flush)
        # (position, step) of a completed snapshot; a negative position: the agent stops
        self.private_q: queue.Queue[tuple[int, int]] = queue.Queue()
        self.stopping = threading.Event()
        self.committed: list[int] = []
        # The current world (rendezvous round): set by the newest trainer's hello. Only ranks and
        # snapshots of the current world are persisted together.
        self.world_id: str | None = None
        self.staged_writes = 0  # shard writes from a private copy (the trainer wanted the slot)
        self.persisted_high = -1  # newest step persisted (or skipped) by this agent
        self.persisting: int | None = None  # the step the persister writes now (issue 30)
        # Committed steps hidden (uncommitted) to be rewritten: retried until committed again.
        self.rewrites: set[int] = set()
        # flush requests waiting now: the newest snapshot is persisted even if unmarked
        self.flush_waiting = 0
        # the newest complete step not persisted because its trainers did not mark it
        self.unmarked_high = -1
        # How the shard files went to storage: with O_DIRECT straight from the slot, or through
        # the page cache (a file system that refuses O_DIRECT, or remote storage).
        self.shard_writes = {"direct": 0, "buffered": 0}
        # The oldest step a trainer resumed at since this agent started: steps after it that
        # storage already holds belong to an abandoned timeline and are rewritten.
        self.resumed_at = 1 << 62
        self.errors: list[dict[str, Any]] = []
        # Notified (under ``lock``) when a step is committed or an error recorded: what a flush
        # waits for (it sleeps on it, not in a loop).
        self.progress = threading.Condition(self.lock)
        self.last_client_time = time.monotonic()

    def wake_all(self) -> None:
        """Wakes the persist, hash and replica threads: what they look at changed for a reason
        no snapshot announces (the agent started with adopted snapshots, a trainer said hello,
        a new world or storage, the timeline was set back). Each thread waits for its event."""
        self.wake.set()
        self.hash_wake.set()
        self.replica_wake.set()

    def refuse(self, path: str, why: str) -> None:
        log.warning("slot file %s %s", path, why)
        with self.lock:
            self.refused[path] = why
            while len(self.refused) > 64:
                del self.refused[next(iter(self.refused))]

    def broadcast(self, event: Event) -> None:
        with self.lock:
            conns = list(self.conns)
        doc = event.to_json()
        for c in conns:
            c.send(doc)

    def record_error(self, step: int | None, error: str) -> None:
        log.error("persist step %s failed: %s", step, error)
        with self.lock:
            self.errors.append({"step": step, "error": error, "time": time.time()})
            del self.errors[:-50]
            self.progress.notify_all()
        self.broadcast(PersistErrorEvent(step=step, error=error))

    def active_slots(self) -> list[Slot]:
        """The slots of the positions whose trainer is connected (a dead trainer's slot that it
        left mid-copy stays odd forever: nothing to give way to)."""
        with self.lock:
            return [
                s
                for r in self.ranks.values()
                if r.conn is not None
                for s in r.slots
                if s is not None
            ]

    def trainer_busy(self, *, wanted: bool = True) -> bool:
        """Whether a connected trainer copies into a slot now, or (``wanted``) waits for one:
        when background work gives way (the replica sender's pacing asks the same)."""
        return slots_busy(self.active_slots(), wanted=wanted)

    def pacer(self, slots: list[Slot] | None = None) -> Pacer:
        """A :class:`Pacer` for one pass that gives way to a trainer copying into a slot: into
        one of ``slots`` (a list taken before ``map_lock``, which must not wait for ``lock``), or
        of the connected positions of the moment."""
        if slots is None:
            return Pacer(lambda: self.trainer_busy(wanted=False), stop=self.stopping)
        return Pacer(lambda: slots_busy(slots), stop=self.stopping)

    def commits_here(self) -> bool:
        """Whether this node commits the current world's steps (it hosts global rank 0)."""
        with self.lock:
            return any(
                r.global_rank == 0 and r.world_id == self.world_id for r in self.ranks.values()
            )
