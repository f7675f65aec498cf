"""The trainer's link to its node agent: connect (starting one where this rank may), hello, the
events the agent sends, finding an agent again after losing one, and every message a trainer
sends to the agent (each has its method here; nothing else in the trainer talks to the agent).

Training does not depend on the agent: snapshots go on into the slots (files a new agent
adopts), only their persistence waits for one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flashckpt import envnames
from flashckpt.format.shm import ShmSpaceError, ensure_private_dir
from flashckpt.format.storage import storage_options_for, write_storage_options_file
from flashckpt.names import agent_log_path
from flashckpt.protocol.channel import AgentClient, AgentError
from flashckpt.protocol.messages import (
    Alloc,
    AllocReply,
    ClaimStorage,
    ClaimStorageReply,
    Done,
    Flush,
    FlushReply,
    Hash,
    Hello,
    HelloReply,
    PullReplica,
    PullReplicaReply,
    Restored,
    Snap,
    Status,
    StatusReply,
)

if TYPE_CHECKING:
    from flashckpt.trainer.config import CheckpointConfig, Stats
    from flashckpt.trainer.rankctx import RankContext

__all__ = ["AgentLink"]

log = logging.getLogger("flashckpt")


class AgentLink:
    """One rank's connection to the node agent of its machine."""

    def __init__(
        self,
        config: CheckpointConfig,
        ctx: RankContext,
        stats: Stats,
        *,
        adopt_slots: Callable[[list[str | None]], None],
        timeline_start: Callable[[], int],
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.stats = stats
        self._adopt_slots = adopt_slots
        self._timeline_start = timeline_start
        self.client: AgentClient | None = None
        self.agent_proc: subprocess.Popen[bytes] | None = None
        """The agent this rank started (None: it started none)."""
        # What reconnecting to a (restarted) node agent needs: the socket and the hello fields.
        self.path: str | None = None
        self.hello_msg: Hello | None = None
        self.root: str | None = None  # the storage root of the agent at entry (checked then)
        self.next_reconnect = 0.0
        self.auto = False  # the agent was started by a trainer (not by its launcher)
        self.log_from = 0
        """Where the log of the agent this rank started last begins (its size before)."""
        self.restarts = 0
        """Times this rank lost its node agent and found (or started) another one."""

    # -- connection --------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.client is not None and self.client.connected

    def connect(self, path: str, run_dir: str, *, again: bool = False) -> AgentClient:
        """Connects to the node agent, starting one if needed (agent='auto').

        An agent that is just shutting down (the previous run finished) refuses new work by
        closing; then a fresh one is started, until ``agent_timeout`` runs out.

        Under ``flashckpt run`` (``$FLASHCKPT_LAUNCHER_PID``) the node agent is the launcher's:
        it restarts a lost one, so a trainer waits for it and never starts its own (issue 41: a
        worker started while the launcher's agent was being restarted started an agent of its
        own, with its own events file and settings, and the launcher's next agents exited as
        the job's second one).

        Args:
            again: the agent was lost. Wait up to ``agent_timeout`` for it to be back (also with
                agent='connect': its owner restarts it), and start one only if this rank had
                started the lost one (an agent a launcher supervises is restarted by it).
        """
        ctx = self.ctx
        # The launcher's agent: its run dir (a run_dir= of the script's own is not its).
        launcher = envnames.get(envnames.LAUNCHER_PID) if run_dir == envnames.run_dir() else None
        deadline = time.monotonic() + self.config.agent_timeout
        while True:
            try:
                return AgentClient(path, on_event=self.on_event, timeout=0.2)
            except AgentError:
                if self.config.agent == "connect" and not again:
                    raise AgentError(
                        f"no flashckpt node agent at {path}: start one (`flashckpt agent --job "
                        f"{ctx.job} --node {ctx.node}`) or pass agent='auto'"
                    ) from None
            if time.monotonic() > deadline:
                if launcher and self.agent_proc is None:
                    raise AgentError(
                        f"the node agent of `flashckpt run` (launcher pid {launcher}) did not "
                        f"answer at {path} within {self.config.agent_timeout:.0f} s: see the "
                        "launcher's output and its agent's log in its --run-dir"
                    )
                raise AgentError(
                    f"the node agent did not start within {self.config.agent_timeout:.0f} s; "
                    f"see {agent_log_path(run_dir, ctx.job, ctx.node)}"
                )
            if (again and not self.may_restart()) or (launcher and self.agent_proc is None):
                continue
            if self.agent_proc is not None and self.agent_proc.poll() == 1:
                # It refused to start (a full /dev/shm, a planted file, a bad storage): its
                # error now, not "did not start" after agent_timeout of respawning it.
                why = _agent_error(agent_log_path(run_dir, ctx.job, ctx.node), self.log_from)
                if why is not None:
                    raise AgentError(f"the node agent could not start: {why}")
            if self.agent_proc is None or self.agent_proc.poll() is not None:
                self.spawn(run_dir)

    def hello(self, path: str, run_dir: str, msg: Hello) -> HelloReply:
        """Connects and introduces this rank; returns the agent's reply (its slots, shm dir)."""
        self.path, self.hello_msg = path, msg
        for attempt in range(3):
            self.client = self.connect(path, run_dir)
            try:
                reply = self._hello(self.client, msg)
            except AgentError as e:
                if self.client.connected or attempt == 2:
                    raise
                log.info("flashckpt: node agent went away during hello (%s); retrying", e)
                self.client.close()
                continue
            self.auto = reply.auto_started
            self.root = reply.storage
            return reply
        raise AssertionError("unreachable")

    def _hello(self, client: AgentClient, msg: Hello) -> HelloReply:
        reply = client.call(msg, timeout=self.config.agent_timeout)
        if not isinstance(reply, HelloReply):  # parse_reply gives the type of the request's op
            raise AgentError(f"the node agent answered hello with {type(reply).__name__}")
        return reply

    def spawn(self, run_dir: str) -> None:
        """Starts a node agent for this job and node (in a session of its own)."""
        cfg, ctx = self.config, self.ctx
        # The log is appended to and the socket connected to there: a directory another user
        # can write into is refused, never used.
        ensure_private_dir(run_dir, "agent run dir")
        cmd = [
            sys.executable,
            "-m",
            "flashckpt",
            "agent",
            "--job",
            ctx.job,
            "--node",
            ctx.node,
            "--shm-dir",
            cfg.shm_dir or envnames.shm_dir() or "/dev/shm",
            "--run-dir",
            run_dir,
            "--keep",
            str(cfg.keep),
            "--idle-timeout",
            str(cfg.agent_idle_timeout),
            "--exit-when-done",
            "--lock-wait",
            "30",
        ]
        if cfg.storage:
            cmd += ["--storage", cfg.storage]
        env = None
        opts = {u: o for u in (cfg.storage, cfg.mirror) if u and (o := storage_options_for(u))}
        if opts:
            # storage_options= (credentials, often): to the agent in a 0600 file in the private
            # run directory, named by the environment; never on its command line.
            opts_path = os.path.join(run_dir, f"storage-options.{ctx.job}.{ctx.node}.json")
            write_storage_options_file(opts_path, opts)
            env = {**os.environ, envnames.STORAGE_OPTIONS_FILE: opts_path}
        log_path = agent_log_path(run_dir, ctx.job, ctx.node)
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        self.log_from = os.fstat(fd).st_size  # what this agent writes starts here
        logf = os.fdopen(fd, "ab")
        try:
            # A new session: the agent must outlive this trainer (that is its whole point).
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                start_new_session=True,
                env=env,
            )
        finally:
            logf.close()
        self.agent_proc = proc
        threading.Thread(target=proc.wait, name="flashckpt-agent-reaper", daemon=True).start()

    def on_event(self, msg: dict[str, Any]) -> None:
        ev = msg.get("event")
        if ev == "committed":
            step = int(msg["step"])
            if self.stats.last_committed_step is None or step > self.stats.last_committed_step:
                self.stats.last_committed_step = step
        elif ev == "persisted":
            step = int(msg["step"])
            if self.stats.last_persisted_step is None or step > self.stats.last_persisted_step:
                self.stats.last_persisted_step = step
            if self.stats.persisting_step is not None and self.stats.persisting_step <= step:
                self.stats.persisting_step = None
        elif ev == "persisting":
            self.stats.persisting_step = int(msg["step"])
        elif ev == "persist_abandoned":
            if self.stats.persisting_step == int(msg["step"]):
                self.stats.persisting_step = None
        elif ev == "persist_error":
            self.stats.persist_errors.append({"step": msg.get("step"), "error": msg.get("error")})
            log.warning("flashckpt: persisting step %s failed: %s", msg.get("step"), msg["error"])

    def relink(self, wait: bool = False) -> bool:
        """Finds a node agent again after losing it (it died or was restarted); True if linked.

        Training does not depend on the agent: snapshots go on into the slots (files the new
        agent adopts), only their persistence waits. Without ``wait`` one quick attempt is made
        (at most one per second; with agent='auto', a rank that had started the lost agent
        starts the next); with ``wait`` (on exit, to persist the last snapshot) up to
        ``agent_timeout``.
        """
        if self.alive():
            return True
        path, run_dir = self.path, self.ctx.run_dir
        if path is None or run_dir is None:
            return False
        now = time.monotonic()
        if not wait and now < self.next_reconnect:
            return False
        self.next_reconnect = now + 1.0
        if self.client is not None:
            self.client.close()
            self.client = None
        try:
            if wait:
                client = self.connect(path, run_dir, again=True)
            else:
                try:
                    client = AgentClient(path, on_event=self.on_event, timeout=0.0)
                except AgentError:
                    # An agent of a launcher (or started by hand) is its owner's to restart:
                    # one of ours would race it for the job's lock.
                    if self.may_restart():
                        self.spawn(run_dir)  # connected to at the next attempt
                    return False
            assert self.hello_msg is not None, "relink before hello"
            reply = self._hello(client, self.hello_msg)
        except AgentError as e:
            log.warning(
                "flashckpt: rank %d: no node agent yet (%s); training goes on", self.ctx.rank, e
            )
            return False
        self.client = client
        self.auto = reply.auto_started
        self.restarts += 1
        if self.hello_msg.storage is None and reply.storage != self.root:
            self._root_changed(reply)
        self.stats.persisting_step = None  # the lost agent's persist in flight went with it
        self._adopt_slots(reply.slots)
        timeline_start = self._timeline_start()
        if timeline_start >= 0:
            # The new agent learns where this resumed timeline began (steps after it in storage
            # that this run did not commit belong to an abandoned one and are rewritten). A run
            # that started from scratch tells nothing: entry refused a root holding another
            # run's steps (or deleted them, overwrite=True), so every committed step is its own,
            # even one this rank has not heard of yet.
            last = self.stats.last_committed_step
            since = max(timeline_start, last if last is not None else -1)
            with contextlib.suppress(AgentError):
                client.call(Restored(step=since), timeout=10)
        log.warning(
            "flashckpt: rank %d lost its node agent and is linked to agent pid %s now",
            self.ctx.rank,
            reply.pid,
        )
        return True

    def _root_changed(self, reply: HelloReply) -> None:
        """The agent found again persists to another root than the one checked at entry (a
        trainer without ``storage=``): said loudly, once per change; training goes on."""
        seen = reply.storage_foreign or "its owner and steps are not checked mid-run"
        msg = (
            f"flashckpt: rank {self.ctx.rank}: the node agent found again (pid {reply.pid}) "
            f"persists this job to {reply.storage or 'no storage'}, not to "
            f"{self.root or 'no storage'} as the agent checked at entry did: this run's steps "
            f"now go where entry checked nothing ({seen}). Give the agent its --storage back, "
            "or restart the job so that entry checks the new root"
        )
        self.root = reply.storage
        log.error("%s", msg)
        warnings.warn(msg, stacklevel=2)

    def may_restart(self) -> bool:
        """Whether this rank starts the next agent after losing one: with agent='auto', when
        the lost one was started by a trainer (this rank's own, or another's) and none of this
        rank's is still starting. An agent of a launcher or an operator is theirs to restart."""
        if self.config.agent != "auto":
            return False
        if self.agent_proc is not None:
            return self.agent_proc.poll() is not None
        return self.auto

    # -- messages ----------------------------------------------------------------------------
    def restored(self, step: int) -> None:
        """Tells the agent where this run's timeline starts (-1: from scratch); best effort."""
        if self.client is not None:
            with contextlib.suppress(AgentError):
                self.client.call(Restored(step=step), timeout=10)

    def snapped(self, step: int) -> None:
        """Tells the agent that this rank's snapshot of ``step`` is complete in its slot."""
        if self.client is not None:
            self.client.notify_msg(
                Snap(rank=self.ctx.rank, local_rank=self.ctx.local_rank, step=step)
            )

    def alloc(
        self, *, meta_cap: int, data_cap: int, keep: list[int], check_only: bool = False
    ) -> list[str]:
        """Has the agent (re)allocate this rank's slots; returns their paths (``check_only``:
        only checks that they fit, returns none).

        Raises:
            ShmSpaceError: the shared memory cannot hold them.
            AgentError: no agent, or it failed.
        """
        if self.client is None:
            raise AgentError("no node agent: lost, and none found again yet")
        try:
            reply = self.client.call(
                Alloc(
                    rank=self.ctx.rank,
                    local_rank=self.ctx.local_rank,
                    meta_cap=meta_cap,
                    data_cap=data_cap,
                    keep=keep,
                    check_only=True if check_only else None,
                ),
                timeout=self.config.agent_timeout,
            )
        except AgentError as e:
            if e.kind == "ShmSpaceError":
                raise ShmSpaceError(str(e)) from None
            raise
        assert isinstance(reply, AllocReply)
        return list(reply.slots)

    def hash_now(self) -> None:
        """Has the agent hash this position's slots now (it hashes in the background)."""
        if self.alive():
            assert self.client is not None
            with contextlib.suppress(AgentError):
                self.client.call(Hash(), timeout=60)

    def pull_replica(
        self,
        *,
        min_step: int,
        world_id: str | None = None,
        fetch: bool = True,
        timeout: float = 120.0,
        holder: str | None = None,
        sender: str | None = None,
    ) -> PullReplicaReply:
        """Has the agent find a peer agent's replica of this rank's snapshot (step >=
        ``min_step``, taken by a world of this rank's size, in ``world_id`` if given) and, with
        ``fetch``, copy it into one of this rank's slots (hash-verified there); the reply says
        what was found (step, holder, bytes, the slot) or why nothing was. ``holder`` and
        ``sender`` (from an earlier look's reply): fetch from that peer at once.

        Raises:
            AgentError: no agent, it refused, or the pull failed (``kind`` names why:
                ``CorruptSnapshotError`` for a replica that fails its data hash).
        """
        if self.client is None or not self.client.connected:
            raise AgentError("no node agent")
        ctx = self.ctx
        reply = self.client.call(
            PullReplica(
                rank=ctx.rank,
                local_rank=ctx.local_rank,
                world_size=ctx.world,
                min_step=min_step,
                world_id=world_id,
                fetch=fetch,
                timeout_s=timeout,
                holder=holder,
                sender=sender,
            ),
            # The agent asks each peer (bounded by the timeout) and then streams the replica.
            timeout=2 * timeout + 30,
        )
        if not isinstance(reply, PullReplicaReply):
            raise AgentError(f"the node agent answered pull_replica with {type(reply).__name__}")
        return reply

    def claim_storage(self, *, delete_steps: bool, takeover: bool = True) -> ClaimStorageReply:
        """Has the agent take its own storage root for this job (owner file; ``delete_steps``:
        deletes the root's steps first; without ``takeover`` only a root no other job owns,
        atomically: the reply's ``foreign`` is the refusal).

        Raises:
            AgentError: no agent, or it refused or failed.
        """
        if self.client is None:
            raise AgentError("no node agent")
        reply = self.client.call(
            ClaimStorage(delete_steps=delete_steps, takeover=takeover),
            timeout=max(self.config.agent_timeout, 60),
        )
        if not isinstance(reply, ClaimStorageReply):
            raise AgentError(f"the node agent answered claim_storage with {type(reply).__name__}")
        return reply

    def flush(self, step: int, timeout: float) -> int:
        """Waits until the agent committed ``step`` to storage; returns the committed step.

        Raises:
            AgentError: no agent, or it failed or died meanwhile.
        """
        if self.client is None:
            raise AgentError("no node agent")
        reply = self.client.call(Flush(step=step, timeout_s=timeout), timeout=timeout + 5)
        assert isinstance(reply, FlushReply)
        return reply.committed

    def status(self) -> dict[str, Any]:
        """The agent's view (``connected``, and what its status reply holds)."""
        agent: dict[str, Any] = {"connected": bool(self.client and self.client.connected)}
        if self.client is not None and self.client.connected:
            with contextlib.suppress(AgentError):
                reply = self.client.call(Status(), timeout=5)
                assert isinstance(reply, StatusReply)
                agent.update(reply.status)
        return agent

    def close(self, *, done: bool) -> None:
        """Closes the link; ``done``: this rank finished (the agent may exit when all did)."""
        if self.client is not None:
            if done:
                with contextlib.suppress(AgentError):
                    self.client.call(
                        Done(rank=self.ctx.rank, local_rank=self.ctx.local_rank), timeout=10
                    )
            self.client.close()
            self.client = None


def _agent_error(log_path: str, start: int) -> str | None:
    """The error a node agent that refused to start wrote to its log from offset ``start``:
    its ``flashckpt agent: ...`` line (as the ``agent`` command reports an error), else the last
    line it wrote (a traceback's), or None."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - 16384))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    mine = [ln for ln in lines if ln.startswith("flashckpt agent: ")]
    if mine:
        return mine[-1].removeprefix("flashckpt agent: ")
    return f"{lines[-1]} (see {log_path})" if lines else None
