"""The node agent: a daemon per machine that owns the snapshot slots and persists them.

Trainers connect over a local Unix socket (mode 0600). The agent

* creates each rank's two slot files in ``/dev/shm`` (space reserved up front) and keeps them across
  trainer crashes, so a restarted trainer reloads from memory;
* keys the slots by *local* rank and tags every snapshot with its world (the rendezvous round,
  ``world_id``): after a membership change a surviving trainer with a new global rank finds its
  snapshots, and only the current world's ranks and snapshots are persisted together;
* persists, in the background, the newest step that every local rank holds complete in memory:
  one safetensors file per shard (written by replica 0 only), one JSON file per rank, a part record
  per node (tagged with the world), and, on the node that hosts rank 0, the manifest (the commit
  marker) once the parts of every rank of that world are in; a commit thread waits for them, so a
  step whose parts never arrive (a machine died) does not hold up newer steps; then it moves
  ``latest`` and keeps the newest ``keep`` steps;
* keeps persisting after a trainer dies, so the newest complete snapshot reaches storage even if
  no trainer comes back ("save at breakpoint");
* on SIGTERM finishes what is in flight, persists what storage lacks, removes its segments, exits;
* on start adopts its own job's segments (clearing the pin and wanted flags a dead agent or
  trainer left set), and removes only those segments of other jobs that are *abandoned*: their
  agent is dead and no file of the group changed for ``orphan_age_s`` (a day by default), since a
  dead agent's snapshots are still wanted by its own job's next agent (``flashckpt clean``
  removes abandoned segments on demand, listing what and why);
* trusts only local state of its own user: the run dir is created 0700 and refused when it is a
  link, another user's, or group/other-accessible; slot files not owned by this user or with a
  mode looser than 0600 are neither adopted nor served (they are reported in ``status()``);
* hashes each complete snapshot's data (xxh3_64, recorded in the slot, in a background thread:
  hashing in the trainer's copy would have added ~80% to the copy time, 8.4 GB/s hash vs
  10.2 GB/s copy measured here), rechecks it after writing a shard and never commits a step
  whose memory changed under the hash; trainers check it on a restore from memory;

The agent moves bytes: it does no tensor work and never imports torch (it would cost about 2 s
and 220 MiB per machine at start); ``tests/test_agent_notorch.py`` keeps it so.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from flashckpt import names
from flashckpt.errors import CorruptCheckpointError
from flashckpt.layout import safetensors_header
from flashckpt.manifest import FileEntry, RankEntry, ShardEntry
from flashckpt.monitor import AgentMonitor, MonitorConfig
from flashckpt.protocol import LineReader, default_node_id, default_run_dir, send_msg, socket_path
from flashckpt.shm import (
    ShmSpaceError,
    Slot,
    SlotInfo,
    allocate_slot_file,
    check_name,
    ensure_private_dir,
    file_problem,
    slot_path,
    slot_prefix,
)
from flashckpt.snapmeta import MAX_LOCAL_RANKS, NodePart, SnapshotMeta
from flashckpt.storage import (
    FORMAT,
    MANIFEST,
    PARTS,
    FileRecord,
    Storage,
    rank_file_name,
    shard_file_name,
)

__all__ = [
    "AgentConfig",
    "AgentRunning",
    "NodeAgent",
    "SegmentGroup",
    "abandoned_segments",
]

log = logging.getLogger("flashckpt.agent")

MAX_SLOT_BYTES = 1 << 44
"""Largest slot region a trainer may ask for (16 TiB; the tmpfs bounds it further)."""

_SLOT_RE = names.SLOT_NAME_RE


class AgentRunning(RuntimeError):
    """Another agent already serves this job on this node."""


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """Settings of a node agent."""

    job: str
    """Job id: names the shared-memory segments and the socket."""
    node: str = field(default_factory=default_node_id)
    """Node (machine) id; several simulated machines on one host need distinct ids."""
    storage: str | None = None
    """Checkpoint root URL; None keeps snapshots in memory only (a trainer may supply it)."""
    shm_dir: str = "/dev/shm"
    """The tmpfs holding the slots."""
    run_dir: str = field(default_factory=default_run_dir)
    """Directory of the socket, lock and log files."""
    keep: int = 3
    """Committed steps kept in storage."""
    storage_file_mode: int = 0o600
    """Permission bits of the checkpoint files written to a local file system (directories get
    the matching execute bits): private by default; ``0o644`` shares read access."""
    idle_timeout: float = 600.0
    """Exit (after persisting) when no trainer has been connected for this long."""
    orphan_age_s: float = 86400.0
    """Another job's segments are removed at start only when their agent is dead and none of
    their files changed for this many seconds (abandoned); younger ones may still be wanted by
    that job's next agent. ``flashckpt clean`` removes them on demand."""
    exit_when_done: bool = False
    """Exit once every rank said done and everything is persisted (auto-started agents)."""
    unused_timeout: float = 30.0
    """With ``exit_when_done``: exit if no trainer connected within this many seconds and there
    are no snapshots to keep (an agent a trainer started while another one was answering); also
    exit this many seconds after the last trainer left (finished, failed at entry or killed)
    once storage holds everything memory does."""
    poll_interval: float = 0.2
    """Seconds between scans of the slots when no trainer notifies."""
    commit_timeout: float = 120.0
    """How long the committing node waits for the other nodes' parts of a step."""
    retry_interval: float = 2.0
    """Pause after a persistence error before the next attempt."""
    write_through_private: bool = True
    """Write each snapshot's small per-rank state (RNG, extras) to storage at once, so a rank
    whose machine dies can resume from a replica's memory with its own RNG and extras."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """Step monitoring, hang and straggler detection, metrics endpoint, events and goodput."""

    def __post_init__(self) -> None:
        check_name("job", self.job)
        check_name("node", self.node)
        if self.keep < 1:
            raise ValueError(f"keep={self.keep}: keep at least 1 committed step")
        if self.idle_timeout <= 0:
            raise ValueError(f"idle_timeout={self.idle_timeout}: must be > 0 seconds")
        if self.orphan_age_s < 0:
            raise ValueError(f"orphan_age_s={self.orphan_age_s}: must be >= 0 seconds")


class _Torn(Exception):
    """A slot changed under the agent while it read it."""


class _Scribbled(Exception):
    """A snapshot's data no longer matches the hash recorded when it was complete."""


