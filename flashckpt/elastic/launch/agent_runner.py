"""Runs the flashckpt node agent beside the workers, for the life of the launcher.

The agent (``python -m flashckpt agent``) owns the shared-memory snapshot slots of every local
rank and persists them in the background. The launcher keeps one agent that the workers use:

- it has its own socket directory and shared-memory directory (``<run_dir>/<job>.<node>.g1/``
  and ``<shm_dir>/flashckpt.<job>.<node>.g1/``: generation 1, the workers' environment names
  them through :class:`AgentGeneration`);
- it stays across rendezvous rounds: it keys snapshot slots by local rank and tags every
  snapshot and storage part with its world (round), so after a membership change the surviving
  trainers reload from its memory under their new global ranks, and a step of the old world
  that waits for a dead machine's part does not hold up the new world's persistence;
- it is spawned from one supervisor thread that lives as long as the launcher, with
  ``PR_SET_PDEATHSIG=SIGTERM``: if the launcher dies, even by SIGKILL, the agent writes what
  storage lacks or keeps its segments for the next launch of the job; in its own session, so a
  terminal's Ctrl-C (or a signal to the launcher's process group) reaches only the launcher,
  which stops the workers first and then the agent;
- if it exits on its own (a crash), it is started again in the same generation and adopts the
  segments, so the snapshots survive;
- workers start only once :meth:`NodeAgentProcess.wait_ready` saw the current agent answer, so
  ``flashckpt.checkpointing()`` never falls back to starting its own, unsupervised agent;
- with ``replicas`` > 0 it runs a replica server on the machine's cluster address (port 0 the
  first time: the OS picks one, read back from the agent's ``status``; an agent started again
  binds the same port, so the address published in the machine's etcd record stays right) and
  holds the newest snapshots of other machines; :meth:`NodeAgentProcess.set_replica_peers`
  gives it the current world's other machines (at every rendezvous round, and again to an
  agent started again), so it sends its own to the next machine in ring order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from flashckpt import names
from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.procutil import die_with_parent
from flashckpt.errors import AgentDaemonError

# The node agent's exit code when it kept its segments (flashckpt.agent.daemon.EXIT_KEPT; not
# imported:
# that module is the agent's, and this one must stay light).
EXIT_KEPT = 4
# Its exit code when the exit's final step never reached the mirror (EXIT_MIRROR_FAILED).
EXIT_MIRROR_FAILED = 5

__all__ = [
    "EXIT_KEPT",
    "EXIT_MIRROR_FAILED",
    "AgentGeneration",
    "NodeAgentConfig",
    "NodeAgentError",
    "NodeAgentProcess",
    "world_replica_peers",
]

logger = logging.getLogger(__name__)

# The launcher owns the agent's lifetime; the agent's own idle exit must never fire.
_NEVER_IDLE_S = 10 * 365 * 24 * 3600
# Unix socket paths are limited to 108 bytes; flashckpt refuses paths over 100.
_MAX_SOCKET_PATH = 100


class NodeAgentError(AgentDaemonError, RuntimeError):
    """The node agent did not start, or kept dying."""


@dataclass(kw_only=True, slots=True)
class NodeAgentConfig:
    """How to run the node agent of one machine."""

    job: str
    """Job id (the rendezvous id)."""
    node: str
    """Node id."""
    storage: str | None
    """Checkpoint root URL, or ``None`` (the trainers supply it)."""
    shm_dir: str
    """The tmpfs under which the agent's slot directory is created."""
    run_dir: str
    """Directory under which the agent's socket directory is created; logs go here."""
    keep: int = 3
    """Committed steps kept in storage."""
    metrics_port: int | None = None
    """Port of the agent's Prometheus endpoint (``None``: off)."""
    stop_timeout_s: float = 120.0
    """How long the agent may take to finish its write in flight on stop before it is killed."""
    max_crashes: int = 5
    """Consecutive exits of the agent before it is ready, before giving up."""
    replicas: int = 0
    """Other machines that keep a copy of this machine's newest snapshot in memory (the
    agent's ``--replicas``); 0 runs no replica server: nothing is held or sent."""
    replica_bind: str = "0.0.0.0"
    """The address the agent's replica server listens on (the machine's cluster address)."""
    replica_advertise: str = ""
    """The host other machines reach the replica server at (default: ``replica_bind``)."""

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas={self.replicas}: must be >= 0 (0 turns replication off)")
        if self.replicas and not self.replica_bind:
            raise ValueError("replica_bind is empty: name the machine's cluster address")


