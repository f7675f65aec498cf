"""The node agent's step monitor (:class:`AgentMonitor`, a thread of the node agent): reads the
trainers' step rings, keeps per-rank figures, writes events, raises alerts, serves metrics.

The trainers write the rings (:mod:`flashckpt.monitor.ring`, the only monitoring module a trainer
imports). The monitor reads every ring a few times a second (records overwritten before they were
read are counted as lost, never misread, :mod:`flashckpt.monitor.rankview`), and

- keeps per-rank windows for p50/p99 step times and the other parts;
- appends JSON lines to ``<events_dir>/<job>.<node>.events.jsonl`` (``start``, ``steps`` batches,
  ``end``, ``hang``, ``hang_kill``, ``hang_kill_refused``, ``straggler``, ``goodput``; see
  :mod:`flashckpt.monitor.goodput`);
- serves Prometheus metrics on ``metrics_port`` (:mod:`flashckpt.monitor.metrics`);
- flags hangs (stack dumps, then the kill under an elastic launcher) and stragglers
  (:mod:`flashckpt.monitor.alerts`);
- at shutdown, writes the goodput report of the job (text, optionally a PNG chart).

The agent sees its own machine's ranks. Under ``flashckpt run`` the launcher publishes a summary
of its agent's ``status()`` (this monitor's :meth:`AgentMonitor.summary` included) to etcd, for
``flashckpt status --etcd`` across machines and the straggler -> standby swap: see
:mod:`flashckpt.elastic.membership.jobview`. ``flashckpt status`` on one machine:
:mod:`flashckpt.monitor.statusview`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from flashckpt.monitor.alerts import Alerts
from flashckpt.monitor.goodput import (
    STEPS_EVENT_VERSION,
    Incarnation,
    compute_goodput,
    format_report,
    incarnations_from_events,
    plot_report,
    read_events,
    steps_span,
)
from flashckpt.monitor.metrics import MetricsServer, metric_families, serve_metrics
from flashckpt.monitor.rankview import Batch, RankState, RingReader, quantile
from flashckpt.monitor.ring import (
    ENTERING,
    EXITED,
    FLAG_ELASTIC,
    PART_INDEX,
    PARTS,
    PHASES,
    REC_SNAPSHOT,
    RUNNING,
)
from flashckpt.names import events_path, goodput_report_path

__all__ = [
    "AgentMonitor",
    "MonitorConfig",
]

log = logging.getLogger("flashckpt.monitor.step_monitor")

IDLE_POLL_S = 1.0
"""Seconds between looks for rings while this machine has none (no trainer yet, or between
jobs): an idle agent's monitor wakes once a second, not ``poll_s`` (4 times a second)."""


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    """Settings of the node agent's step monitor."""

    enabled: bool = True
    """Read the trainers' rings at all."""
    poll_s: float = 0.25
    """Seconds between reads of the rings."""
    metrics_port: int | None = None
    """Prometheus endpoint port; None: no endpoint; 0: a free port chosen by the OS (reported in
    ``status()`` and the log)."""
    metrics_addr: str = "127.0.0.1"
    """Address the Prometheus endpoint binds: this machine only by default (the metrics name
    the job, its hosts and its progress); ``0.0.0.0`` serves every interface."""
    events_dir: str | None = None
    """Directory of ``<job>.<node>.events.jsonl`` and the goodput report. Default: the agent's
    run_dir. A launcher whose run_dir is per agent generation should pass a stable one."""
    events_interval_s: float = 10.0
    """Seconds between ``steps`` lines per rank in the events file."""
    window: int = 200
    """Recent iterations kept per rank for the p50/p99 figures."""
    hang_factor: float = 10.0
    """A rank is hung after ``max(hang_factor x p50 step time, hang_floor_s)`` without a step."""
    hang_floor_s: float = 300.0
    """The least time without a step that counts as a hang (also the limit before a first step)."""
    hang_kill: Literal["auto", "on", "off"] = "auto"
    """After dumping the stacks, SIGKILL the hung workers so their launcher restarts them (they
    resume from memory). auto: only workers started by an elastic launcher (torchrun, flashckpt
    run)."""
    hang_dump_wait_s: float = 2.0
    """Seconds between the stack dump (SIGUSR1) and the kill."""
    straggler_factor: float = 1.5
    """A rank is a straggler when its median exceeds this many times the other ranks' median."""
    straggler_window: int = 50
    """Iterations per rank the straggler medians are taken over."""
    straggler_min_steps: int = 20
    """Iterations a rank needs in its window before it is judged."""
    straggler_min_ms: float = 1.0
    """Differences below this many milliseconds never make a straggler (timer noise)."""
    straggler_metric: Literal["compute", "step", "forward_backward", "data", "optimizer"] = (
        "compute"
    )
    """What is compared. compute: forward + optimizer time, which collectives do not equalise
    under data parallelism (iteration times do: every rank waits for the slowest); falls back to
    step when the loop's model or optimizer calls are not seen."""
    report_png: bool = False
    """Also draw the goodput chart at shutdown (needs matplotlib; off by default because the
    import costs about a second of CPU on the restart path)."""

    def __post_init__(self) -> None:
        if self.poll_s <= 0:
            raise ValueError(f"poll_s={self.poll_s}: must be > 0 seconds")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port={self.metrics_port}: use 1-65535, 0 (any) or None")
        if self.hang_factor <= 0 or self.hang_floor_s <= 0:
            raise ValueError(
                f"hang_factor={self.hang_factor}, hang_floor_s={self.hang_floor_s}: "
                "both must be > 0"
            )
        if self.hang_kill not in ("auto", "on", "off"):
            raise ValueError(f"hang_kill={self.hang_kill!r}: use 'auto', 'on' or 'off'")
        if self.straggler_factor <= 1:
            raise ValueError(f"straggler_factor={self.straggler_factor}: must be > 1")
        if self.straggler_metric not in (
            "compute",
            "step",
            "forward_backward",
            "data",
            "optimizer",
        ):
            raise ValueError(
                f"straggler_metric={self.straggler_metric!r}: use compute, step, "
                "forward_backward, data or optimizer"
            )
        if not 1 <= self.straggler_min_steps <= self.straggler_window:
            raise ValueError(
                f"straggler_min_steps={self.straggler_min_steps}: use 1 to straggler_window="
                f"{self.straggler_window}"
            )
        if self.window < self.straggler_window:
            raise ValueError(
                f"window={self.window} < straggler_window={self.straggler_window}: the window "
                "must hold the straggler window"
            )