def _header_ok(slot: Slot) -> bool:
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


def _read_meta(slot: Slot, info: SlotInfo) -> SnapshotMeta | None:
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


@dataclass(slots=True)
class _Rank:
    """One local trainer position: keyed by its local rank, so a trainer that comes back with
    another global rank (a new world after a membership change) finds its snapshots."""

    rank: int
    """The key: the local rank on this node (its slot files are named after it)."""
    global_rank: int = -1
    world_id: str = ""
    """The world (rendezvous round) the trainer in this position belongs to."""
    world_size: int = 0
    local_world_size: int = 1
    shard: int = 0
    num_shards: int = 1
    replica: int = 0
    slots: list[Slot | None] = field(default_factory=lambda: [None, None])
    conn: _Conn | None = None
    done: bool = False


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.ranks: set[int] = set()

    def send(self, obj: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            send_msg(self.sock, obj, self.lock)


class NodeAgent:
    """A node agent; ``run()`` serves until stopped."""

    def __init__(self, config: AgentConfig) -> None:
        self.cfg = config
        self.storage: Storage | None = (
            Storage(config.storage, file_mode=config.storage_file_mode) if config.storage else None
        )
        self._ranks: dict[int, _Rank] = {}
        self._conns: set[_Conn] = set()
        self._lock = threading.RLock()  # guards _ranks/_conns and slot (re)mapping
        self._io_lock = threading.Lock()  # held while slot bytes are read for persistence
        # Held while a slot is hashed or closed (after _io_lock when both are taken): hashing
        # never waits for a persist, and a slot is never unmapped under the hasher.
        self._map_lock = threading.Lock()
        self._hash_wake = threading.Event()
        # Slot files refused (foreign owner, loose mode) or discarded (bad header): path -> why.
        self._refused: dict[str, str] = {}
        # Snapshots whose data no longer matches their hash: (path, seq) -> step. Never persisted.
        self._corrupt: dict[tuple[str, int], int] = {}
        self._wake = threading.Event()
        self._private_q: queue.Queue[tuple[int, int]] = queue.Queue()
        self._stop_flag = False  # set by signal handlers; read by the loops
        self._stopping = threading.Event()
        self._committed: list[int] = []
        # The current world (rendezvous round): set by the newest trainer's hello. Only ranks and
        # snapshots of the current world are persisted together.
        self._world_id: str | None = None
        # slot path -> ((seq, step, meta crc), world id) of its last complete snapshot
        self._snap_worlds: dict[str, tuple[tuple[int, int, int], str | None]] = {}
        # Steps this node commits once every node's part is in: step -> (world size, shards,
        # world id, deadline). The commit thread waits for them; persistence goes on meanwhile.
        self._commits: dict[int, tuple[int, int, str, float]] = {}
        self._commit_wake = threading.Event()
        self._commit_missing: dict[int, list[int]] = {}
        self._persisted_high = -1
        self._yields = 0
        # How the shard files went to storage: with O_DIRECT straight from the slot, or through
        # the page cache (a file system that refuses O_DIRECT, or remote storage).
        self._shard_writes = {"direct": 0, "buffered": 0}
        # The oldest step a trainer resumed at since this agent started: steps after it that
        # storage already holds belong to an abandoned timeline and are rewritten.
        self._resumed_at = 1 << 62
        self._errors: list[dict[str, Any]] = []
        self._last_client_time = time.monotonic()
        self._retry_after = 0.0
        self._lock_fd: int | None = None
        self._server: socket.socket | None = None
        self.monitor: AgentMonitor | None = None
        self.socket_path = socket_path(config.run_dir, config.job, config.node)
        self.owner_path = names.owner_path(config.shm_dir, config.job, config.node)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, lock_wait: float = 0.0) -> None:
        """Takes the job's lock, cleans and adopts segments, and listens. Returns at once.

        Args:
            lock_wait: seconds to wait for another agent of the same job and node to go away.
        """
        cfg = self.cfg
        # The socket, lock and log live here: another user able to write into it could swap
        # the socket (and receive the trainers' hello) or point the log elsewhere.
        ensure_private_dir(cfg.run_dir, "agent run dir")
        lock_path = names.lock_path(cfg.run_dir, cfg.job, cfg.node)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        # A previous agent may be finishing its shutdown (final persist): give it a moment.
        deadline = time.monotonic() + lock_wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                os.close(fd)
                raise AgentRunning(
                    f"an agent already serves job {cfg.job!r} on node {cfg.node!r} "
                    f"(socket {self.socket_path})"
                ) from None
        self._lock_fd = fd
        self._write_owner()
        self._clean_orphans()
        self._adopt()
        if self.storage is not None:
            self._init_storage_state()
        if cfg.monitor.enabled:
            self.monitor = AgentMonitor(
                job=cfg.job,
                node=cfg.node,
                shm_dir=cfg.shm_dir,
                run_dir=cfg.run_dir,
                config=cfg.monitor,
                facts=self.status,
            )
            self.monitor.start()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            srv.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        srv.listen(64)
        srv.settimeout(0.2)
        self._server = srv
        for target, name in (
            (self._accept_loop, "accept"),
            (self._persist_loop, "persist"),
            (self._private_loop, "private"),
            (self._commit_loop, "commit"),
            (self._hash_loop, "hash"),
        ):
            t = threading.Thread(target=target, name=f"flashckpt-agent-{name}", daemon=True)
            t.start()
        log.info(
            "agent for job %s node %s listening on %s (storage %s, shm %s)",
            cfg.job,
            cfg.node,
            self.socket_path,
            cfg.storage,
            cfg.shm_dir,
        )

    def install_signal_handlers(self) -> None:
        import faulthandler

        # A crash (SIGSEGV, SIGBUS, SIGABRT) leaves every thread's stack in the log.
        faulthandler.enable(all_threads=True)

        def handler(signum: int, frame: Any) -> None:
            self._stop_flag = True  # only a flag: the main loop does the work
            with contextlib.suppress(OSError):  # one write(2): safe in a signal handler
                os.write(2, f"flashckpt agent: got signal {signum}, stopping\n".encode())

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def request_stop(self) -> None:
        self._stop_flag = True

    def run(self) -> int:
        """Serves until SIGTERM/SIGINT, done (``exit_when_done``) or idle timeout; cleans up."""
        reason = "stopped"
        started = time.monotonic()
        ever_connected = False
        while True:
            time.sleep(0.05)
            if self._stop_flag:
                reason = "signal"
                break
            with self._lock:
                has_clients = bool(self._conns)
                ranks = list(self._ranks.values())
            if has_clients:
                self._last_client_time = time.monotonic()
                ever_connected = True
            elif (
                self.cfg.exit_when_done
                and not ever_connected
                and not ranks
                and time.monotonic() - started > self.cfg.unused_timeout
            ):
                reason = "unused"
                break
            elif time.monotonic() - self._last_client_time > self.cfg.idle_timeout:
                reason = "idle"
                break
            elif (
                self.cfg.exit_when_done
                and (ever_connected or ranks)
                and time.monotonic() - self._last_client_time > self.cfg.unused_timeout
                and not self._holds_unpersisted()
            ):
                # Its trainers are gone (finished, failed at entry, killed) and storage holds
                # what memory does: an auto-started agent has nothing left to do.
                reason = "trainers gone, everything persisted"
                break
            if (
                self.cfg.exit_when_done
                and ranks
                and not has_clients
                and all(r.done for r in ranks)
                and not self._pending_step()
                and not self._commits
            ):
                reason = "done"
                break
        log.info("agent stopping (%s)", reason)
        self.shutdown(final_persist=True)
        return 0

    def _holds_unpersisted(self) -> bool:
        """Whether memory holds snapshots storage lacks (or commits are in flight)."""
        if self.storage is None:
            with self._lock:
                slots = [s for r in self._ranks.values() for s in r.slots if s is not None]
            for s in slots:
                with contextlib.suppress(ValueError):  # closed meanwhile
                    info = s.header()
                    if info is not None and info.complete:
                        return True
            return False
        return self._pending_step() is not None or bool(self._commits)

    def shutdown(self, final_persist: bool = True) -> None:
        self._stopping.set()
        self._wake.set()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.close()
        # Wait for the persist thread to leave its step (it checks _stopping between steps).
        with self._io_lock:
            pass
        try:
            if final_persist and self.storage is not None:
                try:
                    step = self._pending_step()
                    if step is not None:
                        self._persist(*step)
                except Exception:
                    log.exception("final persist failed")
                try:
                    self._drain_commits(min(self.cfg.commit_timeout, 10.0))
                except Exception:
                    log.exception("final commit failed")
            if self.monitor is not None:
                try:
                    self.monitor.close()  # before the segments go: the last records of the rings
                except Exception:
                    log.exception("closing the monitor failed")
        finally:
            # Whatever failed above, the segments go (an allocation racing the shutdown is
            # refused under the same locks, so none is created after this).
            with self._io_lock, self._lock, self._map_lock:  # not under the hasher either
                for c in list(self._conns):
                    with contextlib.suppress(OSError):
                        c.sock.close()
                self._remove_segments()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    # -- segments ----------------------------------------------------------------------------
    def _write_owner(self) -> None:
        me = psutil.Process()
        owner = {"pid": me.pid, "create_time": me.create_time(), "job": self.cfg.job}
        tmp = f"{self.owner_path}.tmp{me.pid}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        # O_EXCL | O_NOFOLLOW: a link planted under this name is never written through.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(owner, f)
        os.replace(tmp, self.owner_path)

    def _clean_orphans(self) -> None:
        """Removes the abandoned segments of other jobs: agent dead, untouched for
        ``orphan_age_s``. A dead agent's younger snapshots may still be wanted by that job."""
        for group in abandoned_segments(
            self.cfg.shm_dir, self.cfg.orphan_age_s, skip=(self.cfg.job, self.cfg.node)
        ):
            removed = group.remove()
            if removed:
                log.info(
                    "removed %d segment files of job %s node %s: %s",
                    removed,
                    *group.key,
                    group.reason,
                )

    def _adopt(self) -> None:
        """Maps the slot files our job left here (a previous agent died): snapshots survive."""
        prefix = slot_prefix(self.cfg.job, self.cfg.node)
        newest = -1
        for name in sorted(os.listdir(self.cfg.shm_dir)):
            m = _SLOT_RE.match(name)
            if not name.startswith(prefix) or not m:
                if name.startswith(prefix) and ".tmp" in name:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.cfg.shm_dir, name))
                continue
            rank, idx = int(m.group(3)), int(m.group(4))
            path = os.path.join(self.cfg.shm_dir, name)
            slot = self._open_trusted(path)
            if slot is None:
                continue
            # A dead agent's pin (it crashed mid-persist) or a dead trainer's wanted flag would
            # make every trainer wait for a slot nobody releases.
            slot.clear_flags()
            rec = self._ranks.setdefault(rank, _Rank(rank))
            rec.slots[idx] = slot
            info = slot.header()
            meta = _read_meta(slot, info) if info is not None else None
            if meta is not None and info is not None:
                if info.step >= newest:
                    newest, self._world_id = info.step, meta.world_id
                rec.global_rank = meta.rank
                rec.world_id = meta.world_id
                rec.world_size = meta.world_size
                rec.local_world_size = meta.local_world_size
                rec.shard = meta.shard
                rec.num_shards = meta.num_shards
                rec.replica = meta.replica
        if self._ranks:
            log.info("adopted the slots of ranks %s", sorted(self._ranks))
        self._hash_wake.set()

    def _open_trusted(self, path: str) -> Slot | None:
        """Maps a slot file found in shared memory, or None (refused or discarded, and why).

        Files of another user or with group/other access are left alone: not ours to trust,
        nor to delete. Our own files whose header fails its check are removed (never served).
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            self._refuse(path, f"cannot open it: {e}")
            return None
        try:
            problem = file_problem(path, fd)
            if problem is not None:
                self._refuse(path, f"not trusted ({problem}); left in place")
                return None
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            except (OSError, ValueError) as e:
                problem = f"cannot map it: {e}"
        finally:
            os.close(fd)
        if problem is None:
            try:
                return Slot(path, buf=mm, own=True)
            except ValueError as e:
                problem = str(e)
        self._refuse(path, f"discarded: {problem}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return None

    def _refuse(self, path: str, why: str) -> None:
        log.warning("slot file %s %s", path, why)
        with self._lock:
            self._refused[path] = why
            while len(self._refused) > 64:
                del self._refused[next(iter(self._refused))]

    def _remove_segments(self) -> None:
        for rec in self._ranks.values():
            for i, s in enumerate(rec.slots):
                if s is not None:
                    try:
                        s.close()
                    except (BufferError, OSError, ValueError) as e:  # a view still exported
                        log.warning("closing %s: %s (removed anyway)", s.path, e)
                    rec.slots[i] = None
        prefix = slot_prefix(self.cfg.job, self.cfg.node)
        for name in os.listdir(self.cfg.shm_dir):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.cfg.shm_dir, name))

    def _init_storage_state(self) -> None:
        assert self.storage is not None
        try:
            self._committed = self.storage.committed_steps()
            self.storage.remove_partial_steps(self._committed)  # left by an earlier agent
        except OSError as e:
            self._record_error(None, f"cannot list storage {self.storage.url}: {e}")
            return
        self._persisted_high = max(self._committed, default=-1)

    # -- server ------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._stopping.is_set():
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            sock.settimeout(None)
            conn = _Conn(sock)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve_conn, args=(conn,), name="flashckpt-agent-conn", daemon=True
            ).start()

    def _serve_conn(self, conn: _Conn) -> None:
        reader = LineReader(conn.sock)
        try:
            while True:
                msg = reader.read()
                if msg is None:
                    break
                rid = msg.get("id")
                try:
                    reply = self._handle(conn, msg)
                except (ValueError, KeyError, TypeError, OSError, ShmSpaceError) as e:
                    reply = {"ok": False, "error": str(e), "kind": type(e).__name__}
                except Exception as e:  # keep serving: one bad request must not kill the agent
                    log.exception("request %s failed", msg.get("op"))
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                if rid is not None and reply is not None:
                    conn.send({"id": rid, **reply})
        except (OSError, ValueError) as e:
            log.debug("connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                for r in conn.ranks:
                    rec = self._ranks.get(r)
                    if rec is not None and rec.conn is conn:
                        rec.conn = None
                        if not rec.done:
                            log.warning("rank %d went away without finishing", r)
            with contextlib.suppress(OSError):
                conn.sock.close()
            self._last_client_time = time.monotonic()
            self._wake.set()

    def _handle(self, conn: _Conn, msg: dict[str, Any]) -> dict[str, Any] | None:
        op = msg.get("op")
        if op == "hello":
            return self._hello(conn, msg)
        if op == "alloc":
            return self._alloc(conn, msg)
        if op == "hash":
            # A trainer about to restore from memory: every complete snapshot gets its data hash
            # now (the background pass may not have reached it yet). All positions: a trainer
            # also checks those of local ranks no trainer uses now (memory reshard). Hashes are
            # computed once (under one lock): the other trainers' requests find them recorded.
            self._hash_pass()
            return {"ok": True}
        if op == "snap":
            self._wake.set()
            self._hash_wake.set()
            if self.cfg.write_through_private:
                self._private_q.put((_key(msg), int(msg["step"])))
            return None
        if op == "restored":
            # The trainers' timeline starts at this step (-1: a fresh start, nothing restored).
            # A committed step after it is an abandoned timeline's or an older run's: this
            # run's snapshot of that number is not persisted yet, and flush() and the commit
            # loop must not take the old step for this run's.
            step = int(msg["step"])
            with self._lock:
                self._persisted_high = min(self._persisted_high, step)
                self._resumed_at = min(self._resumed_at, step)
                self._committed = [s for s in self._committed if s <= step]
            return {"ok": True}
        if op == "flush":
            return self._flush(int(msg["step"]), float(msg.get("timeout_s", 300.0)))
        if op == "done":
            with self._lock:
                rec = self._ranks.get(_key(msg))
                if rec is not None:
                    rec.done = True
            self._wake.set()
            return {"ok": True}
        if op == "status":
            return {"ok": True, **self.status()}
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        raise ValueError(f"unknown request {op!r}")

    def _hello(self, conn: _Conn, msg: dict[str, Any]) -> dict[str, Any]:
        rank = int(msg["rank"])
        key = _key(msg)
        world_size = int(msg["world_size"])
        local_world = int(msg.get("local_world_size", 1))
        if not 0 <= rank < world_size:
            raise ValueError(f"hello: rank {rank} is outside the world of {world_size}")
        if not 1 <= local_world <= MAX_LOCAL_RANKS:
            raise ValueError(
                f"hello: local world size {local_world} is outside 1..{MAX_LOCAL_RANKS}"
            )
        if not 0 <= key < max(local_world, 1) and msg.get("local_rank") is not None:
            raise ValueError(
                f"hello: local rank {key} is outside this machine's {local_world} ranks"
            )
        if not 0 <= key < MAX_LOCAL_RANKS:
            raise ValueError(f"hello: local rank {key} is outside 0..{MAX_LOCAL_RANKS - 1}")
        world_id = str(msg.get("world_id", ""))
        storage = msg.get("storage")
        with self._lock:
            if storage and self.storage is None:
                self.storage = Storage(storage, file_mode=self.cfg.storage_file_mode)
                self._init_storage_state()
            elif storage and self.storage is not None and storage != self.storage.url:
                raise ValueError(
                    f"this agent persists job {self.cfg.job!r} to {self.storage.url}, but rank "
                    f"{rank} asked for {storage}: use one storage URL per job id"
                )
            if world_id != self._world_id:
                if self._world_id is not None:
                    log.info(
                        "new world %r (was %r): rank %d is local rank %d here",
                        world_id,
                        self._world_id,
                        rank,
                        key,
                    )
                self._world_id = world_id
            rec = self._ranks.setdefault(key, _Rank(key))
            rec.global_rank = rank
            rec.world_id = world_id
            rec.world_size = world_size
            rec.local_world_size = local_world
            rec.shard = int(msg.get("shard", 0))
            rec.num_shards = int(msg.get("num_shards", 1))
            rec.replica = int(msg.get("replica", 0))
            rec.conn = conn
            rec.done = False
            conn.ranks.add(key)
            # A slot whose header fails its check is not served (the trainer would reject it,
            # every time): the trainer's alloc replaces it.
            paths = [s.path if s is not None and _header_ok(s) else None for s in rec.slots]
        return {
            "ok": True,
            "slots": paths,
            "pid": os.getpid(),
            "committed": list(self._committed),
            "shm_dir": self.cfg.shm_dir,
            # Started by a trainer (it exits when done): any trainer of the job may start the
            # next one if it dies; an agent without it belongs to a launcher or an operator.
            "auto_started": self.cfg.exit_when_done,
        }

    def _alloc(self, conn: _Conn, msg: dict[str, Any]) -> dict[str, Any]:
        rank = _key(msg)
        meta_cap, data_cap = int(msg["meta_cap"]), int(msg["data_cap"])
        if not (0 <= meta_cap <= MAX_SLOT_BYTES and 0 <= data_cap <= MAX_SLOT_BYTES):
            raise ValueError(
                f"alloc: slot sizes {meta_cap} + {data_cap} B are outside 0..{MAX_SLOT_BYTES}"
            )
        # Slots the trainer needs as they are (the newest snapshot, maybe of an older layout):
        # never replaced here, whatever their size.
        keep = {int(i) for i in msg.get("keep") or ()}
        if not keep <= {0, 1}:
            raise ValueError(f"alloc: keep={sorted(keep)} names slots other than 0 and 1")
        with self._lock:
            # Only the trainer that holds the position (said hello for it on this connection,
            # in the current world) gets its slots: a stray or stale alloc would create a
            # position no trainer fills, and persistence would wait for it forever.
            rec = self._ranks.get(rank)
            if rank not in conn.ranks or rec is None or rec.conn is not conn:
                owner = "no trainer" if rec is None or rec.conn is None else "another trainer"
                raise ValueError(
                    f"alloc for local rank {rank} refused: this connection did not say hello for "
                    f"it ({owner} holds it); a trainer allocates only its own position"
                )
            if rec.world_id != self._world_id:
                raise ValueError(
                    f"alloc for local rank {rank} refused: its trainer belongs to world "
                    f"{rec.world_id!r}, the current world is {self._world_id!r}"
                )
        paths = []
        with self._io_lock:  # never remap a slot the persister is reading
            if self._stopping.is_set():
                raise ValueError("the node agent is shutting down: no new slots")
            for i in range(2):
                s = rec.slots[i]
                if (
                    s is not None
                    and _header_ok(s)
                    and (i in keep or (s.meta_cap >= meta_cap and s.data_cap >= data_cap))
                ):
                    paths.append(s.path)
                    continue
                path = slot_path(self.cfg.shm_dir, self.cfg.job, self.cfg.node, rank, i)
                if s is not None:
                    with self._lock:  # the status and pending-step readers hold it
                        rec.slots[i] = None
                    with self._map_lock:  # never under the hasher
                        s.close()
                allocate_slot_file(path, meta_cap, data_cap)
                new = Slot(path)
                with self._lock:
                    rec.slots[i] = new
                paths.append(path)
        return {"ok": True, "slots": paths}

    def _flush(self, step: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        next_look = 0.0
        self._wake.set()
        while time.monotonic() < deadline:
            with self._lock:
                if self.storage is None:
                    return {"ok": False, "error": "no storage configured: nothing to flush to"}
                if any(s >= step for s in self._committed):
                    return {"ok": True, "committed": max(self._committed)}
                errs = [e for e in self._errors if e["step"] is not None and e["step"] >= step]
            if errs:
                return {"ok": False, "error": errs[-1]["error"]}
            if time.monotonic() >= next_look:
                # Another node's agent commits steps whose rank 0 it hosts: look at storage.
                next_look = time.monotonic() + 0.25
                with contextlib.suppress(OSError):
                    if self.storage.fs.exists(self.storage.step_path(step, MANIFEST)):
                        with self._lock:
                            self._committed = sorted({*self._committed, step})
                        continue
            time.sleep(0.02)
        return {"ok": False, "error": f"step {step} was not committed within {timeout:.0f} s"}

    def status(self) -> dict[str, Any]:
        with self._lock:
            ranks = {}
            for r, rec in sorted(self._ranks.items()):
                steps = []
                for s in rec.slots:
                    info = s.header() if s is not None else None
                    steps.append(info.step if info is not None and info.complete else None)
                ranks[str(r)] = {
                    "rank": rec.global_rank,
                    "world_id": rec.world_id,
                    "connected": rec.conn is not None,
                    "done": rec.done,
                    "slots": steps,
                }
            return {
                "job": self.cfg.job,
                "node": self.cfg.node,
                "pid": os.getpid(),
                "storage": self.storage.url if self.storage else None,
                "committed": list(self._committed),
                "committing": sorted(self._commits),
                "world_id": self._world_id,
                "errors": list(self._errors[-10:]),
                "shard_writes": dict(self._shard_writes),
                "refused_slots": dict(self._refused),
                "corrupt_snapshots": [
                    {"slot": p, "seq": q, "step": st} for (p, q), st in self._corrupt.items()
                ],
                "ranks": ranks,
                "monitor": self.monitor.summary() if self.monitor is not None else None,
            }

    def _broadcast(self, event: dict[str, Any]) -> None:
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.send(event)

    def _record_error(self, step: int | None, error: str) -> None:
        log.error("persist step %s failed: %s", step, error)
        with self._lock:
            self._errors.append({"step": step, "error": error, "time": time.time()})
            del self._errors[:-50]
        self._broadcast({"event": "persist_error", "step": step, "error": error})

    # -- persistence -------------------------------------------------------------------------
    def _persist_loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.cfg.poll_interval)
            self._wake.clear()
            if self._stopping.is_set() or self.storage is None:
                continue
            if time.monotonic() < self._retry_after:
                continue
            try:
                pending = self._pending_step()
                if pending is not None:
                    self._persist(*pending)
            except Exception as e:  # the daemon lives on; the error is reported
                self._record_error(pending[0] if pending else None, f"{type(e).__name__}: {e}")
                self._retry_after = time.monotonic() + self.cfg.retry_interval

    def _hash_loop(self) -> None:
        while not self._stopping.is_set():
            self._hash_wake.wait(self.cfg.poll_interval)
            self._hash_wake.clear()
            if self._stopping.is_set():
                break
            try:
                self._hash_pass()
            except Exception:  # the daemon lives on
                log.exception("hashing snapshots failed")

    def _hash_pass(self, rank: int | None = None) -> None:
        """Records the data hash of every complete snapshot (of one position) lacking one."""
        with self._lock:
            slots = [
                s
                for r in self._ranks.values()
                if rank is None or r.rank == rank
                for s in r.slots
                if s is not None
            ]
        for s in slots:
            self._ensure_hash(s)

    def _ensure_hash(self, slot: Slot, info: SlotInfo | None = None) -> int | None:
        """The data hash of the slot's complete snapshot (``info``'s, if given), computed and
        recorded now if missing; None if the slot holds no such snapshot (any more)."""
        with self._map_lock:
            try:
                now = slot.header()
                if now is None or not now.complete or (info is not None and now != info):
                    return None
                have = slot.recorded_hash(now)
                if have is not None:
                    return have
                value = slot.data_hash(now)
                if slot.seq() != now.seq:
                    return None  # rewritten while hashed
                slot.record_hash(now.seq, value)
                return value
            except ValueError:  # unmapped (replaced) meanwhile
                return None

    def _private_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                rank, step = self._private_q.get(timeout=0.2)
            except queue.Empty:
                continue
            storage = self.storage
            if storage is None or step <= max(self._committed, default=-1):
                continue  # committed, or never will be: a write would leave a partial step
            with self._lock:
                rec = self._ranks.get(rank)
                slots = [s for s in (rec.slots if rec else []) if s is not None]
            for slot in slots:
                try:
                    info = slot.header()
                    ok = info is not None and info.complete and info.step == step
                    meta = _read_meta(slot, info) if ok and info is not None else None
                except ValueError:  # the slot was just reallocated (closed): the snapshot is gone
                    break
                if not ok:
                    continue
                if meta is None:
                    break
                try:
                    storage.write_private(step, meta.rank, meta.world_size, meta.private)
                except Exception as e:  # reported; the big persist path retries later
                    self._record_error(step, f"writing rank {rank} state: {e}")
                break

    def _pending_step(self) -> tuple[int, dict[int, tuple[int, SlotInfo]]] | None:
        """The newest step every local rank holds complete and storage lacks, with its slots."""
        if self.storage is None:
            return None  # memory only: nothing is ever pending
        with self._lock:
            # Positions whose trainer belongs to an older world (a rank this node no longer
            # runs after a membership change) are left out: they would stall persistence.
            ranks = [
                r
                for r in self._ranks.values()
                if any(s is not None for s in r.slots) and r.world_id == self._world_id
            ]
            if not ranks:
                return None
            expected = max(r.local_world_size for r in ranks)
            if len(ranks) < expected:
                return None
            per_rank: dict[int, dict[int, tuple[int, SlotInfo]]] = {}
            for rec in ranks:
                have: dict[int, tuple[int, SlotInfo]] = {}
                for i, s in enumerate(rec.slots):
                    info = s.header() if s is not None else None
                    # A snapshot of another world (taken before the position changed hands)
                    # is not part of this world's steps.
                    if (
                        s is not None
                        and info is not None
                        and info.complete
                        and (s.path, info.seq) not in self._corrupt
                        and self._snap_world(s, info) == rec.world_id
                    ):
                        have[info.step] = (i, info)
                per_rank[rec.rank] = have
            common = set.intersection(*(set(h) for h in per_rank.values()))
            common = {s for s in common if s > self._persisted_high}
            if not common:
                return None
            step = max(common)
            return step, {r: have[step] for r, have in per_rank.items()}

    def _persist(self, step: int, picks: dict[int, tuple[int, SlotInfo]]) -> None:
        storage = self.storage
        assert storage is not None
        t0 = time.monotonic()
        files: dict[str, FileEntry] = {}
        ranks_out: dict[int, RankEntry] = {}
        shards_out: dict[int, ShardEntry] = {}
        world = num_shards = 0
        written = 0
        with self._io_lock:
            slots: dict[int, tuple[Slot, SlotInfo]] = {}
            with self._lock:
                for r, (idx, info) in picks.items():
                    s = self._ranks[r].slots[idx]
                    if s is None:
                        return
                    slots[r] = (s, info)
            metas: dict[int, SnapshotMeta] = {}
            for s, info in slots.values():
                s.pin(info.seq)
            try:
                for r, (s, info) in slots.items():
                    meta = _read_meta(s, info)
                    if meta is None or meta.step != step:
                        raise _Torn(f"rank {r}")
                    metas[r] = meta
                hosts_rank0 = any(m.rank == 0 for m in metas.values())
                world_id = next(iter(metas.values())).world_id if metas else ""
                if hosts_rank0 and step > self._resumed_at:
                    # Only the committing node (it hosts rank 0) hides a step it will rewrite;
                    # the other nodes' parts are rewritten under the hidden step.
                    storage.uncommit(step)
                for r, (s, info) in slots.items():
                    meta = metas[r]
                    g, world, num_shards = meta.rank, meta.world_size, meta.num_shards
                    rank_name = rank_file_name(g, world)
                    rec = storage.write_private(step, g, world, meta.private)
                    files[rank_name] = FileEntry(rec.size, rec.xxh3_64)
                    ranks_out[g] = RankEntry(rank_name, meta.shard)
                    if meta.replica != 0:
                        continue
                    shard_name = shard_file_name(meta.shard, num_shards)
                    want = self._ensure_hash(s, info)
                    if want is None:
                        raise _Torn(f"rank {r}")
                    rec = self._write_shard(storage, step, shard_name, s, info, meta)
                    # The bytes written must be the ones hashed when the snapshot completed: a
                    # scribbled slot is never committed (one more read of the data, at memory
                    # speed, against a write at storage speed).
                    got = s.data_hash(info)
                    if s.seq() != info.seq:
                        raise _Torn(f"shard {shard_name}")
                    if got != want:
                        with self._lock:
                            self._corrupt[(s.path, info.seq)] = step
                        raise _Scribbled(
                            f"rank {g} (local rank {r}) step {step}: the data in {s.path} no "
                            f"longer matches its hash (shared memory was overwritten); the "
                            f"step is not committed"
                        )
                    written += rec.size
                    files[shard_name] = FileEntry(rec.size, rec.xxh3_64)
                    shards_out[meta.shard] = ShardEntry(shard_name, g)
            except _Torn as e:
                log.info("step %d changed in memory while persisting (%s); skipped", step, e)
                with self._lock:
                    self._persisted_high = max(self._persisted_high, step)
                return
            except _Scribbled as e:
                with self._lock:
                    self._persisted_high = max(self._persisted_high, step)
                self._record_error(step, str(e))
                return
            finally:
                for s, _ in slots.values():
                    s.unpin()
        part = NodePart(
            node=self.cfg.node,
            step=step,
            world_id=world_id,
            world_size=world,
            num_shards=num_shards,
            ranks=ranks_out,
            shards=shards_out,
            files=files,
        )
        storage.write_part(step, self.cfg.node, part.to_json())
        with self._lock:
            self._persisted_high = max(self._persisted_high, step)
        self._yields = 0
        if hosts_rank0:
            # Committed by the commit thread once every node's part is in: persistence of newer
            # steps goes on meanwhile (a step whose parts never arrive, because a machine died,
            # no longer blocks it).
            with self._lock:
                self._commits[step] = (
                    world,
                    num_shards,
                    world_id,
                    time.monotonic() + self.cfg.commit_timeout,
                )
            self._commit_wake.set()
        dt = time.monotonic() - t0
        log.info(
            "persisted step %d: %.1f MiB in %.2f s (%.0f MiB/s)",
            step,
            written / 2**20,
            dt,
            written / 2**20 / max(dt, 1e-9),
        )

    def _write_shard(
        self,
        storage: Storage,
        step: int,
        name: str,
        slot: Slot,
        info: SlotInfo,
        meta: SnapshotMeta,
    ) -> FileRecord:
        header = safetensors_header(
            meta.layout,
            {
                "format": FORMAT,
                "step": str(step),
                "skeleton": json.dumps(meta.skeleton, separators=(",", ":")),
            },
            # The slot's data region is page-aligned: with a header of whole pages the tensor
            # bytes land at page-aligned file offsets too, so a local file is written with
            # O_DIRECT straight from the slot (no page-cache copy).
            align=4096,
        )
        data = slot.data(info.data_len)

        def check() -> None:
            if slot.seq() != info.seq:
                raise _Torn(f"shard {name}")
            if slot.wanted() and self._yields < 2:
                # The trainer waits for this slot and already holds a newer snapshot: let it
                # have the slot and persist the newer one next (at most twice in a row, so
                # persistence cannot starve).
                self._yields += 1
                raise _Torn(f"shard {name}: yielded to the trainer")

        rec = storage.write_buffer(storage.step_path(step, name), header, data, check)
        if slot.seq() != info.seq:
            raise _Torn(f"shard {name}")
        with self._lock:
            self._shard_writes["direct" if rec.direct else "buffered"] += 1
        return rec

    def _commit_loop(self) -> None:
        while not self._stopping.is_set():
            self._commit_wake.wait(0.1)
            self._commit_wake.clear()
            if self._stopping.is_set():
                break
            self._commit_round()

    def _drain_commits(self, timeout: float) -> None:
        """At shutdown: commits what can still be committed within ``timeout``."""
        deadline = time.monotonic() + timeout
        while self._commits and time.monotonic() < deadline:
            self._commit_round(final=True)
            if self._commits:
                time.sleep(0.1)
        with self._lock:
            for step in sorted(self._commits):
                log.warning("step %d not committed at shutdown: parts missing", step)
            self._commits.clear()

    def _commit_round(self, final: bool = False) -> None:
        """One look at every step waiting for its commit; commits those whose parts are in."""
        with self._lock:
            waiting = sorted(self._commits.items())
        for step, (world, num_shards, world_id, deadline) in waiting:
            try:
                done = self._try_commit(step, world, num_shards, world_id)
            except Exception as e:
                self._record_error(step, f"commit failed: {type(e).__name__}: {e}")
                done = True
            with self._lock:
                newest = max(self._committed, default=-1)
                if not done and newest > step:
                    log.info("step %d dropped: newer step %d is committed", step, newest)
                    done = True
                if not done and time.monotonic() > deadline and not final:
                    missing = self._commit_missing.get(step, [])
                    done = True
                    err = (
                        f"step {step}: parts of ranks {missing} did not arrive within "
                        f"{self.cfg.commit_timeout:.0f} s; not committed"
                    )
                else:
                    err = None
                if done:
                    self._commits.pop(step, None)
                    self._commit_missing.pop(step, None)
            if err:
                self._record_error(step, err)

    def _try_commit(self, step: int, world: int, num_shards: int, world_id: str) -> bool:
        storage = self.storage
        assert storage is not None
        if step in self._committed:
            return True
        # Parts of other worlds (a step number reached again after a membership change, with a
        # dead machine's old part still there) are never mixed into this world's manifest. A
        # part of this world that fails its checks stops the commit (reported): it names files
        # readers would reject, or it is not what an agent writes.
        src = storage.step_path(step, PARTS)
        parts = [
            NodePart.from_json(p, f"{src} (the part of node {str(p.get('node'))[:64]!r})")
            for p in storage.read_parts(step)
            if p.get("world_id", "") == world_id
        ]
        ranks: dict[str, Any] = {}
        shards: dict[str, Any] = {}
        files: dict[str, Any] = {}
        for p in parts:
            if p.world_size != world or p.step != step:
                continue
            doc = p.to_json()
            ranks.update(doc["ranks"])
            shards.update(doc["shards"])
            files.update(doc["files"])
        if len(ranks) < world or len(shards) < num_shards:
            with self._lock:
                self._commit_missing[step] = sorted(set(range(world)) - {int(r) for r in ranks})
            return False
        manifest = {
            "format": FORMAT,
            "job": self.cfg.job,
            "step": step,
            "world_size": world,
            "num_shards": num_shards,
            "created": time.time(),
            "nodes": sorted(p.node for p in parts),
            "files": files,
            "ranks": ranks,
            "shards": shards,
        }
        storage.commit(step, manifest)
        removed = storage.retain(self.cfg.keep)
        with self._lock:
            self._committed = sorted({*self._committed, step} - set(removed))
        self._broadcast({"event": "committed", "step": step})
        return True

    def _snap_world(self, slot: Slot, info: SlotInfo) -> str | None:
        """The world id a complete snapshot was taken in (cached per slot generation)."""
        # The sequence number alone does not name a snapshot: a slot file that was replaced
        # (a bigger state) starts counting again.
        tag = (info.seq, info.step, info.meta_crc)
        cached = self._snap_worlds.get(slot.path)
        if cached is not None and cached[0] == tag:
            return cached[1]
        meta = _read_meta(slot, info)
        world = meta.world_id if meta is not None else None
        if meta is not None:
            self._snap_worlds[slot.path] = (tag, world)
        return world


def _key(msg: dict[str, Any]) -> int:
    """The rank record a request is about: the local rank (older clients send only the rank)."""
    return int(msg["local_rank"]) if msg.get("local_rank") is not None else int(msg["rank"])


_GROUP_RE = names.GROUP_NAME_RE


@dataclass(frozen=True, slots=True)
class SegmentGroup:
    """The shared-memory files of one job's agent on one node (slots, rings, owner file)."""

    key: tuple[str, str]
    """(job, node)."""
    paths: tuple[str, ...]
    """The files (all owned by this user)."""
    nbytes: int
    """Their total size."""
    age_s: float
    """Seconds since the newest of them was modified."""
    reason: str
    """Why the group counts as abandoned."""

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("a segment group has at least one file")

    def remove(self) -> int:
        """Unlinks the files; returns how many were removed."""
        n = 0
        for p in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
                n += 1
        return n


