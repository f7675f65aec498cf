"""The node agent's socket server: accepts trainers on a local Unix socket (mode 0600), reads one
JSON message per line, validates it (:func:`flashckpt.protocol.messages.parse_request`, the one
check of what comes from the socket) and dispatches the typed request; one bad request gets an error
reply, never takes the agent down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from flashckpt.agent.persist import Persister
from flashckpt.agent.replicas.holder import Replicator
from flashckpt.agent.replicas.pull import Puller
from flashckpt.agent.segments import Segments
from flashckpt.agent.state import AgentState, Conn, RankRecord, header_ok
from flashckpt.errors import ProtocolError, ShmSpaceError
from flashckpt.format.storage import MANIFEST, Storage
from flashckpt.format.storage_owner import Foreign, claim_root, delete_steps, foreign_owner
from flashckpt.protocol.channel import LineReader, socket_path
from flashckpt.protocol.messages import (
    Alloc,
    ClaimStorage,
    ClaimStorageReply,
    Done,
    ErrorReply,
    Fence,
    Flush,
    FlushReply,
    Hash,
    Hello,
    HelloReply,
    OkReply,
    Ping,
    PingReply,
    PullReplica,
    ReplicaPeers,
    ReplicaPeersReply,
    Reply,
    Request,
    Restored,
    Snap,
    Status,
    StatusReply,
    parse_request,
    request_id,
)

__all__ = ["Server"]

log = logging.getLogger("flashckpt.agent.daemon")

FLUSH_WAIT_S = 1.0
"""The longest a flush sleeps between two looks when nothing notifies it (a safety net: the
commit and a persist error wake it at once)."""


class Server:
    """Serves the trainers' requests on the agent's socket."""

    def __init__(
        self,
        state: AgentState,
        segments: Segments,
        persister: Persister,
        status: Callable[[], dict[str, Any]],
    ) -> None:
        self.st = state
        self.segments = segments
        self.persister = persister
        self.status = status
        """The agent's status (answers ``status``)."""
        cfg = state.cfg
        self.socket_path = socket_path(cfg.run_dir, cfg.job, cfg.node)
        self.server: socket.socket | None = None
        self.replicator: Replicator | None = None
        """The agent's replicas (set by the agent; answers ``replica_peers``)."""
        self.puller = Puller(state, lambda: self.replica_peers())
        """Serves ``pull_replica`` (a peer agent's replica into a trainer's slot)."""
        self.replica_peers: Callable[[], Mapping[str, tuple[str, int]]] = (
            state.cfg.replica_peer_addrs
        )
        """The peer agents' replica servers a pull asks (node id -> host, port); by default the
        configured ``--replica-peers``. Where the peer list changes at run time, the agent points
        it at its replicator's current list (``lambda: dict(replicator.peers)``)."""

    def listen(self) -> None:
        """Binds the socket (mode 0600, whatever the umask) and listens."""
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
        # A blocking accept: the accept thread sleeps until a trainer connects, and close()
        # wakes it (no timeout to look at the stop flag five times a second).
        srv.settimeout(None)
        self.server = srv

    def close(self) -> None:
        """Stops listening (the connections are closed with the segments, see NodeAgent): a
        shutdown of the listening socket ends an accept that waits (Linux answers it EINVAL;
        closing the socket alone would leave it waiting), then the socket is closed."""
        if self.server is not None:
            with contextlib.suppress(OSError):
                self.server.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self.server.close()

    def accept_loop(self) -> None:
        assert self.server is not None
        while not self.st.stopping.is_set():
            try:
                sock, _ = self.server.accept()
            except OSError:  # shut down (the agent stops)
                break
            if self.st.stopping.is_set():
                sock.close()
                break
            sock.settimeout(None)
            conn = Conn(sock)
            with self.st.lock:
                self.st.conns.add(conn)
            threading.Thread(
                target=self.serve_conn, args=(conn,), name="flashckpt-agent-conn", daemon=True
            ).start()

    def serve_conn(self, conn: Conn) -> None:
        reader = LineReader(conn.sock)
        try:
            while True:
                msg = reader.read()
                if msg is None:
                    break
                rid = request_id(msg)
                try:
                    env = parse_request(msg)  # the one check of what came from the socket
                    rid = env.rid
                    reply = self.handle(conn, env.body)
                except (ValueError, KeyError, TypeError, OSError, ShmSpaceError) as e:
                    reply = ErrorReply(error=str(e), kind=type(e).__name__)
                except Exception as e:  # keep serving: one bad request must not kill the agent
                    log.exception("request %s failed", msg.get("op"))
                    reply = ErrorReply(error=f"{type(e).__name__}: {e}")
                if rid is not None and reply is not None:
                    conn.send(reply.to_json(rid))
                elif isinstance(reply, ErrorReply):
                    # A one-way message (no id) that failed: nobody to tell but the log.
                    log.warning("message %s refused: %s", str(msg.get("op"))[:64], reply.error)
        except ProtocolError as e:  # unreadable at the framing level (nested too deeply)
            log.warning("connection closed: %s", e)
        except (OSError, ValueError) as e:
            log.debug("connection ended: %s", e)
        finally:
            with self.st.lock:
                self.st.conns.discard(conn)
                for r in conn.ranks:
                    rec = self.st.ranks.get(r)
                    if rec is not None and rec.conn is conn:
                        rec.conn = None
                        if not rec.done:
                            log.warning("rank %d went away without finishing", r)
            with contextlib.suppress(OSError):
                conn.sock.close()
            self.st.last_client_time = time.monotonic()
            self.st.wake.set()

    def handle(self, conn: Conn, req: Request) -> Reply | None:
        match req:
            case Fence():
                return self.fence(req)
            case Snap() if self.persister.committer.fenced is not None:
                return None  # a dying trainer of the fenced world: nothing of it is written
            case Hello():
                hello = self.hello(conn, req)
                # A position taken, maybe a new world, storage or fence lifted: what is due to
                # persist, hash or replicate may have changed, and no snapshot says so.
                self.st.wake_all()
                return hello
            case Alloc():
                alloc = self.segments.alloc(conn, req)
                self.st.wake_all()  # slots replaced: a look at what is due (rare, cheap)
                return alloc
            case Hash():
                # A trainer about to restore from memory: every complete snapshot gets its data
                # hash now (the background pass may not have reached it yet). All positions: a
                # trainer also checks those of local ranks no trainer uses now (memory reshard).
                # Hashes are computed once (under one lock): the other trainers' requests find
                # them recorded.
                self.persister.hash_pass()
                return OkReply()
            case Snap():
                self.st.wake.set()
                self.st.hash_wake.set()
                if self.st.cfg.write_through_private:
                    self.st.private_q.put((req.key, req.step))
                return None
            case Restored():
                if not conn.ranks:
                    raise ValueError(
                        "restored refused: this connection did not say hello for any position; "
                        "only a trainer of the job tells where its timeline starts"
                    )
                # The trainers' timeline starts at this step (-1: a fresh start, nothing
                # restored). A committed step after it is an abandoned timeline's or an older
                # run's: this run's snapshot of that number is not persisted yet, and flush() and
                # the commit loop must not take the old step for this run's.
                with self.st.lock:
                    self.st.persisted_high = min(self.st.persisted_high, req.step)
                    self.st.resumed_at = min(self.st.resumed_at, req.step)
                    self.st.committed = [s for s in self.st.committed if s <= req.step]
                self.st.wake.set()  # a snapshot in memory may be due again
                return OkReply()
            case Flush():
                return self.flush(req.step, req.timeout_s)
            case Done():
                with self.st.lock:
                    rec = self.st.ranks.get(req.key)
                    if req.key not in conn.ranks or rec is None or rec.conn is not conn:
                        # As alloc: only the trainer holding the position finishes it (a stray
                        # done would let an auto-started agent exit under a live trainer).
                        owner = "no trainer" if rec is None or rec.conn is None else "another"
                        raise ValueError(
                            f"done for local rank {req.key} refused: this connection did not "
                            f"say hello for it ({owner} holds it)"
                        )
                    rec.done = True
                self.st.wake.set()
                return OkReply()
            case Status():
                return StatusReply(status=self.status())
            case Ping():
                return PingReply(pid=os.getpid())
            case ReplicaPeers():
                return self.set_replica_peers(req)
            case PullReplica():
                return self.puller.pull(conn, req)
            case ClaimStorage():
                return self.claim_storage(req)
        raise ProtocolError(f"request {req.op!r} has no handler")  # REQUESTS and this differ

    def fence(self, req: Fence) -> Reply:
        """Commits and persists nothing more until a trainer of a new world says hello.

        The current world is forgotten (``world_id`` None: no position matches it, so nothing
        is persisted, not even the newest snapshot of the trainers about to die, "save at
        breakpoint"), the steps waiting for their commit are dropped, and the answer waits for a
        persist in flight to end, so that once the launcher has it nothing of the old world is
        being written.
        """
        committer = self.persister.committer
        with self.st.lock:
            committer.fence(req.reason or "asked by the launcher")
            self.st.world_id = None
        idle = self.st.io_lock.acquire(timeout=req.timeout_s)
        if idle:
            self.st.io_lock.release()
        else:
            log.warning("fenced while a persist of the old world is still in flight")
        # What the persist in flight queued is dropped too (enqueue refuses while fenced).
        committer.fence(req.reason or "asked by the launcher")
        return OkReply()

    def _check_fence(self, msg: Hello) -> None:
        """Refuses a trainer of the fenced world; a trainer of a new world lifts the fence."""
        committer = self.persister.committer
        with self.st.lock:
            if committer.fenced is None:
                return
            stale = msg.world_id == committer.fenced_world
        if stale:
            raise ValueError(
                f"this node agent is fenced ({committer.fenced}): world {msg.world_id!r} lost "
                "its place in the job; its trainers must stop (the launcher restarts them in a "
                "new world)"
            )
        committer.unfence(msg.world_id)

    def hello(self, conn: Conn, msg: Hello) -> HelloReply:
        self._check_fence(msg)
        rank, key, world_size = msg.rank, msg.key, msg.world_size
        local_world, world_id, storage = msg.local_world_size, msg.world_id, msg.storage
        with self.st.lock:
            if storage and self.st.storage is None:
                self.st.storage = Storage(storage, file_mode=self.st.cfg.storage_file_mode)
                self.persister.init_storage_state()
                self.persister.owe_adopted()  # before this hello records its (new) world
            elif storage and self.st.storage is not None and storage != self.st.storage.url:
                raise ValueError(
                    f"this agent persists job {self.st.cfg.job!r} to {self.st.storage.url}, but "
                    f"rank {rank} asked for {storage}: use one storage URL per job id (pass "
                    "the agent's as storage=, or none: the trainer then checks the agent's root "
                    "as this job's at entry)"
                )
            if world_id != self.st.world_id:
                if self.st.world_id is not None:
                    log.info(
                        "new world %r (was %r): rank %d is local rank %d here",
                        world_id,
                        self.st.world_id,
                        rank,
                        key,
                    )
                self.st.world_id = world_id
            rec = self.st.ranks.setdefault(key, RankRecord(key))
            held = rec.conn
            if (
                held is not None
                and held is not conn
                and held in self.st.conns
                and not rec.done
                and rec.world_id == world_id
                and held.peer_pid != conn.peer_pid
                and held.peer_alive()
            ):
                # A live trainer of this world holds the position on another connection: a
                # second hello would take its slots from under it (a dead trainer's connection
                # is gone; a new world's trainer replaces a stale one).
                raise ValueError(
                    f"hello for local rank {key} refused: a trainer of world {world_id!r} holds "
                    "it on another connection; one trainer per position (is a second trainer "
                    "of the same rank running?)"
                )
            rec.global_rank = rank
            rec.world_id = world_id
            rec.world_size = world_size
            rec.local_world_size = local_world
            rec.shard = msg.shard
            rec.num_shards = msg.num_shards
            rec.replica = msg.replica
            rec.conn = conn
            rec.done = False
            conn.ranks.add(key)
            # A slot whose header fails its check is not served (the trainer would reject it,
            # every time): the trainer's alloc replaces it.
            paths = [s.path if s is not None and header_ok(s) else None for s in rec.slots]
            committed = list(self.st.committed)
            root = self.st.storage
        steps, foreign = (None, None) if storage else self._own_root(root)
        return HelloReply(
            slots=paths,
            pid=os.getpid(),
            committed=committed,
            shm_dir=self.st.cfg.shm_dir,
            # Started by a trainer (it exits when done): any trainer of the job may start the
            # next one if it dies; an agent without it belongs to a launcher or an operator.
            auto_started=self.st.cfg.exit_when_done,
            storage=root.url if root is not None else None,
            storage_steps=steps,
            storage_foreign=foreign,
        )

    def _own_root(self, root: Storage | None) -> tuple[list[int] | None, str | None]:
        """What a trainer without ``storage=`` checks of this agent's own root at entry, as it
        checks its own ``storage=`` (issue 30: a job's state is its own), looked at here because
        the trainer may not be able to open it (the agent's mount namespace, its credentials):
        the committed steps there, and the refusal when the root belongs to another job
        (:func:`~flashckpt.format.storage_owner.foreign_owner`). A root that cannot be looked
        at is named in the refusal, never taken for free."""
        if root is None:
            return None, None
        job = self.st.cfg.job
        try:
            steps = root.committed_steps()
        except OSError:
            steps = []  # no root yet (or failing: the persister reports that)
        try:
            found = foreign_owner(root, job)
        except Exception as e:  # any backend's failure reading the owner file
            return steps, (
                f"storage {root.url} could not be checked for another job's steps or owner "
                f"file ({type(e).__name__}: {e}): fix the root, or pass takeover=True if it "
                "is this job's"
            )
        return steps, _refusal(found, root, job)

    def claim_storage(self, req: ClaimStorage) -> ClaimStorageReply:
        """Takes this agent's root for its job (see :class:`ClaimStorage`): with
        ``delete_steps`` deletes its steps first (no persist in flight meanwhile; the agent then
        knows of no committed step), then takes the root: with ``takeover`` (or
        ``delete_steps``) the owner file is rewritten for the job, else created only where none
        is (:func:`~flashckpt.format.storage_owner.claim_root`, atomic: another job's trainers
        entering at the same instant through their own agent get the refusal in ``foreign``). A
        failure to write is reported, not raised."""
        root = self.st.storage
        if root is None:
            raise ProtocolError("claim_storage: this agent has no storage")
        deleted: list[int] = []
        if req.delete_steps:
            with self.st.io_lock:
                deleted = delete_steps(root)
                with self.st.lock:
                    self.persister.init_storage_state()
            log.warning(
                "overwrite=True: deleted steps %s of an earlier run from %s", deleted, root.url
            )
        owner_error = foreign = None
        job = self.st.cfg.job
        try:
            found = claim_root(root, job, takeover=req.takeover or req.delete_steps)
        except Exception as e:  # any backend's failure
            owner_error = f"{type(e).__name__}: {e}"
        else:
            foreign = _refusal(found, root, job)
        return ClaimStorageReply(deleted=deleted, owner_error=owner_error, foreign=foreign)

    def set_replica_peers(self, req: ReplicaPeers) -> ReplicaPeersReply:
        """The launcher's peer list of the new world (see :meth:`Replicator.set_peers`)."""
        rep = self.replicator
        if rep is None:
            raise ProtocolError("replica_peers: this agent has no replication")
        try:
            targets = rep.set_peers(req.addresses())
        except ValueError as e:  # e.g. this machine's own node: refused, nothing changed
            raise ProtocolError(f"replica_peers: {e}") from None
        server = rep.server
        listen = "{}:{}".format(*server.address) if server is not None else None
        return ReplicaPeersReply(listen=listen, targets=targets)

    def flush(self, step: int, timeout: float) -> Reply:
        with self.st.lock:
            self.st.flush_waiting += 1
        try:
            return self._flush(step, timeout)
        finally:
            with self.st.lock:
                self.st.flush_waiting -= 1

    def _flush(self, step: int, timeout: float) -> Reply:
        deadline = time.monotonic() + timeout
        next_look = 0.0
        self.st.wake.set()
        while True:
            with self.st.lock:
                if self.st.storage is None:
                    return ErrorReply(error="no storage configured: nothing to flush to")
                if any(s >= step for s in self.st.committed):
                    return FlushReply(committed=max(self.st.committed))
                errs = [e for e in self.st.errors if e["step"] is not None and e["step"] >= step]
            if errs:
                return ErrorReply(error=errs[-1]["error"])
            here = self.st.commits_here()
            if time.monotonic() >= next_look and not here:
                # Another node's agent commits steps whose rank 0 it hosts: look at storage.
                # Never on the committing node itself: a manifest there may be an abandoned
                # timeline's (or one this agent is about to rewrite, after a restored message
                # set the timeline back), and taking it for committed made the rewrite's
                # commit a no-op (storage ended older than what flush had answered).
                next_look = time.monotonic() + 0.25
                with contextlib.suppress(OSError):
                    if self.st.storage.fs.exists(self.st.storage.step_path(step, MANIFEST)):
                        with self.st.lock:
                            self.st.committed = sorted({*self.st.committed, step})
                        continue
            now = time.monotonic()
            if now >= deadline:
                break
            # Asleep until the commit or an error is recorded (both notify ``progress``), the
            # next look at storage, or FLUSH_WAIT_S (a safety net): no loop of short sleeps.
            wait = min(deadline - now, FLUSH_WAIT_S)
            if not here:
                wait = min(wait, next_look - now)
            with self.st.lock:  # looked at again under the lock: no notify is missed
                if not any(s >= step for s in self.st.committed) and not any(
                    e["step"] is not None and e["step"] >= step for e in self.st.errors
                ):
                    self.st.progress.wait(max(0.0, wait))
        return ErrorReply(error=f"step {step} was not committed within {timeout:.0f} s")


def _refusal(found: Foreign | None, root: Storage, job: str) -> str | None:
    """The refusal a trainer without ``storage=`` gets for the agent's root (None: it is the
    job's): its steps cannot be read back by such a trainer, so a takeover over them deletes
    them (``overwrite=True``)."""
    if found is None:
        return None
    if found.newest is None:
        return found.refusal("storage", root.url, job, "takeover=True")
    take = "takeover=True with overwrite=True"
    return found.refusal("storage", root.url, job, take, resume=False)
