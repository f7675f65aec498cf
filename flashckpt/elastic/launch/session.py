"""One machine's launch session: etcd, node key, node agent, torch's elastic agent, cleanup.

:class:`LaunchSession` is what :func:`flashckpt.elastic.launch.launcher.launch` runs. Its pieces:

- the etcd client, backend and store of our rendezvous
  (:mod:`flashckpt.elastic.rendezvous.backend`);
- this machine's lease-bound node key and the watch on its peers
  (:mod:`flashckpt.elastic.membership.nodes`);
- the flashckpt node agent process (:mod:`flashckpt.elastic.launch.agent_runner`);
- torch's ``LocalElasticAgent`` with hooks around each rendezvous and worker start
  (:class:`_WorkerSupervisor`).

What happens when a machine dies mid-training (machines A, B active; C standby):

1. B's launcher dies with the machine, and the links that A and C hold to its probe port
   (:mod:`flashckpt.elastic.membership.peerlinks`) close at once. They probe B: its port refuses
   (or nothing answers it), so they revoke B's lease. B's key disappears; the watches of its ring
   neighbours report it, and every machine's rendezvous sees B's join key go with it. (Without
   the links, or when B vanished without closing anything, A learns it when its
   workers fail in their next collective, gloo seeing B's sockets close, and A probes its
   peers before the next rendezvous round, :meth:`NodeRegistry.reap_dead_peers`; failing that,
   B's lease lapses after ``--lease-ttl``.)
2. A's launcher restarts its workers for the next round once B is reported gone, whether they
   failed in a collective or still run (blocked in one that waits for B, or between
   collectives; with no standby waiting, torch's agent alone would leave them there). Workers
   that fail with their world are a membership change, not a failure of theirs: the restart
   does not use up ``--max-restarts`` (:meth:`_WorkerSupervisor._monitor_workers`).
3. B's rendezvous keys live on its node lease (:meth:`RdzvHandler.share_lease`: one lease per
   machine), so they went with it in step 1 and A and the standby C form the next round without
   waiting for B. (Where the rendezvous keeps a lease of its own, a ``lease_ttl`` in
   ``--rdzv-conf`` other than ``--lease-ttl``, the launcher that found B dead ends B's rendezvous
   lease too: :meth:`RdzvHandler.expire_nodes`.)
4. A replaces its node agent by a fresh one (a membership change leaves the old agent with
   rank records and half-committed steps of the previous world), then starts its workers; they
   restore the newest step every rank can obtain (committed storage, since C has no memory).

What happens when a machine is cut off (a network partition: B's link goes down, B lives on):

1. B's renewals of its etcd lease fail. At ``ttl - ttl/5`` after the last one that succeeded,
   with no peer answering its probe port either, B is *fenced* (:meth:`LaunchSession._on_fenced`,
   from the registry's renew thread): its node agent is told ``fence`` (it commits and persists
   nothing more of this world, not even the dying workers' last snapshot), then its workers get
   SIGTERM and, at the lease's earliest expiry, SIGKILL; torch's heartbeats stop.
2. B's lease lapses; A and the standby C form the next round without it (as for a dead machine),
   and the job goes on from what A and storage hold. Storage's ``latest`` never moves backwards:
   B's agent is fenced, and every commit is checked against the manifests (agent_commit).
3. When B reaches etcd again it registers afresh (new lease, token and generation, never the
   stale membership) and joins the rendezvous as a standby; if the job ended meanwhile it
   leaves with 0, and after the rendezvous' join timeout without etcd it leaves with 1.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import socket
import sys
import termios
import threading
import time
from collections.abc import Iterable, Set
from datetime import timedelta
from types import FrameType, TracebackType
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from flashckpt import envnames, names
from flashckpt.elastic.etcd.client import EtcdClient, EtcdError, prefix_end
from flashckpt.elastic.etcd.standalone import StandaloneEtcd, StandaloneEtcdError
from flashckpt.elastic.launch import workererrors
from flashckpt.elastic.launch.agent_runner import (
    EXIT_KEPT,
    EXIT_MIRROR_FAILED,
    NodeAgentConfig,
    NodeAgentError,
    NodeAgentProcess,
    world_replica_peers,
)
from flashckpt.elastic.launch.config import EventLog, LauncherConfig, LaunchError
from flashckpt.elastic.launch.launchlock import LaunchLock
from flashckpt.elastic.launch.prewarm import PREWARM_SOCKET_ENV, Prewarmer
from flashckpt.elastic.launch.restore_report import (
    RestoreReporter,
    events_path,
    job_summary,
    say,
)
from flashckpt.elastic.launch.storage_check import check_storage
from flashckpt.elastic.launch.worker_entry import EXEC_FLAG, LAUNCHER_PID_ENV
from flashckpt.elastic.membership import health
from flashckpt.elastic.membership.jobview import JobViewPublisher, StragglerSwap, agent_status
from flashckpt.elastic.membership.nodes import (
    FenceNotice,
    NodeIdInUse,
    NodeRecord,
    NodeRegistry,
    nodes_prefix,
)
from flashckpt.elastic.rendezvous.backend import (
    DEFAULT_KEY_PREFIX,
    create_handler,
    job_prefix,
    use_fresh_worker_store,
)
from flashckpt.elastic.rendezvous.handler import RdzvHandler
from flashckpt.elastic.rendezvous.registry import BACKEND_NAME
from flashckpt.errors import AgentError
from flashckpt.protocol.channel import AgentClient
from flashckpt.protocol.messages import Fence
from flashckpt.trainer.interval import JOB_START_ENV

__all__ = ["LaunchError", "LaunchSession", "round_world"]

logger = logging.getLogger("flashckpt.launcher")

_DEFAULT_READ_TIMEOUT_S = 30
_PEERS_LEAVE_TIMEOUT = timedelta(seconds=10)
"""How long after its lease TTL a standby that finds the rendezvous closed waits for the
machines still active to leave (and say whether their workers finished)."""
_AGENT_READY_TIMEOUT = timedelta(seconds=120)
_HEALTH_TIMEOUT = timedelta(seconds=60)
_MAX_HEALTH_ROUNDS = 5
_PREWARM_READY_TIMEOUT_S = 120.0
# Every etcd call of the teardown: etcd answers in milliseconds when it is up, and when it is
# gone waiting the full read_timeout (30 s) per call only delays the exit (leases lapse anyway).
_TEARDOWN_ETCD_TIMEOUT = timedelta(seconds=2)
# Before the exit barrier, and while workers train (polling for waiting machines).
_PROBE_ETCD_TIMEOUT = timedelta(seconds=2)
# Peers each launcher holds a link to (the next ones in the ring of node ids): every machine's
# death is then seen by two others when its sockets close, whatever its peers' workers do.
_LINKS = 2
# torchrun's default set (--signals-to-handle).
_HANDLED_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


class _Unhealthy(Exception):
    """This machine failed the health check."""


class _LeaveJob(Exception):
    """This fenced machine leaves the job (it stayed cut off too long, or lost its node id)."""


# Before the lease's earliest expiry the fence SIGKILLs the workers that are still there.
_FENCE_KILL_MARGIN_S = 0.1


def round_world(records: Iterable[NodeRecord], members: Set[int]) -> set[str] | None:
    """The rendezvous descriptors of a round's members, from the job's node records alone.

    Args:
        records: The job's node records.
        members: The round's member ids (:meth:`RdzvHandler.members`).

    Returns:
        The members' descriptors when every member's record carries its id in the round
        (``rdzv_member``, unique across rounds: a join key's create revision); None when some
        member's record does not say it yet (it is between its rendezvous and its record's
        update), or there are no members.
    """
    found = {r.rdzv_member: r.rdzv_node for r in records if r.rdzv_member in members}
    if not members or len(found) < len(members) or not all(found.values()):
        return None
    return {str(node) for node in found.values()}


class LaunchSession:
    """Sets up, runs and tears down one machine of an elastic job.

    Use as a context manager: ``__enter__`` connects to etcd, registers the node and starts
    the node agent; :meth:`run` runs the workers until the job ends; ``__exit__`` releases
    everything (rendezvous, node key, node agent, private etcd), even after a failure.

    Args:
        config: The launcher configuration.
        events: Where lifecycle events go.
    """

    def __init__(self, config: LauncherConfig, events: EventLog) -> None:
        self.config = config
        self.events = events
        self._lock = threading.Lock()
        self._standalone: StandaloneEtcd | None = None
        self._registry: NodeRegistry | None = None
        self._node_agent: NodeAgentProcess | None = None
        self._prewarmer: Prewarmer | None = None
        self._client: EtcdClient | None = None
        self._handler: RdzvHandler | None = None
        self._agent: _WorkerSupervisor | None = None
        self._job_prefix = ""
        self._shutdown_rdzv = False
        self._rounds = 0
        self._lost_active = 0
        # torch's node descriptors of the machines of the round the workers run in, and those
        # of them gone since it formed (the workers' failure is then the world's).
        self._round_members: frozenset[int] = frozenset()  # RdzvHandler.members()
        self._round_lost: list[NodeRecord] = []
        self._workers_done = False  # this machine's workers finished the job (published on leaving)
        self._last_view: tuple[tuple[int, ...], int] | None = None
        self._old_handlers: dict[int, Any] = {}
        self._jobview: JobViewPublisher | None = None
        self._retire_reason: str | None = None
        self._signalled_at: float | None = None
        self._in_teardown = False
        self._agent_exit: int | None = None  # the node agent's exit code, once stopped
        self._starts = 0
        self._reporter = RestoreReporter(os.devnull, 0)
        # Replicas of snapshots in other machines' memory: none where the job has one machine.
        self._replicas = config.replicas if config.max_nodes > 1 else 0
        # Fencing (a network partition, see the module docstring): the notice while fenced, the
        # workers' pids the fence stops, set once the machine registered again (or must leave).
        self._fence: FenceNotice | None = None
        self._was_fenced = False
        # Registered again after a fence while the job still trained: it then waited as a
        # standby, and a job that finishes without it releases it as one (not "cut off").
        self._rejoined_running = False
        self._healed = threading.Event()
        self._leave_reason: str | None = None
        self._worker_pids: list[int] = []
        # Where the workers record errors no restart can mend (workererrors), and the ones
        # that ended the job.
        self._errors_dir: str | None = None
        self._fatal: list[workererrors.WorkerError] = []
        self._launch_lock: LaunchLock | None = None

    # ---------------------------------------------------------------------------- set-up

    def __enter__(self) -> LaunchSession:
        for sig in _HANDLED_SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._teardown()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The launcher's handler of SIGTERM/SIGINT/SIGHUP/SIGQUIT (torchrun's set).

        Like torch's own handler it raises ``SignalException`` in the main thread, so torch's
        agent stops the workers (SIGTERM, then SIGKILL after ``--shutdown-timeout``) and
        :meth:`run` returns 128+N. First it only sets flags: the shutdown deadline starts, and
        the node agent is no longer restarted if it exits (a signal to the whole process group
        reaches it too). During the teardown further signals are noted, not raised: a second
        Ctrl-C must not skip the clean-up.
        """
        sigval = signal.Signals(signum)
        if signum == getattr(signal, "SIGHUP", None):
            _leave_hung_up_terminal()
        if self._signalled_at is None:
            self._signalled_at = time.monotonic()
        agent = self._node_agent
        if agent is not None:
            agent.refuse_restarts()
        if self._in_teardown:
            return
        raise SignalException(f"launcher {os.getpid()} got signal {sigval.name}", sigval=sigval)

    def install_signal_handlers(self) -> None:
        """(Re)installs :meth:`_on_signal`; torch's process context replaces it at each start
        of the workers with its own, which would skip the flags."""
        for sig in _HANDLED_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(sig, self._on_signal)

    def _setup(self) -> None:
        cfg = self.config
        run_dir = cfg.run_dir or _default_run_dir()
        self.events("launcher_start", pid=os.getpid())
        # First of all: a second launch of a job that runs here is refused before it touches
        # anything (its agent would crash-loop on the first one's lock, then remove the first
        # one's socket and lock file).
        self._launch_lock = LaunchLock.acquire(_ensure_dir(run_dir), cfg.rdzv_id, cfg.node_id)
        if cfg.storage:
            problem = check_storage(cfg.storage, cfg.rdzv_id, takeover=cfg.takeover)
            if problem is not None:
                raise LaunchError(problem)
        endpoint = cfg.rdzv_endpoint
        if cfg.standalone:
            self._standalone = StandaloneEtcd(parent_dir=_ensure_dir(run_dir))
            try:
                endpoint = self._standalone.start()
            except StandaloneEtcdError as exc:
                raise LaunchError(str(exc)) from exc
            logger.info("standalone: private etcd at %s", endpoint)
        assert endpoint is not None
        self._set_worker_environment()

        conf: dict[str, Any] = {
            "read_timeout": str(_DEFAULT_READ_TIMEOUT_S),
            # A dead machine's rendezvous keys go with their lease, like its node key.
            "lease_ttl": str(cfg.lease_ttl),
            **cfg.rdzv_conf,
            **cfg.etcd_options(),  # etcd TLS and auth (issue 44)
        }
        try:
            params = RendezvousParameters(
                backend=BACKEND_NAME,
                endpoint=endpoint,
                run_id=cfg.rdzv_id,
                min_nodes=cfg.min_nodes,
                max_nodes=cfg.max_nodes,
                local_addr=cfg.local_addr,
                **conf,
            )
            handler = create_handler(params)
        except ValueError as exc:
            raise LaunchError(f"--rdzv-conf/--rdzv-endpoint: {exc}") from exc
        client = self._client = handler.client
        read_timeout = client.timeout
        key_prefix = str(params.get("key_prefix", DEFAULT_KEY_PREFIX))
        self._job_prefix = job_prefix(cfg.rdzv_id, key_prefix)
        node_key = nodes_prefix(self._job_prefix) + cfg.node_id
        try:
            # One read says all: etcd answers, whether this node failed a health check earlier
            # in the job, whether its node id is held, and whether the job runs (one request
            # per machine, as the health check's read alone was).
            # The rendezvous' own keys sit beside its round key.
            rdzv_prefix = handler.round_key.removesuffix("round")
            (marked, held, running, closed, done), _ = client.get_many(
                [
                    health.unhealthy_key(self._job_prefix, cfg.node_id),
                    node_key,
                    handler.round_key,
                    rdzv_prefix + "closed",
                    rdzv_prefix + "done",
                ],
                timeout=read_timeout,
            )
            reason = None if marked is None else marked.value.decode(errors="replace")
        except EtcdError as exc:
            raise LaunchError(
                f"cannot reach etcd at {','.join(client.endpoints)} within "
                f"{read_timeout.total_seconds():g} s ({exc}). Start etcd there or fix "
                "--rdzv-endpoint (every machine of the job must reach it); for a "
                "single-machine run use --standalone; to wait longer pass --rdzv-conf "
                "read_timeout=<seconds>"
            ) from exc
        handler.note_reachable()  # an etcd outage from now on is waited out in the rendezvous
        if reason is not None:
            raise LaunchError(
                f"node {cfg.node_id!r} failed a health check earlier in job {cfg.rdzv_id!r} "
                f"({reason}) and is not admitted again; repair the machine and delete etcd key "
                f"{health.unhealthy_key(self._job_prefix, cfg.node_id)}, or run it in another "
                "job"
            )

        if closed is not None:
            self._arrived_after_end(client, closed, done is not None, read_timeout)

        self._registry = NodeRegistry(
            client,
            self._job_prefix,
            cfg.node_id,
            ttl=timedelta(seconds=cfg.lease_ttl),
            advertise_host=cfg.local_addr,
            on_lost=self._on_peer_lost,
            # A private etcd on this machine: nobody else can take its place.
            on_fenced=None if cfg.standalone else self._on_fenced,
            links=_LINKS if cfg.probe else 0,
        )
        # One lease per machine: the rendezvous keys live on the node lease (one renewal, and a
        # peer that revokes it as dead ends both at once).
        shared = handler.share_lease(self._registry)
        # The node key is created by the first join, in its transaction (one request, not two:
        # issue 31), unless the id is held: then the registration settles that here, before
        # anything starts (a live launcher's: NodeIdInUse; a dead one's: taken over); or unless
        # the job runs: a machine joining it (a standby) follows its peers from its
        # registration on, as before (its first join would only learn the round it waits for).
        with_join = shared and held is None and running is None
        try:
            # Its rendezvous descriptor and state go in the key's creation: no second write,
            # which each of its watching neighbours would receive (issue 31).
            # The peers' watch, links and compaction start once this machine has its rank
            # (after_rendezvous): nothing on the way to a round needs them, and at 1,024
            # machines they were most of the liveness layer's cost in the first round (issue
            # 31). A machine that joins a running job (its round key exists: a standby) or
            # waits past its first round starts them at once (on_waiting), to follow its peers
            # while it waits.
            self._registry.start(
                read_timeout,
                watch=False,
                watch_if=None if with_join else handler.round_key,
                with_join=with_join,
                rdzv_node=handler.node,
                state="waiting",
            )
        except NodeIdInUse as exc:
            raise LaunchError(str(exc)) from exc
        except EtcdError as exc:
            raise LaunchError(f"cannot register node {cfg.node_id!r} in etcd: {exc}") from exc
        self.events("registered", key=self._registry.key)

        try:
            self._node_agent = NodeAgentProcess(
                NodeAgentConfig(
                    job=cfg.rdzv_id,
                    node=cfg.node_id,
                    storage=cfg.storage,
                    shm_dir=cfg.shm_dir,
                    run_dir=run_dir,
                    keep=cfg.keep,
                    metrics_port=cfg.metrics_port,
                    replicas=self._replicas,
                    replica_bind=cfg.local_addr or "0.0.0.0",
                    replica_advertise=cfg.local_addr or socket.getfqdn(),
                )
            )
        except ValueError as exc:
            raise LaunchError(str(exc)) from exc
        registry = self._registry
        # Short: the supervisor waits for it (a failed write is logged; the record carries the
        # address at its next write).
        self._node_agent.on_replica_address = lambda addr: registry.update(
            replica=addr, timeout=_PROBE_ETCD_TIMEOUT
        )
        self._node_agent.start()
        self._reporter = RestoreReporter(
            events_path(run_dir, cfg.rdzv_id, cfg.node_id),
            cfg.nproc_per_node,
            prefix=f"[flashckpt run {cfg.node_id}] ",
        )
        # A zygote forks Python processes; --no-python runs something else.
        if cfg.prewarm and not cfg.no_python:
            sock = names.prewarm_socket_path(run_dir, cfg.rdzv_id, cfg.node_id)
            if len(sock.encode()) > 100:
                raise LaunchError(
                    f"the pre-warm socket path {sock!r} is too long for a Unix socket: use a "
                    "shorter --run-dir, --rdzv-id or --node-id"
                )
            self._prewarmer = Prewarmer(
                sock, names.prewarm_log_path(run_dir, cfg.rdzv_id, cfg.node_id)
            )
            self._prewarmer.start()

        threading.Thread(target=self._report_warm, name="flashckpt-warm", daemon=True).start()
        self._handler = handler
        handler.on_waiting = lambda _round: registry.watch_peers()
        self._start_job_view(client)

        entry = ["-u", "-m", "flashckpt.elastic.launch.worker_entry"]
        if cfg.no_python:
            entry += [EXEC_FLAG, cfg.entrypoint]
        else:
            entry += ["-m", cfg.entrypoint] if cfg.module else [cfg.entrypoint]
        spec = WorkerSpec(
            role="trainer",
            local_world_size=cfg.nproc_per_node,
            rdzv_handler=handler,
            entrypoint=os.environ.get("PYTHON_EXEC", sys.executable),
            args=(*entry, *cfg.entrypoint_args),
            max_restarts=cfg.max_restarts,
            monitor_interval=cfg.monitor_interval,
            local_addr=cfg.local_addr,
        )
        self._agent = _WorkerSupervisor(
            spec,
            logs_specs=DefaultLogsSpecs(
                log_dir=cfg.log_dir,
                redirects=Std.from_str(cfg.redirects),
                tee=Std.from_str(cfg.tee),
                local_ranks_filter=set(cfg.local_ranks_filter) if cfg.local_ranks_filter else None,
            ),
            session=self,
            shutdown_timeout=cfg.shutdown_timeout,
            start_method=cfg.start_method,
        )

    def _arrived_after_end(
        self, client: EtcdClient, closed: Any, done: bool, timeout: timedelta
    ) -> None:
        """This launcher found its job's rendezvous closed before it registered: it arrived
        after the job ended (the same command run again), not as a standby of a running job.
        Without ``--rerun-finished`` that is an error naming the choices (a launcher that did
        nothing and exited 0 looked like a successful run); with it the rendezvous is reopened
        (``closed`` and ``done`` deleted, only if ``closed`` is still the one read) and the
        workers resume from the job's committed state.

        Raises:
            LaunchError: Without ``--rerun-finished``, or when etcd fails to reopen it.
        """
        cfg = self.config
        by = "another machine"
        with contextlib.suppress(Exception):  # the closer's id is a detail of the message
            by = f"machine {json.loads(closed.value)['by']!r}"
        how = "its workers finished" if done else "it ended without finishing (a machine gave up)"
        if not cfg.rerun_finished:
            self.events("job_already_finished", done=done)
            raise LaunchError(
                f"job {cfg.rdzv_id!r} already ended ({how}; {by} closed its rendezvous in etcd): "
                "this launcher has nothing to run, and starts no worker. To train it again from "
                "its committed state (e.g. with more steps), run the same command with "
                "--rerun-finished on every machine; to start over, use a new --rdzv-id and an "
                "empty --storage. (etcd forgets the ended job about 2 h after its end.)"
            )
        done_key = bytes(closed.key).removesuffix(b"closed") + b"done"
        try:
            reopened = client.compare_and_delete(
                closed.key, mod_revision=closed.mod_revision, timeout=timeout
            )
            if reopened:  # else the launcher of the rerun that reopened it deleted both
                client.delete(done_key, timeout=timeout)
        except EtcdError as exc:
            raise LaunchError(f"cannot reopen job {cfg.rdzv_id!r} in etcd: {exc}") from exc
        logger.warning(
            "job %r had ended (%s); --rerun-finished: %s its rendezvous, the workers resume from "
            "its committed state",
            cfg.rdzv_id,
            how,
            "reopened" if reopened else "another launcher of the rerun reopened",
        )
        self.events("job_reopened", done=done, by_us=reopened)

    def _set_worker_environment(self) -> None:
        cfg = self.config
        # Worker rank 0 hosts a fresh TCPStore every round (see use_fresh_worker_store).
        use_fresh_worker_store()
        if "OMP_NUM_THREADS" not in os.environ and cfg.nproc_per_node > 1:
            # torchrun's default and its message: N workers x all cores oversubscribe the CPU,
            # and the numerics follow the thread count.
            logger.warning(
                "\n*****************************************\n"
                "Setting OMP_NUM_THREADS environment variable for each process to be "
                "1 in default, to avoid your system being overloaded, "
                "please further tune the variable for optimal performance in "
                "your application as needed. \n"
                "*****************************************"
            )
            os.environ["OMP_NUM_THREADS"] = "1"
        # Inherited by the workers: flashckpt.checkpointing() connects to our node agent.
        os.environ[envnames.JOB] = cfg.rdzv_id
        os.environ[envnames.NODE] = cfg.node_id
        # FLASHCKPT_RUN_DIR and FLASHCKPT_SHM_DIR follow the node agent's generation; they are
        # set before each start of the workers.
        if cfg.storage:
            os.environ[envnames.STORAGE] = cfg.storage
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        # every="auto" estimates the failure rate from torch's restart count over this span.
        os.environ[JOB_START_ENV] = repr(time.time())

    def _report_warm(self) -> None:
        """Records when this machine could start workers at once (agent and zygote ready)."""
        agent, prewarmer = self._node_agent, self._prewarmer
        try:
            if agent is not None:
                agent.wait_ready(_AGENT_READY_TIMEOUT)
            if prewarmer is not None and not prewarmer.wait_ready(_PREWARM_READY_TIMEOUT_S):
                return
        except NodeAgentError:
            return
        self.events("warm")

    # ---------------------------------------------------------------------------- running

    def run(self) -> int:
        """Runs the workers until the job ends.

        Returns:
            0 when the job finished or this standby was not needed, 1 when the workers failed
            beyond ``--max-restarts`` or the rendezvous failed, 128+N after signal N.
        """
        assert self._agent is not None
        cfg = self.config
        try:
            result = self._agent.run()
        except SignalException as exc:
            if self._retire_reason is not None:
                logger.warning("left the job for a standby: %s", self._retire_reason)
                self.events("retired", reason=self._retire_reason)
                return 0
            logger.warning("stopping on %s", exc.sigval.name)
            self.events("signal", signal=exc.sigval.name)
            return 128 + int(exc.sigval)
        except _Unhealthy as exc:
            logger.error("%s", exc)
            return 1
        except NodeIdInUse as exc:
            # Taken between the launcher's read of the node key and its first join (which
            # creates the key): the same refusal as at the registration.
            logger.error("%s", exc)
            return 2
        except _LeaveJob as exc:
            logger.warning("leaving the job: %s", exc)
            self.events("left", reason=str(exc))
            return 1
        except RendezvousClosedError:
            if self._was_fenced:
                logger.warning(
                    "this machine was fenced (cut off from etcd and its peers); the job "
                    "finished without it: leaving with nothing of its old world committed"
                )
                self.events("left", reason="the job finished while this machine was cut off")
                return 0
            # A standby finds the rendezvous closed when it waited outside the round (an etcd
            # outage dropped it from torch's standby list): it was not needed if the job's
            # workers finished (issue 31).
            registry = self._registry
            if registry is not None and self._finished_elsewhere(
                registry.ttl + _PEERS_LEAVE_TIMEOUT
            ):
                logger.info("the job finished without needing this standby machine")
                self.events("standby_released")
                return 0
            logger.error(
                "the rendezvous of job %r is closed: the job finished or a machine gave up; "
                "start a new job with another --rdzv-id",
                cfg.rdzv_id,
            )
            return 1
        except RendezvousTimeoutError as exc:
            logger.error(
                "the rendezvous of job %r did not complete in time (%s); check that %d to %d "
                "machines were started with this --rdzv-id, or raise --rdzv-conf join_timeout",
                cfg.rdzv_id,
                exc,
                cfg.min_nodes,
                cfg.max_nodes,
            )
            self._shutdown_rdzv = True
            return 1
        except (RendezvousError, NodeAgentError) as exc:
            logger.error("%s", exc)
            return 1
        if result is None:
            if self._was_fenced and not self._rejoined_running:
                logger.warning(
                    "this machine was fenced (cut off from etcd and its peers); the job "
                    "finished without it: leaving with nothing of its old world committed"
                )
                self.events("left", reason="the job finished while this machine was cut off")
                return 0
            logger.info("the job finished without needing this standby machine")
            self.events("standby_released")
            return 0
        # A machine that was cut off never ends the job for the others: its workers' failures
        # may be the partition's.
        self._shutdown_rdzv = not (result.is_failed() and self._was_fenced)
        if result.is_failed() and self._fatal:
            errors = "\n".join(e.describe() for e in self._fatal)
            logger.error(
                "the workers failed with an error no restart can mend (not restarted: a "
                "restart would fail the same way):\n%s",
                errors,
            )
            self.events("failed", restartable=False, errors=[e.type for e in self._fatal])
            return 1
        if result.is_failed():
            logger.error("workers failed: %s", _describe_failures(result))
            self.events("failed")
            return 1
        self._workers_done = True
        self.events("succeeded")
        return 0

    def _job_finished_now(self) -> bool:
        """Whether the job's training has finished (one read of its job-level key); False when
        that cannot be read."""
        handler = self._handler
        if handler is None:
            return False
        try:
            return bool(handler.finished_done(timeout=_PROBE_ETCD_TIMEOUT))
        except Exception as exc:  # etcd just came back: unknown counts as still running
            logger.debug("cannot read whether the job finished: %s", exc)
            return False

    def _finished_elsewhere(self, timeout: timedelta) -> bool:
        """Whether a machine of the job closed the rendezvous with its workers done (the job's
        training finished: :meth:`RdzvHandler.finished_done`), waiting up to ``timeout`` while
        another machine of the job is still registered (it may yet close it so).

        For a machine that finds the rendezvous closed while it waits (a standby). One read of
        the job-level key, and one count of the node keys, every quarter second: O(1)
        whatever the size of the job (the watch of every peer's record it replaced cost N
        messages per machine per change). A job whose machines all left without it (failed,
        signalled), or whose mark is not seen in time (etcd unreachable), did not finish.
        """
        handler, client, registry = self._handler, self._client, self._registry
        if handler is None or client is None or registry is None:
            return False
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                if handler.finished_done(timeout=_PROBE_ETCD_TIMEOUT):
                    return True
                prefix = nodes_prefix(self._job_prefix)
                (total, own), _ = client.counts(
                    [(prefix, prefix_end(prefix), 0), (registry.key, None, 0)],
                    timeout=_PROBE_ETCD_TIMEOUT,
                )
                others = total - own
            except EtcdError as exc:
                logger.info("cannot read whether the job finished: %s", exc)
                others = 1
            if others <= 0 or time.monotonic() >= deadline:
                return False
            time.sleep(0.25)

    def exit_code(self, code: int) -> int:
        """The launcher's exit code once everything is released: ``code`` (from :meth:`run`),
        or 1 where it was 0 but the node agent's last write failed (storage lacks the newest
        snapshot: the agent kept it in memory; or the final step never reached the mirror).
        A job whose work is not where the user asked it to be never ends with 0."""
        # Also after a failure of the workers (an error no restart can mend, the final
        # commit's included): where the work is, is what the user needs next.
        if code not in (0, 1) or self._agent_exit not in (EXIT_KEPT, EXIT_MIRROR_FAILED):
            return code
        cfg = self.config
        if self._agent_exit == EXIT_KEPT:
            where = cfg.storage or "(the script's storage=)"
            what = (
                f"the newest snapshot is not in storage {where}"
                " (the node agent's writes there failed; its log says why): it is kept in this "
                "machine's shared memory. Fix the storage and run the same command again: it "
                "resumes from memory and writes it"
            )
        else:
            what = "the final step never reached the mirror (the node agent's log says why)"
        logger.error("%s; exit code 1", what)
        self.events("final_persist_failed", agent_exit=self._agent_exit)
        return 1

    # ---------------------------------------------------------------------------- hooks

    def _on_peer_lost(self, record: NodeRecord, via: str) -> None:
        self.events("peer_lost", peer=record.node_id, peer_state=record.state, via=via)
        with self._lock:
            if record.state == "active":
                self._lost_active += 1
            if record.rdzv_member is not None and record.rdzv_member in self._round_members:
                self._round_lost.append(record)
        # The machine that found it dead (a probe, a broken link: it revoked the node lease
        # early) ends its rendezvous lease too; one whose node lease lapsed ("watch") lost its
        # rendezvous lease at the same time, and N machines each revoking it would be N^2
        # requests in a mass event. Never raises: its rendezvous lease ends its keys anyway.
        if (
            via != "watch"
            and record.rdzv_node
            and self._handler
            and self._handler.expire_nodes([record.rdzv_node])
        ):
            self.events("peer_expired", peer=record.node_id)

    # ---------------------------------------------------------------------------- fencing

    def workers_started(self, pids: dict[int, int]) -> None:
        """Records the workers' pids (the fence stops them from another thread)."""
        with self._lock:
            self._worker_pids = sorted(pids.values())

    @property
    def fenced(self) -> bool:
        """Whether this machine is fenced and has not rejoined the job yet."""
        with self._lock:
            return self._fence is not None

    def _on_fenced(self, notice: FenceNotice) -> None:
        """The registry's renew thread: this machine is cut off; stop everything that writes
        for the job before its lease can lapse (``notice.expiry``): the node agent's commits
        first (so the dying workers' snapshots are not persisted), then the workers."""
        with self._lock:
            if self._fence is not None:
                return
            self._fence, self._was_fenced = notice, True
            self._healed.clear()
            pids = list(self._worker_pids)
        left = notice.expiry - time.monotonic()
        logger.warning(
            "FENCED: %s. This machine is cut off from the job: the node agent commits nothing "
            "more, the workers (pids %s) stop now (SIGTERM; SIGKILL in %.1f s, before the "
            "lease can lapse)",
            notice.reason,
            pids or "none",
            max(0.0, left - _FENCE_KILL_MARGIN_S),
        )
        self.events("fenced", reason=notice.reason, generation=notice.generation, pids=pids)
        agent = threading.Thread(
            target=self._fence_agent, args=(notice,), name="flashckpt-fence-agent", daemon=True
        )
        agent.start()
        agent.join(timeout=max(0.0, min(0.2, left / 4)))  # its first step is instant
        self._stop_workers_by(pids, notice.expiry - _FENCE_KILL_MARGIN_S)
        with self._lock:
            self._worker_pids = []
        agent.join(timeout=max(0.0, notice.expiry - time.monotonic()))
        # Its rendezvous keys must lapse with this registration: no more renewals (the next
        # rendezvous takes a new lease, as a standby).
        if self._handler is not None:
            self._handler.suspend()
        threading.Thread(target=self._await_heal, name="flashckpt-heal", daemon=True).start()

    def _fence_agent(self, notice: FenceNotice) -> None:
        node_agent = self._node_agent
        gen = node_agent.current if node_agent is not None else None
        if gen is None:
            return
        left = max(0.1, notice.expiry - time.monotonic())
        try:
            client = AgentClient(gen.socket_path, timeout=min(1.0, left))
            try:
                client.call(Fence(reason=notice.reason[:200], timeout_s=left), timeout=left + 1)
            finally:
                client.close()
        except (AgentError, OSError) as exc:
            # The commit check in the agent (a step older than another world's) still holds.
            logger.error("could not fence the node agent: %s", exc)
            return
        logger.warning("node agent fenced: it commits nothing more of this world")
        self.events("agent_fenced")

    def _stop_workers_by(self, pids: list[int], kill_at: float) -> None:
        """SIGTERM to the workers now, SIGKILL at ``kill_at`` (monotonic) to those left."""
        killed = stop_processes(pids, kill_at)
        logger.warning(
            "fence: the workers are stopped (%s)",
            f"SIGKILL for pids {killed}" if killed else "they exited on SIGTERM",
        )
        self.events("fence_workers_stopped", pids=pids, killed=killed)

    def _rejoin_limit_s(self) -> float:
        """How long a fenced machine waits for etcd before it leaves the job: the rendezvous'
        join timeout (torch's default 600 s)."""
        handler = self._handler
        return handler.join_timeout.total_seconds() if handler is not None else 600.0

    def _await_heal(self) -> None:
        """From the fence on: registers the machine again as soon as etcd answers."""
        registry = self._registry
        assert registry is not None
        limit = self._rejoin_limit_s()
        leave_at = time.monotonic() + limit
        reason: str | None = None
        while not self._in_teardown:
            if self.etcd_reachable():
                try:
                    generation = registry.rejoin(timedelta(seconds=10))
                except NodeIdInUse as exc:
                    reason = str(exc)
                    break
                except EtcdError as exc:
                    logger.warning("registering again after the fence failed (retrying): %s", exc)
                else:
                    logger.warning(
                        "the link is back: registered again as generation %d; joining the "
                        "rendezvous as a standby (never with the old membership)",
                        generation,
                    )
                    self.events("rejoined", generation=generation)
                    self._rejoined_running = not self._job_finished_now()
                    break
            if time.monotonic() > leave_at:
                reason = f"etcd stayed unreachable for {limit:.0f} s after the fence"
                break
            time.sleep(0.5)
        with self._lock:
            self._leave_reason = reason
        self._healed.set()

    def wait_for_heal(self) -> None:
        """The main thread, once the fence stopped the workers: waits until the machine is
        registered again (then torch forms a round, where it joins as a standby).

        Raises:
            _LeaveJob: It must leave the job instead.
        """
        logger.warning(
            "waiting for the link to come back to rejoin the job as a standby (leaving after "
            "%.0f s)",
            self._rejoin_limit_s(),
        )
        while not self._healed.wait(1.0):
            pass
        with self._lock:
            self._fence = None
            reason = self._leave_reason
        if reason is not None:
            raise _LeaveJob(reason)

    def before_rendezvous(self) -> None:
        """Called before every rendezvous round (the first one and each restart)."""
        assert self._registry is not None and self._node_agent is not None
        if self.fenced:
            self.wait_for_heal()
        self._rounds += 1
        # This machine's count of its rendezvous attempts, not a round number: a machine that
        # joined late or stood by counts fewer. The round (the number in etcd, the same on
        # every machine) is in rendezvous_done and workers_start.
        self.events("rendezvous_start", attempt=self._rounds)
        if self._rounds > 1 and self.config.probe:
            self._registry.reap_dead_peers()
        if self._rounds == 1 and self._replicas:
            # The agent's replica address is in this machine's record before it joins: every
            # machine of the round finds it there (send_replica_peers) once the round formed.
            self._node_agent.wait_ready(_AGENT_READY_TIMEOUT)
        # Writes nothing in the first round (the registration published it). Between two
        # rounds, etcd gets ``waiting`` only if the next round has not formed within a lease
        # TTL: a restart that forms it sooner writes only its new rank (after_rendezvous), not
        # a write and a message to each of its watchers for a state nobody acts on (issue 31).
        # This machine's own view (the job view's role) says ``waiting`` at once.
        self._registry.update(
            state="waiting",
            group_rank=None,
            publish_after=timedelta(seconds=self.config.lease_ttl) if self._rounds > 1 else None,
        )

    def after_rendezvous(self, worker_group: WorkerGroup) -> None:
        """Called after a rendezvous round completed; runs the health check if enabled."""
        assert self._registry is not None
        handler = self._handler
        self.events(
            "rendezvous_done",
            round=handler.round if handler is not None else None,
            group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size,
        )
        # The round's members come from its result, which the handler holds (no read of the
        # round's N join keys); this machine's id among them goes in its record, where a peer
        # that sees it go finds whether it was in its round (_on_peer_lost).
        members = handler.members() if handler is not None else frozenset()
        member_id = handler.member_id if handler is not None else None
        with self._lock:
            self._round_members = members
            self._round_lost = []
        self._registry.update(
            state="active", group_rank=worker_group.group_rank, rdzv_member=member_id
        )
        self._registry.watch_peers()  # if not yet (see _setup)
        if self.config.health_check:
            self._health_check(worker_group)

    def round_lost(self, *, failed: bool) -> str | None:
        """A machine of the workers' round gone since the round formed, if any (its node id,
        or how many of the round are gone when only etcd knows it yet).

        Args:
            failed: The workers failed: a dead machine of the round is likely why, and its
                report may not have come yet (another thread may be revoking its lease right
                now), so the round's machines are probed and etcd is asked which of them still
                hold a key; a machine that left (stopped, preempted, or done with the job)
                counts too. For workers that still run, only reports count, and a machine
                that left with its workers done (``NodeRecord.done``) broke nothing: they
                finish too; one that left otherwise (SIGTERM, preemption) took its workers
                out of the round, so they are restarted at once, stalled or not.
        """
        assert self._registry is not None
        with self._lock:
            members = self._round_members
            gone = [r for r in self._round_lost if failed or not r.left_done]
        if gone:
            return gone[0].node_id
        handler = self._handler
        if not failed or not members or handler is None:
            return None
        if self.config.probe:
            # The round's machines this one watches (its ring neighbours, a bounded set): one
            # found dead here is reported (_on_peer_lost) and its leases revoked at once.
            peers = {n for n, r in self._registry.peers().items() if r.rdzv_member in members}
            if peers:
                self._registry.reap_dead_peers(peers)
            with self._lock:
                gone = list(self._round_lost)
            if gone:
                return gone[0].node_id
        # Whether every member still holds its join key (on its node lease: a machine found
        # dead anywhere, or whose lease lapsed, holds none): one count, not a read of N keys.
        try:
            missing = handler.members_gone(timeout=_PROBE_ETCD_TIMEOUT)
        except EtcdError as exc:
            logger.warning("cannot count the round's machines in etcd after the failure: %s", exc)
            return None
        if missing:
            return f"{missing} of round {handler.round}"
        return None

    def before_start_workers(self, worker_group: WorkerGroup) -> None:
        """Called before workers start: makes sure a node agent fit for this world answers."""
        assert self._node_agent is not None
        view = (
            tuple(w.global_rank for w in worker_group.workers),
            worker_group.workers[0].world_size,
        )
        with self._lock:
            lost, self._lost_active = self._lost_active, 0
        if self._last_view is not None and (lost > 0 or view != self._last_view):
            # The node agent stays: it keys snapshots by local rank and tags them with the world
            # (rendezvous round), so the survivors reload from its memory under their new ranks
            # and persistence of the new world is not held up by the old world's records.
            self.events("membership_changed", lost=lost, ranks=list(view[0]))
        with self._lock:
            if self._fence is not None and self._healed.is_set() and self._leave_reason is None:
                # Fenced while waiting in the rendezvous (no workers to stop), registered again
                # since, and in a round now: these workers belong to the new world.
                self._fence = None
        generation = self._node_agent.wait_ready(_AGENT_READY_TIMEOUT)
        self._send_replica_peers()
        self._use_prewarmer()
        os.environ[envnames.RUN_DIR] = generation.run_dir
        os.environ[envnames.SHM_DIR] = generation.shm_dir
        self._clear_worker_errors()
        self._last_view = view
        self._starts += 1
        # The round in etcd, as every machine of it prints it (a count of this machine's starts
        # differs on a machine that joined late or stood by).
        rnd = self._handler.round if self._handler is not None else None
        self.events(
            "workers_start",
            round=rnd,
            ranks=list(view[0]),
            world_size=view[1],
            agent_gen=generation.number,
        )
        self._reporter.workers_started(time.time(), round_no=rnd)

    def _clear_worker_errors(self) -> None:
        """A fresh, empty directory for this start's records of errors no restart can mend."""
        cfg = self.config
        if self._errors_dir is None:
            self._errors_dir = os.path.join(
                cfg.run_dir or _default_run_dir(), f"{cfg.rdzv_id}.{cfg.node_id}.worker-errors"
            )
        try:
            workererrors.clear(self._errors_dir)
        except OSError as exc:  # the records are a help: without them failures restart as before
            logger.warning("cannot prepare %s: %s", self._errors_dir, exc)
            os.environ.pop(envnames.WORKER_ERRORS, None)
            return
        os.environ[envnames.WORKER_ERRORS] = self._errors_dir

    def unrestartable_failure(self) -> list[workererrors.WorkerError]:
        """The errors no restart can mend that this start's failed workers recorded; once any
        is found, the launcher fails with them (:meth:`run`)."""
        if self._errors_dir is None:
            return []
        found = workererrors.read(self._errors_dir, list(range(self.config.nproc_per_node)))
        if found:
            self._fatal = found
        return found

    def _send_replica_peers(self) -> None:
        """Gives the node agent the replica servers of this round's other machines: it sends
        its snapshots to the next one in ring order, and drops what it holds of machines that
        left once the new world snapshotted (see :mod:`flashckpt.agent.replicas.holder`)."""
        agent, registry = self._node_agent, self._registry
        if not self._replicas or agent is None or registry is None:
            return
        try:
            records = registry.records(timeout=_PROBE_ETCD_TIMEOUT)
        except EtcdError as exc:
            logger.warning(
                "cannot read the job's nodes from etcd: replica peers unchanged: %s", exc
            )
            return
        # The replica ring needs every member's record (its replica server), so this path reads
        # the job's N node records once a round, and only with --replicas: the agent's peer
        # list is the world (it sends to the next machine in ring order, drops what it holds
        # of machines that left, and a restarted agent pulls from the known peers). Who is in
        # the round comes from those records (each carries its member id in the round, see
        # after_rendezvous); only when a member has not written its id yet, one read of the
        # round's join keys (keys only) says it.
        handler = self._handler
        world = round_world(records, handler.members()) if handler is not None else None
        if world is None and handler is not None:
            world = handler.participants()
        if world is None:  # etcd did not answer: every live machine but those leaving
            world = {r.rdzv_node for r in records if r.rdzv_node and r.state != "leaving"}
        peers = world_replica_peers(world, records, self.config.node_id)
        agent.set_replica_peers(peers)
        self.events("replica_peers", peers=peers)

    def _use_prewarmer(self) -> None:
        os.environ.pop(PREWARM_SOCKET_ENV, None)
        if self._prewarmer is None:
            return
        self._prewarmer.start()  # again, if it died
        # Waiting is no loss: a cold worker would spend the same time importing.
        if self._prewarmer.wait_ready(_PREWARM_READY_TIMEOUT_S):
            os.environ[PREWARM_SOCKET_ENV] = self._prewarmer.socket_path
        else:
            logger.warning(
                "the pre-warm process is not ready; workers start cold (see %s)",
                self._prewarmer.log_path,
            )

    def _health_check(self, worker_group: WorkerGroup) -> None:
        assert self._client is not None and worker_group.store is not None
        rank = worker_group.group_rank
        assert rank is not None and worker_group.group_world_size is not None
        try:
            verdict = health.run_health_check(
                worker_group.store, rank, worker_group.group_world_size, _HEALTH_TIMEOUT
            )
        except RuntimeError as exc:
            # The all-gather failed: a machine hung or died during the probe. Blame nobody.
            raise _RetryRendezvous(f"the health check's all-gather failed: {exc}") from exc
        self.events("health_check", unhealthy=verdict.unhealthy, compute_s=verdict.compute_s)
        if not verdict.unhealthy:
            return
        if rank in verdict.unhealthy:
            reason = verdict.unhealthy[rank]
            health.mark_unhealthy(self._client, self._job_prefix, self.config.node_id, reason)
            raise _Unhealthy(
                f"this machine ({self.config.node_id}) failed the health check: {reason}; it "
                "is recorded in etcd and will not be admitted to this job again"
            )
        raise _RetryRendezvous(f"machines of group ranks {sorted(verdict.unhealthy)} failed")

    # ---------------------------------------------------------------------------- job view

    def _start_job_view(self, client: Any) -> None:
        """Publishes this machine's monitoring summary to etcd
        (:mod:`flashckpt.elastic.membership.jobview`)."""
        registry, cfg = self._registry, self.config
        assert registry is not None

        def agent_socket() -> str | None:
            agent = self._node_agent
            gen = agent.current if agent is not None else None
            return gen.socket_path if gen is not None else None

        def role() -> tuple[str, int | None]:
            record = registry.record
            if record.state == "waiting":
                return ("rejoining" if self._last_view is not None else "standby"), None
            return record.state, record.group_rank

        self._jobview = JobViewPublisher(
            client=client,
            job_prefix=self._job_prefix,
            node_id=cfg.node_id,
            host=registry.record.host,
            publish=registry.publish,
            agent_status=lambda: agent_status(agent_socket()),
            role=role,
            restarts=lambda: max(0, self._rounds - 1),
            swap=StragglerSwap(factor=cfg.straggler_factor) if cfg.swap_stragglers else None,
            on_retire=self._retire,
        )
        self._jobview.start()

    def _retire(self, reason: str) -> None:
        """Leaves the job so a standby takes this machine's place (a persistent straggler).

        The main thread gets SIGTERM: torch's agent stops the workers, :meth:`run` returns 0
        and the teardown lets the node agent persist what it holds and revokes the node lease;
        the other machines' next round admits the standby.
        """
        self._retire_reason = reason
        self.events("retiring", reason=reason)
        os.kill(os.getpid(), signal.SIGTERM)

    # ---------------------------------------------------------------------------- teardown

    def _teardown(self) -> None:
        """Releases everything, within the shutdown deadline after a signal.

        Every etcd call is capped at 2 s, and when etcd does not answer a first probe none is
        made (the node key, the summary and this node's rendezvous heartbeat then go with their
        leases and timeouts); after a signal the node agent gets what is left of
        ``--shutdown-timeout`` since the signal to persist what it holds (it is killed after
        that, and its segments removed either way).
        """
        self._in_teardown = True
        signalled = self._signalled_at is not None
        if self._node_agent is not None and signalled:
            self._node_agent.refuse_restarts()
        etcd_up = self._client is not None and self.etcd_reachable()
        if self._client is not None and not etcd_up:
            logger.warning(
                "etcd does not answer: this node's key and rendezvous place go with their "
                "lease and heartbeat timeouts"
            )
        if self._handler is not None:
            self._leave_rendezvous(close=self._shutdown_rdzv and not signalled, etcd_up=etcd_up)
        if self._jobview is not None:
            self._jobview.close(timeout=_TEARDOWN_ETCD_TIMEOUT.total_seconds() if etcd_up else 0.5)
            self._jobview = None
        if self._registry is not None:
            if etcd_up:
                with contextlib.suppress(Exception):
                    self._registry.update(
                        state="leaving", done=self._workers_done, timeout=_TEARDOWN_ETCD_TIMEOUT
                    )
            self._registry.close(timeout=_TEARDOWN_ETCD_TIMEOUT, revoke=etcd_up)
            self._registry = None
        if self._prewarmer is not None:
            self._prewarmer.stop()
            self._prewarmer = None
        if self._node_agent is not None:
            if self._signalled_at is not None:
                left = self.config.shutdown_timeout - (time.monotonic() - self._signalled_at)
                self._node_agent.stop(timeout_s=max(1.0, left))
            else:
                self._node_agent.stop()
            self._agent_exit = self._node_agent.exit_code
            self._node_agent = None
            self._print_summary()
        if self._errors_dir is not None:
            shutil.rmtree(self._errors_dir, ignore_errors=True)
        if self._standalone is not None:
            self._standalone.close()
            self._standalone = None
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, handler)
        self._old_handlers.clear()
        if self._launch_lock is not None:
            self._launch_lock.release()
            self._launch_lock = None
        self.events("launcher_exit")

    def _print_summary(self) -> None:
        """Prints the job's summary on this machine, once the node agent wrote its last events."""
        if self._starts == 0:
            return
        try:
            line = job_summary(self._reporter.path, restarts=self._starts - 1)
        except Exception:  # a report: never a reason to fail the exit
            logger.exception("summarizing the node agent's events failed")
            return
        if line is not None:
            say(f"[flashckpt run {self.config.node_id}] {line}")

    def _leave_rendezvous(self, *, close: bool, etcd_up: bool) -> None:
        """Closes the rendezvous (the job finished) or gives up this node's place in it.

        After a signal the rendezvous stays open (closing it would end the job for every
        machine, and a standby must be able to take this one's place); this machine's lease is
        revoked instead, so its join keys go at once and the others do not wait for it.
        """
        handler = self._handler
        assert handler is not None
        with handler.call_timeout(_TEARDOWN_ETCD_TIMEOUT):
            if close and etcd_up:
                # Logs and returns False when etcd fails; leaves either way. A machine whose
                # workers finished says so in the same write (a standby's exit code).
                handler.shutdown(done=self._workers_done)
                return
            if etcd_up:
                handler.leave()
            else:
                handler.suspend()  # its keys lapse with its lease

    def etcd_reachable(self) -> bool:
        """Whether etcd answers within 2 s."""
        client = self._client
        if client is None:
            return False
        try:
            client.revision(timeout=_PROBE_ETCD_TIMEOUT)
        except EtcdError:
            return False
        return True