class AgentMonitor:
    """The node agent's monitor thread: reads the rings, detects hangs and stragglers, writes
    events, serves metrics. See the module docstring.

    Args:
        job: the job id.
        node: the node id.
        shm_dir: where the trainers' rings are.
        run_dir: the agent's run directory (default place of the events file).
        config: the settings.
        facts: returns the agent's ``status()`` (snapshots and committed steps for the metrics).
    """

    def __init__(
        self,
        *,
        job: str,
        node: str,
        shm_dir: str,
        run_dir: str,
        config: MonitorConfig,
        facts: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.cfg = config
        self.job, self.node = job, node
        self.shm_dir = shm_dir
        self.events_dir = config.events_dir or run_dir
        self.events_path = events_path(self.events_dir, job, node)
        self.report_path = goodput_report_path(self.events_dir, job, node)
        self.metrics_port: int | None = None
        self._facts = facts
        # A rank's ring, or one its next process retired (the previous process's: ``.<token>``).
        self._ring_re = re.compile(
            rf"^fc\.{re.escape(job)}\.{re.escape(node)}\.r(\d{{5}})\.mon(?:\.([0-9a-f]{{16}}))?$"
        )
        self._ranks: dict[int, RankState] = {}
        self._history: dict[str, Incarnation] = {}
        self._bad_inos: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: MetricsServer | None = None
        self._events: Any = None
        self._first_scan = True
        self._seen_ring = False
        self._next_flush = 0.0
        self._alerts = Alerts(config, self._emit)
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Loads earlier events of this job and node, starts the metrics endpoint and thread.

        Raises:
            RuntimeError: ``metrics_port`` is set but prometheus_client is missing or the port
                cannot be bound (the message names the fix).
        """
        os.makedirs(self.events_dir, mode=0o700, exist_ok=True)
        self._load_history()
        self._events = open(self.events_path, "a", buffering=1)  # noqa: SIM115 (lives with us)
        if self.cfg.metrics_port is not None:
            self._start_metrics(self.cfg.metrics_port)
        self._emit({"event": "agent_start", "pid": os.getpid(), "metrics_port": self.metrics_port})
        self._thread = threading.Thread(target=self._loop, name="flashckpt-agent-monitor")
        self._thread.daemon = True
        self._thread.start()
        log.info(
            "monitor: events %s%s",
            self.events_path,
            f", metrics on :{self.metrics_port}" if self.metrics_port is not None else "",
        )

    def close(self) -> None:
        """Final read of every ring, flush of the events, goodput report; stops the endpoint."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.poll()
            with self._lock:
                for rs in self._ranks.values():
                    self._flush_batch(rs)
            self._emit({"event": "agent_stop"})
            self._final_report()
        except Exception:
            log.exception("monitor: final report failed")
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        with self._lock:
            for rs in self._ranks.values():
                if rs.ring is not None:
                    rs.ring.close()
                    rs.ring = None
            if self._events is not None:
                self._events.close()
                self._events = None

    def _load_history(self) -> None:
        """Earlier incarnations from the events file (an agent restart, a former generation):
        restarts, the steps already done (for recomputed steps) and goodput span them."""
        if not os.path.exists(self.events_path):
            return
        try:
            events = read_events([self.events_path])
        except OSError as e:
            log.warning("monitor: cannot read earlier events %s: %s", self.events_path, e)
            return
        for rank, incs in incarnations_from_events(events).items():
            rs = self._ranks.setdefault(rank, RankState(rank))
            for inc in incs:
                if inc.token not in self._history:  # idempotent: loaded again at first ring
                    rs.incarnations += 1
                    self._history[inc.token] = inc
        for ev in events:
            if ev.get("event") != "steps":
                continue
            try:
                _, done = steps_span(ev)
            except ValueError as e:
                log.warning("monitor: %s: %s; its steps are not counted", self.events_path, e)
                continue
            if done is not None:
                rs = self._ranks.setdefault(int(ev["rank"]), RankState(int(ev["rank"])))
                # high_water is a ring index (0-based), as the records it is compared with.
                rs.high_water = max(rs.high_water, done - 1)

    def next_wait(self) -> float:
        """Seconds until the next poll: ``poll_s`` while there are rings to read, else at most
        :data:`IDLE_POLL_S` (a new trainer's ring is found that much later; its first steps
        wait in the ring meanwhile)."""
        with self._lock:
            idle = not self._ranks
        return max(self.cfg.poll_s, IDLE_POLL_S) if idle else self.cfg.poll_s

    def _loop(self) -> None:
        while not self._stop.wait(self.next_wait()):
            try:
                self.poll()
            except Exception:  # the monitor lives on; one bad poll must not end it
                log.exception("monitor: poll failed")

    # -- polling -------------------------------------------------------------------------------
    def poll(self) -> None:
        """One round: discover rings, read records, detect ends, hangs and stragglers."""
        with self._lock:
            now_m, now_w = time.monotonic(), time.time()
            off = now_w - now_m
            self._discover(now_w, off)
            for rs in self._ranks.values():
                self._read(rs, off)
                self._check_end(rs, now_w, off)
            ranks = self._ranks.values()
            self._alerts.check_hangs(ranks, now_m, now_w)
            self._alerts.check_stragglers(ranks, now_w)
            self._alerts.act(ranks, now_m, now_w)
            if now_m >= self._next_flush:
                for rs in self._ranks.values():
                    self._flush_batch(rs)
                self._next_flush = now_m + self.cfg.events_interval_s
            self._first_scan = False

    def _discover(self, now_w: float, off: float) -> None:
        try:
            names = os.listdir(self.shm_dir)
        except OSError:
            return
        current: dict[int, str] = {}
        retired: dict[int, list[str]] = {}
        for name in names:
            m = self._ring_re.match(name)
            if m:
                path = os.path.join(self.shm_dir, name)
                if m.group(2):
                    retired.setdefault(int(m.group(1)), []).append(path)
                else:
                    current[int(m.group(1))] = path
        for rank in sorted(current.keys() | retired.keys()):
            # The rings the rank's earlier processes left first, oldest first: their
            # iterations come before the current ring's (recomputed steps, incarnations).
            for ring, path in self._open_retired(rank, retired.get(rank, [])):
                self._collect_retired(rank, ring, path, now_w, off)
            if rank not in current:
                continue
            path = current[rank]
            try:
                ino = os.stat(path).st_ino
            except FileNotFoundError:
                continue
            rs = self._ranks.get(rank)
            if (rs is not None and rs.ring is not None and rs.ring.ino == ino) or (
                ino in self._bad_inos
            ):
                continue
            new = self._open(path, ino)
            if new is not None:
                self._attach(rank, new, now_w, off)

    def _open(self, path: str, ino: int) -> RingReader | None:
        try:
            ring = RingReader(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("monitor: ignoring %s: %s", path, e)
            self._bad_inos.add(ino)
            return None
        if not self._seen_ring:
            # A spare agent (elastic launcher) loaded the shared events file long before
            # it took over: read what the previous generation wrote since (restarts, steps
            # already done, for recomputed steps).
            self._seen_ring = True
            self._load_history()
        return ring

    def _open_retired(self, rank: int, paths: list[str]) -> list[tuple[RingReader | None, str]]:
        """The retired rings of ``rank`` to collect, oldest process first; ``None`` for the one
        this monitor reads already (same file)."""
        rs = self._ranks.get(rank)
        found: list[tuple[float, RingReader | None, str]] = []
        for path in paths:
            try:
                ino = os.stat(path).st_ino
            except FileNotFoundError:
                continue
            if ino in self._bad_inos:
                continue
            if rs is not None and rs.ring is not None and rs.ring.ino == ino:
                found.append((rs.info.get("proc_start", 0.0), None, path))
                continue
            ring = self._open(path, ino)
            if ring is not None:
                found.append((ring.info()["proc_start"], ring, path))
        found.sort(key=lambda x: x[0])
        return [(ring, path) for _, ring, path in found]

    def _collect_retired(
        self, rank: int, ring: RingReader | None, path: str, now_w: float, off: float
    ) -> None:
        """Reads a ring the rank's next process retired (:func:`flashckpt.names.
        retired_ring_path`) to its end, reports its end, then removes the file: every iteration its
        process ran is counted once, whether or not this monitor watched it live."""
        rs = self._ranks[rank] if ring is None else self._ranks.get(rank)
        if ring is not None:
            known = self._history.get(ring.token)
            if known is not None and known.end_reason is not None:
                ring.close()  # an earlier agent reported it to its end (and died before this)
                self._remove_retired(path)
                return
            self._attach(rank, ring, now_w, off, retired=True)
            rs = self._ranks[rank]
        assert rs is not None
        self._finish(rs, now_w, off)
        self._remove_retired(path)

    def _remove_retired(self, path: str) -> None:
        # Only the files of this agent's user: another user's file under the job's names is
        # not this agent's to delete (the writer's RETIRED_KEEP bounds its own).
        try:
            st = os.lstat(path)
            if st.st_uid == os.geteuid():
                os.unlink(path)
            else:
                self._bad_inos.add(st.st_ino)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("monitor: cannot remove %s: %s", path, e)
            with contextlib.suppress(OSError):
                self._bad_inos.add(os.lstat(path).st_ino)

    def _finish(self, rs: RankState, now_w: float, off: float) -> None:
        """The process of ``rs.ring`` is over (a new process of the rank replaced its ring):
        reads its last records and reports its end."""
        if rs.ring is None or rs.ended:
            return
        # Liveness before the last read: a writer seen gone has written its last record.
        alive = rs.ring.alive(rs.info.get("proc_start", 0.0))
        self._read(rs, off)
        if rs.ring.phase() == EXITED:  # it ended before this poll saw it
            old = rs.ring.info()
            reason = "exit" if old["exit_code"] == 0 else "error"
            self._end(rs, reason, old["exit"] or now_w)
        else:
            reason = "killed" if rs.killed else ("replaced" if alive else "died")
            self._end(rs, reason, now_w)

    def _attach(
        self, rank: int, ring: RingReader, now_w: float, off: float, *, retired: bool = False
    ) -> None:
        rs = self._ranks.setdefault(rank, RankState(rank))
        if rs.ring is not None:
            # A new process of this rank replaced the ring: the old one is over.
            self._finish(rs, now_w, off)
            rs.ring.close()
        info = ring.info()
        rs.ring, rs.info = ring, info
        rs.started = rs.killed = False
        rs.ended = False
        rs.hang = rs.straggler = None
        rs.kill_at = None
        rs.window = deque(maxlen=self.cfg.window)
        rs.last_step = None
        rs.end_reason = None
        rs.last_progress_mono = info["ready_mono"] or time.monotonic()
        if (self._first_scan or retired) and not ring.alive(info["proc_start"]):
            # Over before this agent's first look: how it ended is in the ring (EXITED: its exit
            # code; else it died), whoever reports it.
            exited = ring.phase() == EXITED
            reason = ("exit" if info["exit_code"] == 0 else "error") if exited else "died"
            known = self._history.get(ring.token)
            if known is not None and known.end_reason is not None:
                # A previous agent reported its end.
                rs.ended, rs.end_reason = True, known.end_reason
                return
            if known is not None:
                # It ended while no agent watched (its agent was gone first): report it now,
                # with every iteration it ran since the previous agent's last "steps" line
                # (that agent's unwritten batch died with it: issue 41).
                rs.started, rs.inc = True, known
                ring.read_idx = min(ring.count(), known.records_read)
                self._read(rs, off)  # into its batch and incarnation, as if watched
                if rs.last_step is None and ring.count():
                    ring.read_idx = ring.count() - 1  # every record written already: the last
                    recs, _ = ring.read_new()
                    if recs:
                        rs.last_step = recs[-1][0]
                self._end(rs, reason, (info["exit"] or now_w) if exited else now_w)
                return
            # Unknown to the events: no agent reported it (it entered after this agent started
            # and ended before its first poll, or while no agent of the job ran, or the agent
            # that watched it died before its start line). This agent's to report, read like any
            # new ring: its start, steps and end follow in this poll (issue 41). Its liveness
            # must not decide that: a ring's lock is gone once its trainer ends, however it
            # ended.
        if ring.token in self._history:
            # Known from the events file: a trainer that outlived the previous agent. Read on
            # from the record after the last one the events account for: the previous agent's
            # batch not yet written when it died is read again, not lost (issue 41).
            rs.inc = self._history[ring.token]
            ring.read_idx = min(ring.count(), rs.inc.records_read)
            rs.started = True
            return
        # A trainer no events line knows (it entered while no agent of this job ran, or the
        # previous agent died before its start line) is read from its first record: every
        # iteration it ran is counted once (issue 41).
        rs.incarnations += 1

    def _read(self, rs: RankState, off: float) -> None:
        ring = rs.ring
        if ring is None or rs.ended:
            return
        rs.phase = ring.phase()
        if rs.phase != RUNNING:
            # Entering, paused in a flush, finishing: not progress, but not a hang either; the
            # idle clock starts again when it runs.
            rs.last_progress_mono = time.monotonic()
        if not rs.started:
            if rs.phase == ENTERING:
                return  # records come after ready(), which also fills the info
            self._start(rs)
        recs, lost = ring.read_new()
        if lost:
            rs.batch.lost += lost
            rs.lost_total += lost
        if not recs:
            return
        b = rs.batch
        acc = (b.n, b.step_s, b.ckpt_s, b.recomputed_s, b.recomputed_n)
        for rec in recs:
            step, step_ms = rec[0], rec[2]
            s = step_ms / 1e3
            if b.first is None:
                b.first = step
            b.last = step
            b.n += 1
            b.step_s += s
            b.step_ms.append(step_ms)
            if rec[8] & REC_SNAPSHOT:
                b.snapshots += 1
            if step <= rs.high_water:
                b.recomputed_s += s
                b.recomputed_n += 1
            else:
                b.ckpt_s += rec[7] / 1e3
                rs.high_water = step
            rs.ckpt_total_s += rec[7] / 1e3
            rs.window.append(rec)
        last = recs[-1]
        b.t1 = last[1] + off
        rs.steps_total += len(recs)
        rs.last_step = last[0]
        rs.last_progress_mono = last[1]
        inc = rs.inc
        if inc is not None:
            n0, s0, c0, r0, rn0 = acc
            inc.n += b.n - n0
            inc.step_s += b.step_s - s0
            inc.ckpt_s += b.ckpt_s - c0
            inc.recomputed_s += b.recomputed_s - r0
            inc.recomputed_n += b.recomputed_n - rn0
            inc.last_progress = b.t1
        if rs.hang is not None:
            self._emit({"event": "hang_cleared", "rank": rs.rank, "step": rs.steps_done})
            log.warning(
                "monitor: rank %d makes progress again (%s steps done)", rs.rank, rs.steps_done
            )
            rs.hang, rs.kill_at = None, None

    def _start(self, rs: RankState) -> None:
        ring = rs.ring
        assert ring is not None
        info = ring.info()
        rs.info = info
        rs.started = True
        if info["ready_mono"]:
            rs.last_progress_mono = info["ready_mono"]
        rs.inc = Incarnation(
            rank=rs.rank,
            token=ring.token,
            proc_start=info["proc_start"],
            enter=info["enter"],
            ready=info["ready"],
            node=self.node,
            resume_step=info["resume_step"] if info["resume_step"] >= 0 else None,
        )
        self._history[ring.token] = rs.inc
        self._emit(
            {
                "event": "start",
                "rank": rs.rank,
                "token": ring.token,
                "pid": ring.pid,
                "world_size": ring.world,
                "proc_start": info["proc_start"],
                "enter": info["enter"],
                "ready": info["ready"],
                "restore_s": (info["ready"] - info["enter"]) if info["ready"] else None,
                "resume_step": info["resume_step"],
                "restored_from": info["restored_from"],
                "elastic": bool(ring.flags & FLAG_ELASTIC),
                # Its pid is its own PID namespace's: never signalled (hangs are reported).
                "other_pid_ns": ring.other_pid_ns,
                "stacks": ring.stacks_path,
            }
        )

    def _check_end(self, rs: RankState, now_w: float, off: float) -> None:
        ring = rs.ring
        if ring is None or rs.ended:
            return
        # Liveness first, then the phase: a writer releases its lock after writing EXITED, so
        # one seen gone is read as exited if it did (not as a death).
        alive = ring.alive(rs.info.get("proc_start", 0.0))
        if ring.phase() == EXITED:
            self._read(rs, off)
            info = ring.info()
            reason = "exit" if info["exit_code"] == 0 else "error"
            self._end(rs, reason, info["exit"] or now_w)
        elif not alive:
            self._read(rs, off)
            self._end(rs, "killed" if rs.killed else "died", now_w)

    def _end(self, rs: RankState, reason: str, t: float) -> None:
        ring = rs.ring
        assert ring is not None
        if not rs.started:
            self._start(rs)  # died before its first step: its start still counts
        self._flush_batch(rs)
        rs.ended = True
        rs.end_reason = reason
        if rs.inc is not None:
            rs.inc.end_reason = reason
            rs.inc.end_t = t
        self._emit(
            {
                "event": "end",
                "rank": rs.rank,
                "token": ring.token,
                "pid": ring.pid,
                "reason": reason,
                "t": t,
                "last_step": rs.steps_done,
            }
        )
        if reason not in ("exit", "replaced"):
            log.warning(
                "monitor: rank %d (pid %d) %s after %s steps done",
                rs.rank,
                ring.pid,
                reason,
                rs.steps_done,
            )
        if rs.straggler is not None:
            rs.straggler = None
        rs.hang, rs.kill_at = None, None

    def _flush_batch(self, rs: RankState) -> None:
        b = rs.batch
        if b.n == 0 and b.lost == 0:
            return
        ring = rs.ring
        ms = sorted(b.step_ms)
        self._emit(
            {
                "event": "steps",
                "v": STEPS_EVENT_VERSION,
                "rank": rs.rank,
                "token": ring.token if ring is not None else None,
                # Steps completed after the batch's first and last iteration (the ring counts
                # 0-based iterations): the numbers status, the metrics and the logs print.
                "first": None if b.first is None else b.first + 1,
                "last": None if b.last is None else b.last + 1,
                "n": b.n,
                "t1": b.t1 if b.n else None,
                "step_s": b.step_s,
                "ckpt_s": b.ckpt_s,
                "recomputed_s": b.recomputed_s,
                "recomputed_n": b.recomputed_n,
                "snapshots": b.snapshots,
                "lost": b.lost,
                "p50_ms": quantile(ms, 0.5),
                "p99_ms": quantile(ms, 0.99),
            }
        )
        rs.batch = Batch()

    # -- events, summary, reports --------------------------------------------------------------
    def _emit(self, ev: dict[str, Any]) -> None:
        if self._events is None:
            return
        line = json.dumps(
            {"t": time.time(), "job": self.job, "node": self.node, **ev},
            separators=(",", ":"),
            allow_nan=False,
            default=str,
        )
        try:
            self._events.write(line + "\n")
        except (OSError, ValueError) as e:
            log.warning("monitor: cannot append to %s: %s", self.events_path, e)

    def goodput(self) -> dict[str, Any]:
        """Live goodput of the incarnations this agent knows (its own and earlier ones)."""
        by_rank: dict[int, list[Incarnation]] = {}
        for inc in self._history.values():
            by_rank.setdefault(inc.rank, []).append(inc)
        for incs in by_rank.values():
            incs.sort(key=lambda i: i.proc_start)
        return compute_goodput(by_rank).to_json()

    def summary(self) -> dict[str, Any]:
        """What ``status()`` shows: per-rank figures, active alerts, endpoint, events file.

        This is also the per-machine summary to publish cluster-wide (the etcd hook).
        """
        with self._lock:
            now_m = time.monotonic()
            ranks: dict[str, Any] = {}
            alerts: list[dict[str, Any]] = []
            for r, rs in sorted(self._ranks.items()):
                if rs.ring is None:
                    continue
                step_ms = sorted(x[2] for x in rs.window)
                parts = {
                    p: quantile(sorted(x[PART_INDEX[p]] for x in rs.window), 0.5)
                    for p in PARTS
                    if p != "step"
                }
                if rs.ended:
                    state = rs.end_reason or "ended"
                elif rs.hang is not None:
                    state = "hung"
                else:
                    state = PHASES[rs.phase] if 0 <= rs.phase < len(PHASES) else "?"
                ranks[str(r)] = {
                    "pid": rs.ring.pid,
                    "state": state,
                    "step": rs.last_step,
                    "steps": rs.steps_total,
                    "p50_ms": quantile(step_ms, 0.5),
                    "p99_ms": quantile(step_ms, 0.99),
                    "p50_parts_ms": parts,
                    "ckpt_total_s": rs.ckpt_total_s,
                    "idle_s": None if rs.ended else now_m - rs.last_progress_mono,
                    "hang_threshold_s": self._alerts.hang_threshold(rs),
                    "restarts": max(0, rs.incarnations - 1),
                    "resume_step": rs.info.get("resume_step"),
                    "restored_from": rs.info.get("restored_from"),
                    "straggler": rs.straggler is not None,
                    "lost_records": rs.lost_total,
                }
                for a in (rs.hang, rs.straggler):
                    if a is not None:
                        alerts.append(dict(a))
            return {
                "metrics_port": self.metrics_port,
                "events_path": self.events_path,
                "ranks": ranks,
                "alerts": alerts,
                "recent_alerts": list(self._alerts.recent),
                "goodput": self.goodput(),
            }

    def _final_report(self) -> None:
        if not os.path.exists(self.events_path):
            return
        rep = compute_goodput(incarnations_from_events(read_events([self.events_path])))
        if not rep.ranks:
            return
        text = format_report(rep)
        log.info("monitor: %s", text)
        self._emit({"event": "goodput", **rep.to_json()})
        with open(self.report_path, "w") as f:
            f.write(text + "\n")
        if self.cfg.report_png:
            png = self.report_path[: -len(".txt")] + ".png"
            try:
                plot_report(rep, png)
            except ImportError as e:
                log.warning("monitor: no goodput chart: %s", e)

    # -- Prometheus ------------------------------------------------------------------------------
    def _start_metrics(self, port: int) -> None:
        self._server = serve_metrics(self.cfg.metrics_addr, port, self.metric_families)
        self.metrics_port = int(self._server.server_address[1])

    def metric_families(self) -> list[Any]:
        """The current metrics, as prometheus_client metric families."""
        status = self._facts() if self._facts is not None else {}
        mon = status.get("monitor") or self.summary()
        return metric_families(job=self.job, node=self.node, status=status, summary=mon)
