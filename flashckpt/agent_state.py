"""The node agent's shared state: its trainer positions, connections, locks, and what it knows
of storage (committed steps, errors), used by every part of the agent (server, segments,
persistence, commit). One object, handed to each part: the parts compose, none inherits another.

Lock order: ``io_lock`` (a persist reads slot bytes) before ``lock`` (positions, connections,
bookkeeping) before ``map_lock`` (a slot is hashed or unmapped).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flashckpt.agent_config import AgentConfig
from flashckpt.errors import CorruptCheckpointError
from flashckpt.messages import Event, PersistErrorEvent
from flashckpt.protocol import send_msg
from flashckpt.shm import Slot, SlotInfo
from flashckpt.snapmeta import SnapshotMeta
from flashckpt.storage import Storage

__all__ = ["AgentState", "Conn", "RankRecord", "header_ok", "read_meta"]

log = logging.getLogger("flashckpt.agent")


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

    def send(self, obj: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            send_msg(self.sock, obj, self.lock)


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
        # Slot files refused (foreign owner, loose mode) or discarded (bad header): path -> why.
        self.refused: dict[str, str] = {}
        # Snapshots whose data no longer matches their hash: (path, seq) -> step. Never persisted.
        self.corrupt: dict[tuple[str, int], int] = {}
        self.wake = threading.Event()  # wakes the persister (a snapshot completed, a flush)
        self.private_q: queue.Queue[tuple[int, int]] = queue.Queue()  # (position, step)
        self.stopping = threading.Event()
        self.committed: list[int] = []
        # The current world (rendezvous round): set by the newest trainer's hello. Only ranks and
        # snapshots of the current world are persisted together.
        self.world_id: str | None = None
        self.persisted_high = -1  # newest step persisted (or skipped) by this agent
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
        self.last_client_time = time.monotonic()

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
        self.broadcast(PersistErrorEvent(step=step, error=error))

    def commits_here(self) -> bool:
        """Whether this node commits the current world's steps (it hosts global rank 0)."""
        with self.lock:
            return any(
                r.global_rank == 0 and r.world_id == self.world_id for r in self.ranks.values()
            )