@dataclass(frozen=True, slots=True)
class AgentGeneration:
    """Where the agent lives: what the workers' environment points at."""

    number: int
    """The generation number: always 1 (the agent keeps its generation across restarts)."""
    run_dir: str
    """Directory of its socket and lock (``FLASHCKPT_RUN_DIR`` of the workers)."""
    shm_dir: str
    """Directory of its slots (``FLASHCKPT_SHM_DIR`` of the workers)."""
    log_path: str
    """Its log file."""
    socket_path: str
    """Its socket."""


class _Agent:
    """One agent process."""

    def __init__(
        self, gen: AgentGeneration, proc: subprocess.Popen[bytes], log_offset: int = 0
    ) -> None:
        self.gen = gen
        self.proc = proc
        self.ready = False
        self.log_offset = log_offset
        """Size of its log when it started: what it wrote since is its own."""


class NodeAgentProcess:
    """Keeps the node agent running; see the module docstring.

    Args:
        config: How to run it.
    """

    def __init__(self, config: NodeAgentConfig) -> None:
        self.config = config
        self._gen = self._generation()
        if len(self._gen.socket_path.encode()) > _MAX_SOCKET_PATH:
            raise ValueError(
                f"the node agent's socket path {self._gen.socket_path!r} would be longer than "
                f"{_MAX_SOCKET_PATH} bytes: use a shorter --run-dir, --rdzv-id or --node-id"
            )
        self._cond = threading.Condition()
        self._current: _Agent | None = None
        self._stopping = False
        # Set from a signal handler (a plain attribute: a handler must not take the lock the
        # interrupted thread may hold); read by the supervisor thread.
        self._no_restart = False
        self._stop_timeout_s = config.stop_timeout_s
        self._failure: str | None = None
        self._crashes = 0
        self._exit_code: int | None = None
        self._thread = threading.Thread(
            target=self._supervise, name="flashckpt-node-agent", daemon=True
        )
        self._replica_port = 0  # 0 until the first agent bound one; then every agent reuses it
        self._replica_address: str | None = None
        self._replica_peers: dict[str, str] | None = None
        self._peers_lock = threading.Lock()  # one peer list sent at a time, the newest last
        self.on_replica_address: Callable[[str], None] | None = None
        """Called (from the supervisor thread, before the agent counts as ready) with the
        ``host:port`` of the replica server whenever it is new: the launcher publishes it."""

    @property
    def current(self) -> AgentGeneration | None:
        """Where the agent the workers should use lives (``None`` before it is spawned)."""
        with self._cond:
            return self._current.gen if self._current is not None else None

    def start(self) -> None:
        """Starts supervising (and so the first agent); returns at once."""
        cfg = self.config
        os.makedirs(cfg.run_dir, mode=0o700, exist_ok=True)
        os.makedirs(cfg.shm_dir, exist_ok=True)
        # Empty generation directories left by a launcher of this job and node that was killed
        # (its agents removed their segments on the way out). rmdir never removes a non-empty
        # one, so a live launcher's directories are safe.
        prefix = names.generation_shm_prefix(cfg.job, cfg.node)
        for name in os.listdir(cfg.shm_dir):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(cfg.shm_dir, name))
        self._thread.start()

    def wait_ready(self, timeout: timedelta) -> AgentGeneration:
        """Blocks until the current agent answers on its socket; returns its generation.

        Raises:
            NodeAgentError: If it did not within ``timeout``, or keeps crashing.
        """
        deadline = Deadline.after(timeout)
        with self._cond:
            while self._current is None or not self._current.ready:
                if self._failure is not None:
                    raise NodeAgentError(self._failure)
                if deadline.expired():
                    gen = self._current.gen if self._current is not None else None
                    where = f"on {gen.socket_path}; see {gen.log_path}" if gen else "(none started)"
                    raise NodeAgentError(
                        f"the flashckpt node agent did not answer within "
                        f"{timeout.total_seconds():g} s {where}"
                    )
                self._cond.wait(min(0.05, max(0.001, deadline.remaining())))
            return self._current.gen

    def refuse_restarts(self) -> None:
        """From now on an agent that exits is not started again (the launcher is stopping).

        Safe to call from a signal handler: it only sets a flag. A signal sent to the whole
        process group (a scheduler's SIGTERM, a terminal's Ctrl-C) reaches the agent too; it
        persists and exits on its own, and must not be replaced while the launcher shuts down.
        """
        self._no_restart = True

    @property
    def exit_code(self) -> int | None:
        """The exit code of the agent :meth:`stop` stopped (``None`` before, or when none ran):
        0, :data:`EXIT_KEPT`, 5 (the final step never reached the mirror), negative when
        killed."""
        with self._cond:
            return self._exit_code

    @property
    def replica_address(self) -> str | None:
        """``host:port`` of the ready agent's replica server as other machines reach it
        (``None``: replication off, or no agent ready yet)."""
        with self._cond:
            return self._replica_address

    def set_replica_peers(self, peers: Mapping[str, str]) -> None:
        """Gives the agent the other machines of the current world (node id -> ``host:port``
        of their replica servers); kept and given again to an agent started again.

        A failure is logged, never raised: replication is a background protection, and the
        agent started again after a crash gets the list anyway.
        """
        if self.config.replicas == 0:
            return
        peers = {n: a for n, a in peers.items() if n != self.config.node}  # never its own
        with self._peers_lock:
            self._replica_peers = dict(peers)
            with self._cond:
                agent = self._current if self._current is not None and self._current.ready else None
            if agent is not None:
                self._send_replica_peers(agent, peers)

    def stop(self, timeout_s: float | None = None) -> None:
        """Stops the agent (SIGTERM: it writes what storage lacks, then removes its segments,
        or keeps them when they hold the only copy of a snapshot: exit code 4).

        Args:
            timeout_s: How long the agent may take before it is killed; default
                ``stop_timeout_s``. Segments it kept (or left, killed) stay for the next agent
                of the job and node; its socket directory is removed.

        Never raises.
        """
        self._no_restart = True
        with self._cond:
            if timeout_s is not None:
                self._stop_timeout_s = max(0.0, timeout_s)
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(self._stop_timeout_s + 10)

    # ------------------------------------------------------------------------ internals

    def _generation(self) -> AgentGeneration:
        cfg, number = self.config, 1
        run_dir = names.generation_run_dir(cfg.run_dir, cfg.job, cfg.node, number)
        return AgentGeneration(
            number=number,
            run_dir=run_dir,
            shm_dir=names.generation_shm_dir(cfg.shm_dir, cfg.job, cfg.node, number),
            log_path=names.generation_log_path(cfg.run_dir, cfg.job, cfg.node, number),
            socket_path=names.socket_path(run_dir, cfg.job, cfg.node),
        )

    def _supervise(self) -> None:
        """The only thread that spawns agents (the parent-death signal follows this thread)."""
        while True:
            with self._cond:
                if self._stopping:
                    break
                failed = self._failure is not None
            if not failed and not self._no_restart:
                try:
                    self._tend_current()
                except Exception as exc:  # e.g. an unsafe run directory: no agent can run
                    with self._cond:
                        self._failure = f"the flashckpt node agent cannot run: {exc}"
                    logger.error("%s", self._failure)
            with self._cond:
                self._cond.notify_all()
                if not self._stopping:
                    busy = self._current is None or not self._current.ready
                    self._cond.wait(0.02 if busy else 0.2)
        with self._cond:
            agent, self._current = self._current, None
        if agent is not None:
            with contextlib.suppress(ProcessLookupError):
                agent.proc.send_signal(signal.SIGTERM)
            self._terminate(agent, Deadline.after(timedelta(seconds=self._stop_timeout_s)))

    def _tend_current(self) -> None:
        agent = self._current
        if agent is not None and agent.proc.poll() is not None:
            self._on_crash(agent)
            # Same generation: the new process adopts the segments, so snapshots survive.
            agent = self._spawn(agent.gen)
            with self._cond:
                self._current = agent
        if agent is None:
            agent = self._spawn(self._gen)
            with self._cond:
                self._current = agent
        if not agent.ready and self._answers(agent):
            self._replica_ready(agent)
            # Given the newest peer list, then ready, in one step: a list set meanwhile is
            # either sent here or by set_replica_peers to the (then ready) agent.
            with self._peers_lock:
                if self._replica_peers is not None:
                    self._send_replica_peers(agent, self._replica_peers)
                with self._cond:
                    agent.ready = True
                    self._crashes = 0
                    self._cond.notify_all()

    def _spawn(self, gen: AgentGeneration) -> _Agent:
        cfg = self.config
        os.makedirs(gen.run_dir, mode=0o700, exist_ok=True)
        os.makedirs(gen.shm_dir, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "flashckpt",
            "agent",
            "--job",
            cfg.job,
            "--node",
            cfg.node,
            "--shm-dir",
            gen.shm_dir,
            "--run-dir",
            gen.run_dir,
            "--keep",
            str(cfg.keep),
            "--idle-timeout",
            str(_NEVER_IDLE_S),
            # A crashed agent's successor in the same generation may find its lock still held
            # for a moment.
            "--lock-wait",
            "30",
            # One events file per job and node across generations: the goodput report and the
            # monitor's restart counts span the whole elastic run.
            "--events-dir",
            cfg.run_dir,
        ]
        if cfg.storage:
            cmd += ["--storage", cfg.storage]
        if cfg.metrics_port:
            cmd += ["--metrics-port", str(cfg.metrics_port)]
        cmd += ["--replicas", str(cfg.replicas)]
        if cfg.replicas:
            host = f"[{cfg.replica_bind}]" if ":" in cfg.replica_bind else cfg.replica_bind
            cmd += ["--replica-listen", f"{host}:{self._replica_port}"]
        with open(gen.log_path, "ab") as log:
            offset = log.tell()
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                # Its own session: a terminal's Ctrl-C or a signal to the launcher's process
                # group does not reach it; the launcher stops it once the workers stopped
                # (SIGTERM), or the kernel does when the launcher dies (parent-death signal).
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGTERM),
            )
        logger.info(
            "node agent generation %d started (pid %d, log %s)", gen.number, proc.pid, gen.log_path
        )
        return _Agent(gen, proc, offset)

    @staticmethod
    def _answers(agent: _Agent) -> bool:
        from flashckpt.protocol.channel import AgentClient, AgentError

        try:
            client = AgentClient(agent.gen.socket_path, timeout=0.01)
        except AgentError:
            return False
        try:
            reply = client.request("ping", timeout=2)
        except AgentError:
            return False
        finally:
            client.close()
        # Another pid: a crashed predecessor's socket, or an agent a trainer started.
        return int(reply.get("pid", -1)) == agent.proc.pid

    def _replica_ready(self, agent: _Agent) -> None:
        """A new agent answers: learns its replica port and publishes a new address."""
        if self.config.replicas == 0:
            return
        rep = _agent_request(agent, "status").get("replication")
        listen = rep.get("listen") if isinstance(rep, dict) else None
        port_text = listen.rpartition(":")[2] if isinstance(listen, str) else ""
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            logger.warning("the node agent reports no replica server (%r): no replicas", listen)
            return
        self._replica_port = int(port_text)
        host = self.config.replica_advertise or self.config.replica_bind
        address = f"[{host}]:{port_text}" if ":" in host else f"{host}:{port_text}"
        with self._cond:
            new, self._replica_address = address != self._replica_address, address
        if new:
            logger.info("node agent replica server at %s", address)
            if self.on_replica_address is not None:
                try:
                    self.on_replica_address(address)
                except Exception:
                    logger.exception("publishing the replica address %s failed", address)

    def _send_replica_peers(self, agent: _Agent, peers: Mapping[str, str]) -> None:
        try:
            reply = _agent_request(agent, "replica_peers", peers=dict(peers), strict=True)
        except Exception as exc:
            logger.warning("could not give the node agent its replica peers %s: %s", peers, exc)
            return
        logger.info(
            "replica peers %s; this machine's snapshots go to %s",
            ", ".join(f"{n}={a}" for n, a in sorted(peers.items())) or "none",
            ", ".join(reply.get("targets") or []) or "nobody",
        )

    def _on_crash(self, agent: _Agent) -> None:
        code = agent.proc.returncode
        if not agent.ready:
            refused = _startup_error(agent)
            if refused is not None:
                # It refused to start (bad storage, a full shm dir, files it may not replace):
                # the same agent started again would refuse again. Its error, at once.
                with self._cond:
                    self._failure = (
                        f"the flashckpt node agent refused to start (exit code {code}): "
                        f"{refused} (its log: {agent.gen.log_path})"
                    )
                    self._cond.notify_all()
                logger.error("%s", self._failure)
                return
            # Perhaps the replica port was taken meanwhile: the next agent asks for a new one
            # (published again once it answers).
            self._replica_port = 0
        with self._cond:
            self._crashes += 1
            if self._crashes > self.config.max_crashes:
                tail = _log_tail(agent)
                self._failure = (
                    f"the flashckpt node agent exited {self._crashes} times in a row (last exit "
                    f"code {code}); see {agent.gen.log_path}"
                    + (f", which ends with:\n{tail}" if tail else "")
                )
                self._cond.notify_all()
        logger.warning(
            "node agent pid %d exited with code %s; starting it again (see %s)",
            agent.proc.pid,
            code,
            agent.gen.log_path,
        )

    def _terminate(self, agent: _Agent, deadline: Deadline) -> None:
        proc = agent.proc
        if proc.poll() is None:
            try:
                proc.wait(max(0.0, deadline.remaining()))
            except subprocess.TimeoutExpired:
                logger.warning(
                    "node agent pid %d did not stop within %.0f s; killing it (its snapshots stay "
                    "in %s for the next launch of this job)",
                    proc.pid,
                    self._stop_timeout_s,
                    agent.gen.shm_dir,
                )
                proc.kill()
                proc.wait()
        code = proc.returncode
        with self._cond:
            self._exit_code = code
        if code == EXIT_KEPT:
            logger.warning(
                "node agent pid %d kept its snapshots in %s: storage lacks the newest (see %s); "
                "the same command run again resumes from them",
                proc.pid,
                agent.gen.shm_dir,
                agent.gen.log_path,
            )
        elif code not in (0, None):
            logger.warning(
                "node agent pid %d exited with code %s (see %s)", proc.pid, code, agent.gen.log_path
            )
        self._cleanup_dirs(agent.gen)

    def _cleanup_dirs(self, gen: AgentGeneration) -> None:
        # The agent removed its segments and socket on the way out, or kept the segments that
        # hold the only copy of a snapshot (storage lacks it, or the agent was killed): those
        # stay for the next agent of this job and node (or `flashckpt clean`). Its lock file
        # remains. Other files in its run directory (event logs of the agent's monitor) are kept.
        cfg = self.config
        for path in (
            names.lock_path(gen.run_dir, cfg.job, cfg.node),
            names.socket_path(gen.run_dir, cfg.job, cfg.node),
        ):
            with contextlib.suppress(OSError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(gen.run_dir)
        try:
            os.rmdir(gen.shm_dir)
        except FileNotFoundError:
            pass
        except OSError:
            with contextlib.suppress(OSError):
                left = sorted(os.listdir(gen.shm_dir))
                logger.info(
                    "kept %d file(s) in %s for the next launch of job %s: %s",
                    len(left),
                    gen.shm_dir,
                    cfg.job,
                    " ".join(left),
                )


_STARTUP_ERROR_PREFIX = "flashckpt agent: "


def _agent_output(agent: _Agent) -> list[str]:
    """The lines the agent wrote to its log (never raises: ``[]``)."""
    try:
        with open(agent.gen.log_path, "rb") as f:
            f.seek(agent.log_offset)
            text = f.read(256 * 1024).decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()]