class _RetryRendezvous(Exception):
    """The round must be formed again (a machine failed the health check)."""


class _WorkerSupervisor(LocalElasticAgent):
    """torch's ``LocalElasticAgent`` with the launch session's hooks around each round: the
    supervisor of this machine's worker group. (In flashckpt, "agent" alone is the node agent
    daemon; torch's class is called a supervisor here.)"""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        logs_specs: DefaultLogsSpecs,
        session: LaunchSession,
        shutdown_timeout: float,
        start_method: str = "spawn",
    ):
        super().__init__(
            spec,
            logs_specs=logs_specs,
            start_method=start_method,
            shutdown_timeout=max(0, round(shutdown_timeout)),
        )
        self._session = session

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        for attempt in range(_MAX_HEALTH_ROUNDS):
            self._session.before_rendezvous()
            super()._rendezvous(worker_group)
            try:
                self._session.after_rendezvous(worker_group)
                return
            except _RetryRendezvous as exc:
                logger.warning("forming the round again (%s), attempt %d", exc, attempt + 1)
        raise RendezvousError(
            f"the health check failed {_MAX_HEALTH_ROUNDS} rounds in a row; see the logs of "
            "every machine"
        )

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._session.before_start_workers(worker_group)
        try:
            pids = super()._start_workers(worker_group)
        finally:
            # torch's process context installed its own handlers; ours also set the flags.
            self._session.install_signal_handlers()
        self._session.workers_started(pids)
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._session.fenced:
            # The fence stopped the workers: no failure of theirs (torch's restart count stays),
            # a membership change. Once registered again, a new round (this machine a standby).
            self._session.wait_for_heal()
            self._restart_workers(worker_group)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and self._session.unrestartable_failure():
            # A worker failed with an error no restart can mend (workererrors): the launcher
            # fails now, with its text (run), instead of spending --max-restarts on it.
            self._remaining_restarts = 0
            self._session.workers_started({})
            return result
        if result.state != WorkerState.SUCCEEDED:
            failed = result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            lost = self._session.round_lost(failed=failed)
            if lost is not None:
                # A machine of the workers' round died: their world is gone, and their next
                # collective fails or waits for it (gloo sometimes waits until its timeout,
                # and with no standby waiting torch would never restart healthy workers). A
                # membership change, as when torch restarts healthy workers for a joining
                # machine: it does not use up --max-restarts either (else a long job would
                # give up after that many machine losses, however many standbys it has).
                logger.warning(
                    "%s after machine %s of their round died; restarting them for the next "
                    "round (not counted against --max-restarts: %d left)",
                    "workers failed" if failed else "workers still running",
                    lost,
                    self._remaining_restarts,
                )
                self._session.workers_started({})
                worker_group.state = result.state
                self._restart_workers(worker_group)
                return super()._monitor_workers(worker_group)
        if result.state != WorkerState.HEALTHY:
            self._session.workers_started({})  # gone, or about to be stopped by torch
        return result

    def _exit_barrier(self) -> None:
        # The barrier keeps an agent alive while the others finish because torch's agents may
        # host the store; ours is in etcd. With etcd gone it could only fail after its
        # timeouts, so it is skipped.
        if not self._session.etcd_reachable():
            logger.warning("etcd is unreachable: not waiting for the other machines to finish")
            return
        super()._exit_barrier()

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._session.events(
            "workers_restart",
            state=worker_group.state.name,
            remaining_restarts=self._remaining_restarts,
        )
        super()._restart_workers(worker_group)


