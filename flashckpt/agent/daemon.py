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
  10.2 GB/s copy measured here); a shard is written from the slot hashing its data once more,
  each chunk after it was written, and a step whose data hash differs from the recorded one
  (memory scribbled) or whose slot's seqlock moved (a trainer rewrote it) is never committed;
  the manifest keeps that data hash (trainers check the slot's on a restore from memory);
* keeps its background work out of training's way: the hash and persist threads run at a low
  CPU and IO priority, in 16 MiB chunks, pausing (briefly, boundedly) while a trainer copies;

The agent moves bytes: it does no tensor work and never imports torch (it would cost about 2 s
and 220 MiB per machine at start); ``tests/test_agent_notorch.py`` keeps it so.

The agent is composed of parts, one concept per module, sharing one
:class:`~flashckpt.agent.state.AgentState`: :mod:`flashckpt.agent.server` (socket, typed
requests), :mod:`flashckpt.agent.segments` (slot files, adoption, abandoned segments),
:mod:`flashckpt.agent.persist` (what to persist and writing it, hashing),
:mod:`flashckpt.agent.commit` (the manifest once every node's part is in),
:mod:`flashckpt.agent.replicas.holder` (replicas held for other machines, and sent to them). This
module is the lifecycle (lock, start, serve, shutdown) and the package face: ``NodeAgent``,
``AgentConfig``, ``run_agent``, ``SegmentGroup``, ``abandoned_segments``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import signal
import threading
import time
from typing import Any

from flashckpt import names
from flashckpt.agent.commit import Committer
from flashckpt.agent.config import AgentConfig
from flashckpt.agent.mirror import Mirrorer
from flashckpt.agent.persist import Persister
from flashckpt.agent.replicas.holder import Replicator
from flashckpt.agent.segments import SegmentGroup, Segments, abandoned_segments
from flashckpt.agent.server import Server
from flashckpt.agent.state import RETRY_SOON_S, AgentState
from flashckpt.errors import AgentDaemonError, AgentError
from flashckpt.format.shm import ensure_private_dir
from flashckpt.format.storage import MANIFEST, Storage
from flashckpt.monitor.step_monitor import AgentMonitor
from flashckpt.protocol.channel import AgentClient

__all__ = [
    "AgentConfig",
    "AgentRunning",
    "NodeAgent",
    "SegmentGroup",
    "abandoned_segments",
    "run_agent",
]

log = logging.getLogger("flashckpt.agent.daemon")

MAIN_TICK_S = 1.0
"""Seconds between the main loop's looks at its timeouts (idle, unused, trainers gone, done):
all of seconds or more. A stop wakes it at once."""


EXIT_KEPT = 4
"""The agent's exit code when storage lacks the newest step its memory held at the stop (storage
failing, the stop's deadline passed): the segments are kept for the job's next agent."""
EXIT_MIRROR_FAILED = 5
"""The agent's exit code when the final step never reached the mirror (``mirror=``)."""
STOP_PERSIST_ROUNDS = 4
"""Persists the stop tries at most (each of the then newest step: trainers may still run)."""
STOP_LOOK_S = 0.25
"""Seconds between two looks at storage for another node's commit of the final step."""


class AgentRunning(AgentDaemonError, RuntimeError):
    """Another agent already serves this job on this node."""


class NodeAgent:
    """A node agent; ``run()`` serves until stopped. Composed of its parts (see the module)."""

    def __init__(self, config: AgentConfig) -> None:
        self.cfg = config
        self.st = AgentState(config)
        """What the parts share."""
        self.committer = Committer(self.st)
        self.mirrorer = Mirrorer(self.st, self.committer)
        self.persister = Persister(self.st, self.committer, self.mirrorer)
        self.segments = Segments(self.st)
        self.server = Server(self.st, self.segments, self.persister, self.status)
        self.replicator = Replicator(self.st)
        self.server.replicator = self.replicator  # answers the launcher's replica_peers
        # A pull asks the peers of the current world (the launcher's list, replaced each round).
        self.server.replica_peers = lambda: self.replicator.peers
        self.monitor: AgentMonitor | None = None
        self.socket_path = self.server.socket_path
        self.owner_path = self.segments.owner_path
        self._stop_flag = False  # set by signal handlers; read by the main loop
        # The main loop's wake-up: a pipe (a signal handler may write to it; it must not take
        # the lock an Event would), open while run() serves. The lock keeps a write off a
        # closed (maybe reused) descriptor; the handler only tries it.
        self._poke_fds: tuple[int, int] | None = None
        self._poke_lock = threading.Lock()
        self._lock_fd: int | None = None

    @property
    def storage(self) -> Storage | None:
        """Where the agent persists (None: memory only, until a trainer names a storage)."""
        return self.st.storage

    @property
    def _io_lock(self) -> threading.Lock:
        """Held while slot bytes are read for persistence (a test holds the persister off)."""
        return self.st.io_lock

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, lock_wait: float = 0.0) -> None:
        """Takes the job's lock, cleans and adopts segments, and listens. Returns at once.

        Args:
            lock_wait: seconds to wait for another agent of the same job and node to go away.
        """
        cfg = self.st.cfg
        # The socket, lock and log live here: another user able to write into it could swap
        # the socket (and receive the trainers' hello) or point the log elsewhere.
        ensure_private_dir(cfg.run_dir, "agent run dir")
        if not os.path.isdir(cfg.shm_dir):
            raise AgentError(
                f"the shared-memory directory {cfg.shm_dir!r} (--shm-dir) does not exist or is "
                f"not a directory; create it (a tmpfs mount, e.g. /dev/shm) or pass an existing one"
            )
        lock_path = names.lock_path(cfg.run_dir, cfg.job, cfg.node)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        # A previous agent may be finishing its shutdown (final persist): give it a moment.
        # One that still serves is not waited for: two trainers that both started an agent at
        # entry left the second waiting for the lock, to take over once the first exited at
        # the job's end and then sit out its idle timeout with nobody to serve.
        deadline = time.monotonic() + lock_wait
        next_ping = 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                serving = False
                if now >= next_ping:
                    next_ping = now + 0.5
                    serving = self._answers()
                if now < deadline and not serving:
                    time.sleep(0.05)
                    continue
                os.close(fd)
                raise AgentRunning(
                    f"an agent already serves job {cfg.job!r} on node {cfg.node!r} "
                    f"(socket {self.socket_path})"
                ) from None
        self._lock_fd = fd
        self.segments.write_owner()
        self.segments.clean_orphans()
        self.segments.adopt()
        if self.st.storage is not None:
            self.persister.init_storage_state()
        # The adopted snapshots are due a look (hash, persist, replicate): no trainer says so.
        self.st.wake_all()
        self.replicator.start_server()
        if self.replicator.store is not None and cfg.replicas > 0:
            self.st.capacity_check = self.replicator.check_capacity
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
        self.server.listen()
        for target, name in (
            (self.server.accept_loop, "accept"),
            (self.persister.persist_loop, "persist"),
            (self.persister.private_loop, "private"),
            (self.committer.commit_loop, "commit"),
            (self.mirrorer.mirror_loop, "mirror"),
            (self.mirrorer.commit_loop, "mirror-commit"),
            (self.persister.hash_loop, "hash"),
            (self.replicator.send_loop, "replica"),
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

    def _answers(self) -> bool:
        """Whether an agent answers a ping on this job's and node's socket (it serves)."""
        try:
            client = AgentClient(self.socket_path, timeout=0.0)
        except (AgentError, OSError):
            return False
        try:
            return bool(client.request("ping", timeout=2.0).get("pid"))
        except (AgentError, OSError, ValueError):
            return False
        finally:
            client.close()

    def install_signal_handlers(self) -> None:
        import faulthandler

        # A crash (SIGSEGV, SIGBUS, SIGABRT) leaves every thread's stack in the log.
        faulthandler.enable(all_threads=True)

        def handler(signum: int, frame: Any) -> None:
            self._stop_flag = True  # only a flag and a poke: the main loop does the work
            with contextlib.suppress(OSError):  # one write(2): safe in a signal handler
                os.write(2, f"flashckpt agent: got signal {signum}, stopping\n".encode())
            self._poke(blocking=False)

        # SIGHUP: the terminal went away (its session's processes get it); the launcher's
        # death reaches its agent as SIGTERM (PR_SET_PDEATHSIG). Each one persists or keeps.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, handler)

    def request_stop(self) -> None:
        self._stop_flag = True
        self._poke()

    def _poke(self, blocking: bool = True) -> None:
        """Wakes the main loop now (a stop). ``blocking=False`` (a signal handler, which may
        interrupt the main thread while it holds the lock): skipped when the lock is taken,
        which only happens while run() ends anyway."""
        if not self._poke_lock.acquire(blocking=blocking):
            return
        try:
            if self._poke_fds is not None:
                with contextlib.suppress(OSError):  # full: a wake-up is pending already
                    os.write(self._poke_fds[1], b"\0")
        finally:
            self._poke_lock.release()

    def run(self) -> int:
        """Serves until SIGTERM/SIGINT, done (``exit_when_done``) or idle timeout; cleans up."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        with self._poke_lock:
            self._poke_fds = (r, w)
        try:
            return self._serve(r)
        finally:
            with self._poke_lock:
                self._poke_fds = None
            os.close(r)
            os.close(w)

    def _serve(self, poke: int) -> int:
        reason = "stopped"
        started = time.monotonic()
        ever_connected = False
        while True:
            if self._stop_flag:
                reason = "signal"
                break
            with self.st.lock:
                has_clients = bool(self.st.conns)
                ranks = list(self.st.ranks.values())
            if has_clients:
                self.st.last_client_time = time.monotonic()
                ever_connected = True
            elif (
                self.st.cfg.exit_when_done
                and not ever_connected
                and not ranks
                and time.monotonic() - started > self.st.cfg.unused_timeout
            ):
                reason = "unused"
                break
            elif time.monotonic() - self.st.last_client_time > self.st.cfg.idle_timeout:
                reason = "idle"
                break
            elif (
                self.st.cfg.exit_when_done
                and (ever_connected or ranks)
                and time.monotonic() - self.st.last_client_time > self.st.cfg.unused_timeout
                and not self.holds_unpersisted()
            ):
                # Its trainers are gone (finished, failed at entry, killed) and storage holds
                # what memory does: an auto-started agent has nothing left to do.
                reason = "trainers gone, everything persisted"
                break
            if (
                self.st.cfg.exit_when_done
                and ranks
                and not has_clients
                and all(r.done for r in ranks)
                and not self.persister.pending_step()
                and not self.committer.commits
            ):
                reason = "done"
                break
            if (
                self.st.cfg.free_finished
                and not self.st.cfg.exit_when_done
                and ranks
                and not has_clients
                and self._trainers_finished()
                and not self.persister.pending_step()
                and not self.committer.commits
                and self.st.storage is not None
                and self._lacks() is None
            ):
                # A long-lived agent (the DaemonSet's, the systemd unit's) of a job that
                # finished: storage holds its newest step, so its slots (2x the state in host
                # memory) go now rather than when the agent is deleted (issue 44).
                newest = self.persister.newest_in_memory()
                reason = f"the job finished and storage holds its newest step ({newest})"
                log.info("%s: freeing its snapshot slots", reason)
                break
            # Only the stop and timeouts of seconds are looked at here: once a second is soon
            # enough for those (an idle agent's threads took ~60-90 wake-ups a second from the
            # training cores when every one polled; this loop took 20, then 4). A stop does
            # not wait for it: request_stop() and the signal handler write to the pipe, which
            # ends the wait at once (a signal alone would not: select() resumes after one).
            ready, _, _ = select.select([poke], [], [], MAIN_TICK_S)
            if ready:
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    os.read(poke, 512)
        log.info("agent stopping (%s)", reason)
        return self.shutdown(final_persist=True)

    def holds_unpersisted(self) -> bool:
        """Whether memory holds snapshots storage lacks (or commits are in flight)."""
        if self.st.storage is None:
            with self.st.lock:
                slots = [s for r in self.st.ranks.values() for s in r.slots if s is not None]
            for s in slots:
                with contextlib.suppress(ValueError):  # closed meanwhile
                    info = s.header()
                    if info is not None and info.complete:
                        return True
            return False
        return self.persister.pending_step() is not None or bool(self.committer.commits)

    def shutdown(self, final_persist: bool = True) -> int:
        """Stops the threads, writes what storage lacks, then frees the segments, or keeps them
        when memory still holds a step storage lacks (see :meth:`_final_persist`). Returns the
        exit code: 0, or :data:`EXIT_KEPT` (storage is configured and lacks the newest step:
        the segments are kept), or :data:`EXIT_MIRROR_FAILED` (the final step never reached
        the mirror)."""
        deadline = time.monotonic() + self.st.cfg.stop_timeout
        # Every background thread waits on an event of its own (or the accept): each is woken,
        # so the threads end now, not at their safety-net timeout (poll_interval).
        self.st.stopping.set()
        self.st.wake_all()
        self.committer.commit_wake.set()
        self.mirrorer.wake.set()
        self.mirrorer.committer.commit_wake.set()
        self.st.private_q.put((-1, -1))
        self.server.close()
        self.replicator.close()  # its transfers stop at their next chunk; replica files go
        # Wait for the persist thread to leave its step (it checks _stopping between steps).
        with self.st.io_lock:
            pass
        keep: str | None = "the stop failed before it looked at memory"
        code = 0
        try:
            try:
                keep = self._final_persist(deadline) if final_persist else self._lacks()
            except Exception as e:  # never free the only copy on a failure of our own
                log.exception("final persist failed")
                keep = f"the final persist failed ({type(e).__name__}: {e})"
            if final_persist and self.st.storage is not None:
                try:
                    # The exit's final step goes to the remote tier too: a bounded wait.
                    if not self._final_mirror():
                        code = EXIT_MIRROR_FAILED
                except Exception:
                    log.exception("final mirror failed")
                    code = EXIT_MIRROR_FAILED
            if self.monitor is not None:
                try:
                    self.monitor.close()  # before the segments go: the last records of the rings
                except Exception:
                    log.exception("closing the monitor failed")
        finally:
            # Whatever failed above, the segments go, or stay when they hold the only copy (an
            # allocation racing the shutdown is refused under the same locks, so none is
            # created after this).
            with self.st.io_lock, self.st.lock, self.st.map_lock:  # not under the hasher either
                for c in list(self.st.conns):
                    with contextlib.suppress(OSError):
                        c.sock.close()
                newest = None
                if keep is not None:
                    with contextlib.suppress(Exception):  # the slots stay whatever this says
                        newest = self.persister.newest_in_memory()
                kept = self.segments.remove_segments(keep_slots=keep is not None)
            if kept and newest is not None:
                # The only copy of that step (storage lacks it, or the job has none):
                # `flashckpt clean` leaves it without --force.
                url = self.st.storage.url if self.st.storage is not None else ""
                self.segments.mark_kept(url, newest, keep or "")
            if kept:
                log.warning(
                    "kept %d snapshot segment(s) of job %s node %s in %s (%s): the next agent "
                    "of this job adopts them and a rerun resumes from them; `flashckpt clean` "
                    "removes them once no agent of the job runs: %s",
                    len(kept),
                    self.st.cfg.job,
                    self.st.cfg.node,
                    self.st.cfg.shm_dir,
                    keep,
                    " ".join(os.path.basename(p) for p in kept),
                )
                if self.st.storage is not None:
                    code = code or EXIT_KEPT
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
        return code

    def _trainers_finished(self) -> bool:
        """Whether every position of the current world said done (the run ended)."""
        with self.st.lock:
            ranks = [r for r in self.st.ranks.values() if r.world_id == self.st.world_id]
            return bool(ranks) and all(r.done for r in ranks)

    def _lacks(self, newest: int | None = None) -> str | None:
        """Why the segments must be kept (memory holds a step storage lacks), or None."""
        if newest is None:
            newest = self.persister.newest_in_memory()
        if newest is None:
            return None
        storage = self.st.storage
        if storage is None:
            # Memory only: a run that ended is done with its state; anything else (a signal,
            # trainers that died) leaves the only copy for the job's next agent.
            return None if self._trainers_finished() else "no storage configured"
        if self._storage_has(storage, newest, time.monotonic()):
            return None
        return f"storage {storage.url} lacks step {newest}"

    def _storage_has(self, storage: Storage, step: int, deadline: float) -> bool:
        """Whether ``step`` is committed in storage; a node that does not commit it (rank 0 is
        elsewhere) waits for the committing node's manifest until ``deadline``."""
        with self.st.lock:
            if step in self.st.committed:
                return True
            commits_here = any(
                r.global_rank == 0 for r in self.st.ranks.values() if r.world_id == self.st.world_id
            )
        while True:
            try:
                if storage.fs.exists(storage.step_path(step, MANIFEST)):
                    return True
                if max(storage.committed_steps(), default=-1) > step:
                    # The job went on past it (a machine fenced while the others trained on,
                    # its world's step since retired by keep=): a rerun restores the newer
                    # step, so memory holds nothing storage lacks (issue 41).
                    return True
            except Exception as e:  # storage failing: it does not have it
                log.warning("cannot look for step %d in storage %s: %s", step, storage.url, e)
                return False
            if commits_here or time.monotonic() >= deadline:
                return False
            time.sleep(STOP_LOOK_S)

    def _final_persist(self, deadline: float) -> str | None:
        """Writes the newest step every local rank holds and storage lacks (marked for storage
        or not: memory is all there is) and waits for its commit, until ``deadline``. Returns
        None when storage then holds the newest step memory does (or memory holds none), else
        why not: the segments are then kept for the job's next agent."""
        storage = self.st.storage
        newest = self.persister.newest_in_memory()
        if newest is None or storage is None:
            return self._lacks(newest)
        cfg = self.st.cfg
        log.info(
            "stopping: writing what storage lacks (newest step in memory %d, committed %s) "
            "within %.0f s (stop_timeout)",
            newest,
            max(self.st.committed, default=None),
            cfg.stop_timeout,
        )
        error: str | None = None
        # A few rounds at most: a trainer still running (the agent alone was stopped) may
        # complete newer snapshots meanwhile; its slots are then kept for its next agent.
        for _ in range(STOP_PERSIST_ROUNDS):
            if time.monotonic() >= deadline:
                break
            pending = self.persister.pending_step(force=True)
            if pending is None:
                break
            try:
                self.persister.persist(*pending)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                self.st.record_error(pending[0], error)
                break
            with self.st.lock:
                unfinished = self.st.persisted_high < pending[0]
            if unfinished:  # gave way to a trainer: again, soon
                time.sleep(RETRY_SOON_S)
        try:
            self.committer.drain_commits(
                max(0.0, min(cfg.commit_timeout, deadline - time.monotonic()))
            )
        except Exception as e:
            log.exception("final commit failed")
            error = error or f"its commit failed: {type(e).__name__}: {e}"
        newest = self.persister.newest_in_memory()
        if newest is None or self._storage_has(storage, newest, deadline):
            if newest is not None:
                log.info(
                    "stopping: storage %s holds step %d, the newest in memory", storage.url, newest
                )
            return None
        if error is not None:
            return f"writing step {newest} to storage {storage.url} failed: {error}"
        if time.monotonic() >= deadline:
            return (
                f"step {newest} was not committed to storage {storage.url} within the stop's "
                f"{cfg.stop_timeout:g} s (stop_timeout)"
            )
        errors = [e["error"] for e in self.st.errors[-1:]]
        why = f": {errors[0]}" if errors else ""
        return f"step {newest} is not committed in storage {storage.url}{why}"

    def _final_mirror(self) -> bool:
        """Sends the exit's final step to the mirror and waits for it (bounded); whether it got
        there (True when there is nothing to mirror)."""
        self.persister.exit_mirror()
        ok = self.mirrorer.drain(self.st.cfg.commit_timeout)
        if not ok:
            log.error(
                "the final step did not reach the mirror %s (see the errors above); exit code %d",
                self.mirrorer.url,
                EXIT_MIRROR_FAILED,
            )
        return ok

    def status(self) -> dict[str, Any]:
        """What the agent holds and did: positions and their slots' steps, committed and
        committing steps, errors, refused slot files, corrupt snapshots, the monitor's summary
        (the ``status`` reply, ``flashckpt status`` and the metrics read it)."""
        with self.st.lock:
            ranks = {}
            for r, rec in sorted(self.st.ranks.items()):
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
                "job": self.st.cfg.job,
                "node": self.st.cfg.node,
                "pid": os.getpid(),
                "storage": self.st.storage.url if self.st.storage else None,
                "committed": list(self.st.committed),
                "committing": sorted(self.committer.commits),
                "mirror": self.mirrorer.status(),
                "world_id": self.st.world_id,
                "errors": list(self.st.errors[-10:]),
                "shard_writes": dict(self.st.shard_writes),
                "staged_writes": self.st.staged_writes,
                "persisting": self.st.persisting,
                "refused_slots": dict(self.st.refused),
                "corrupt_snapshots": [
                    {"slot": p, "seq": q, "step": st} for (p, q), st in self.st.corrupt.items()
                ],
                "ranks": ranks,
                "monitor": self.monitor.summary() if self.monitor is not None else None,
                "replication": self.replicator.status(),
            }


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
    notify_ready()
    return agent.run()


def notify_ready() -> None:
    """Tells systemd that the agent answers on its socket (a ``Type=notify`` unit such as
    deploy/systemd's: ``systemctl start`` returns then); nothing without ``$NOTIFY_SOCKET``."""
    import socket

    path = os.environ.get("NOTIFY_SOCKET", "")
    if not path:
        return
    addr = "\0" + path[1:] if path.startswith("@") else path  # "@": the abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(b"READY=1")
    except OSError as e:
        log.warning("cannot tell systemd the agent is ready (NOTIFY_SOCKET=%s): %s", path, e)