def _startup_error(agent: _Agent) -> str | None:
    """The error an agent printed when it refused to start (``flashckpt agent: ...`` before it
    answered), or ``None``."""
    errors = [ln for ln in _agent_output(agent) if ln.startswith(_STARTUP_ERROR_PREFIX)]
    return errors[-1][len(_STARTUP_ERROR_PREFIX) :] if errors else None


def _log_tail(agent: _Agent, lines: int = 10) -> str:
    return "\n".join(_agent_output(agent)[-lines:])


def _agent_request(
    agent: _Agent, op: str, *, strict: bool = False, **fields: Any
) -> dict[str, Any]:
    """One request to ``agent``; ``{}`` when it does not answer (``strict``: raises)."""
    from flashckpt.protocol.channel import AgentClient, AgentError

    try:
        client = AgentClient(agent.gen.socket_path, timeout=2.0)
    except AgentError:
        if strict:
            raise
        return {}
    try:
        return client.request(op, timeout=30, **fields)
    except AgentError:
        if strict:
            raise
        return {}
    finally:
        client.close()


def world_replica_peers(world: Iterable[str], records: Iterable[Any], me: str) -> dict[str, str]:
    """The replica servers of the world's other machines: node id -> ``host:port``.

    Args:
        world: torch's rendezvous node descriptors of the round's participants.
        records: The job's node records (:class:`flashckpt.elastic.membership.nodes.NodeRecord`).
        me: This machine's node id (never in the result: a replica never sits on the machine
            it protects).
    """
    wanted = set(world)
    return {
        r.node_id: r.replica
        for r in records
        if r.rdzv_node in wanted and r.node_id != me and getattr(r, "replica", "")
    }