def stop_processes(pids: list[int], kill_at: float) -> list[int]:
    """Sends SIGTERM to ``pids`` now and SIGKILL at ``kill_at`` (monotonic) to those still
    running (zombies count as gone); returns the pids that needed SIGKILL. Only children of
    this process are signalled: a pid of a worker that exited may have been reused since."""
    pids = [p for p in pids if _parent(p) == os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    while any(_alive(p) for p in pids) and time.monotonic() < kill_at:
        time.sleep(0.02)
    killed = [p for p in pids if _alive(p)]
    for pid in killed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return killed


def _stat(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, ...); [] when
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return []
    # "pid (comm) S ppid ...": the fields follow the last ')' (comm may hold spaces and parens).
    return stat[stat.rfind(b")") + 1 :].split()


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (exited, not reaped by torch yet)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] not in (b"Z", b"X")


def _describe_failures(result: RunResult) -> str:
    parts = []
    for rank, failure in sorted(result.failures.items()):
        parts.append(
            f"rank {rank}: exit code {failure.exitcode} ({failure.message or 'no message'})"
        )
    return "; ".join(parts) or result.state.name


def _leave_hung_up_terminal() -> None:
    """Points this process's stdout and stderr at ``/dev/null`` where they are a terminal that
    hung up (closed window, lost ssh: the SIGHUP's usual cause). Every write to such a terminal
    fails with EIO: the teardown's first line ("stopping on SIGHUP") raised in the middle of it,
    etcd was left to its parent-death signal, its data behind, and the exit code was 1. The
    workers, the node agent and etcd keep their own descriptors (their logs are files)."""
    for fd in (1, 2):
        try:
            termios.tcgetattr(fd)
        except termios.error as exc:  # ENOTTY: a file or pipe, written as before
            if exc.args and exc.args[0] == errno.EIO:
                with contextlib.suppress(OSError):
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, fd)
                    os.close(devnull)
        except OSError:  # a closed descriptor
            continue


def _default_run_dir() -> str:
    from flashckpt.protocol.channel import default_run_dir

    return default_run_dir()


def _ensure_dir(path: str) -> str:
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path