def abandoned_segments(
    shm_dir: str, older_than: float, skip: tuple[str, str] | None = None
) -> list[SegmentGroup]:
    """The segment groups in ``shm_dir`` whose agent is dead and that nothing modified for
    ``older_than`` seconds. Files of other users are never listed (not ours to remove).

    Args:
        shm_dir: the tmpfs of the slots.
        older_than: least age in seconds (0: every dead agent's segments).
        skip: a (job, node) never listed (the caller's own).
    """
    groups: dict[tuple[str, str], list[tuple[str, os.stat_result]]] = {}
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    for name in entries:
        m = _GROUP_RE.match(name)
        if not m:
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != os.geteuid():
            continue
        groups.setdefault((m.group(1), m.group(2)), []).append((path, st))
    out = []
    now = time.time()
    for key, files in sorted(groups.items()):
        if key == skip:
            continue
        owner = names.owner_path(shm_dir, key[0], key[1])
        if _owner_alive(owner):
            continue
        age = now - max(st.st_mtime for _, st in files)
        if age < older_than:
            continue
        why = "no owner file" if not os.path.exists(owner) else "its agent is dead"
        out.append(
            SegmentGroup(
                key=key,
                paths=tuple(sorted(p for p, _ in files)),
                nbytes=sum(st.st_size for _, st in files),
                age_s=age,
                reason=f"{why}, unchanged for {age / 3600:.1f} h",
            )
        )
    return out


def _owner_alive(owner_path: str) -> bool:
    try:
        with open(owner_path) as f:
            owner = json.load(f)
        proc = psutil.Process(int(owner["pid"]))
        return abs(proc.create_time() - float(owner["create_time"])) < 1.0
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return False


def run_agent(config: AgentConfig, *, signals: bool = True, lock_wait: float = 0.0) -> int:
    """Runs an agent in this process until it stops; returns the exit code (3: one already runs)."""
    # Persisting is background work: leave the cores and the disk queue to training first. Both
    # settings are per thread on Linux and threads inherit them, so this comes before the agent
    # starts any. Lowering one's own priority needs no privilege; where it fails, run as is.
    import ctypes
    import platform

    with contextlib.suppress(OSError, AttributeError):
        if os.getpriority(os.PRIO_PROCESS, 0) < 10:
            os.setpriority(os.PRIO_PROCESS, 0, 10)
    ioprio_set = {"x86_64": 251, "aarch64": 30, "riscv64": 30}  # syscall numbers
    nr = ioprio_set.get(platform.machine())
    if nr is not None:
        with contextlib.suppress(OSError, AttributeError):
            # ioprio_set(IOPRIO_WHO_PROCESS, this thread, best-effort class, lowest level 7)
            ctypes.CDLL(None, use_errno=True).syscall(nr, 1, 0, (2 << 13) | 7)
    agent = NodeAgent(config)
    if signals:
        # Before start(): a SIGTERM that comes once the socket exists must stop it cleanly.
        agent.install_signal_handlers()
    try:
        agent.start(lock_wait=lock_wait)
    except AgentRunning as e:
        log.info("%s", e)
        return 3
    return agent.run()
