"""The node agent monitor's alerts: hangs (stack dumps, then the kill that lets a launcher
restart the workers) and stragglers, judged on the ranks of :mod:`flashckpt.monitor.rankview`.

- a hang: a running rank made no progress for ``max(hang_factor x p50, hang_floor_s)``: the
  Python stacks of every local rank are dumped (``SIGUSR1``) into the agent's log, then, when
  enabled (by default under an elastic launcher), the hung workers are killed with ``SIGKILL`` so
  the launcher restarts them and they resume from memory. A trainer in another PID namespace than
  the agent (a DaemonSet agent and its trainer pods) is never signalled: its pid is not one of
  the agent's; the hang is reported, and a due kill is a ``hang_kill_refused`` event and an error
  in the log naming why;
- a straggler: a rank whose median iteration part (``straggler_metric``) over the last
  ``straggler_window`` steps exceeds ``straggler_factor`` times the median of the other ranks.

Each alert is an event (``hang``, ``hang_kill``, ``hang_kill_refused``, ``stacks``, ``straggler``,
``straggler_cleared``) and stays on its rank (``RankState.hang``, ``.straggler``) while active.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
from collections import deque
from collections.abc import Callable, Collection
from typing import Any, Literal, Protocol

from flashckpt.monitor.rankview import RankState, quantile
from flashckpt.monitor.ring import FLAG_ELASTIC, FLAG_STACKS, PART_INDEX, RUNNING

__all__ = ["AlertRules", "Alerts"]

log = logging.getLogger("flashckpt.monitor.step_monitor")


class AlertRules(Protocol):
    """The settings the alerts read (:class:`flashckpt.monitor.step_monitor.MonitorConfig` has them;
    read at
    each check, as documented there)."""

    hang_factor: float
    hang_floor_s: float
    hang_kill: Literal["auto", "on", "off"]
    hang_dump_wait_s: float
    straggler_factor: float
    straggler_window: int
    straggler_min_steps: int
    straggler_min_ms: float
    straggler_metric: Literal["compute", "step", "forward_backward", "data", "optimizer"]


class Alerts:
    """Hang and straggler detection over the monitor's ranks; called under the monitor's lock.

    Args:
        rules: the thresholds.
        emit: appends one event to the events file.
    """

    def __init__(self, rules: AlertRules, emit: Callable[[dict[str, Any]], None]) -> None:
        self.rules = rules
        self._emit = emit
        self.recent: deque[dict[str, Any]] = deque(maxlen=20)
        """The last alerts raised (hangs and stragglers, also once cleared)."""
        self._stack_reads: list[tuple[float, int, int, str, int]] = []
        self._last_dump = -1e9

    # -- hangs ---------------------------------------------------------------------------------
    def hang_threshold(self, rs: RankState) -> float:
        """Seconds without a step after which the rank counts as hung."""
        p50 = quantile(sorted(r[2] for r in rs.window), 0.5)
        if p50 is None:
            return self.rules.hang_floor_s
        return max(self.rules.hang_factor * p50 / 1e3, self.rules.hang_floor_s)

    def check_hangs(self, ranks: Collection[RankState], now_m: float, now_w: float) -> None:
        """Flags the running ranks idle past their threshold; dumps the stacks, plans kills."""
        newly: list[RankState] = []
        for rs in ranks:
            if rs.ring is None or rs.ended or not rs.started or rs.phase != RUNNING:
                continue
            if rs.hang is not None:
                continue
            idle = now_m - rs.last_progress_mono
            threshold = self.hang_threshold(rs)
            if idle > threshold:
                rs.hang = {
                    "kind": "hang",
                    "rank": rs.rank,
                    "since": now_w - idle,
                    "step": rs.steps_done,
                    "idle_s": idle,
                    "threshold_s": threshold,
                    "message": f"rank {rs.rank} made no progress for {idle:.1f} s after "
                    f"{rs.steps_done} steps done (threshold {threshold:.1f} s)",
                }
                newly.append(rs)
        if not newly:
            return
        kill = [rs for rs in newly if self._kill_enabled(rs)]
        for rs in newly:
            assert rs.ring is not None
            log.error("monitor: HANG: %s", rs.hang["message"] if rs.hang else "")
            self._emit({"event": "hang", "pid": rs.ring.pid, **(rs.hang or {})})
            self.recent.append(dict(rs.hang or {}))
            if rs in kill:
                rs.kill_at = now_m + self.rules.hang_dump_wait_s
        # Ranks stuck in one collective are flagged a poll or two apart: one dump covers them.
        if now_m - self._last_dump > max(30.0, 4 * self.rules.hang_dump_wait_s):
            self._last_dump = now_m
            self._dump_stacks(ranks, now_m)

    def _kill_enabled(self, rs: RankState) -> bool:
        if self.rules.hang_kill == "on":
            return True
        return (
            self.rules.hang_kill == "auto"
            and rs.ring is not None
            and bool(rs.ring.flags & FLAG_ELASTIC)
        )

    def _dump_stacks(self, ranks: Collection[RankState], now_m: float) -> None:
        """SIGUSR1 to every local trainer with a stack dump handler; reads the dumps later."""
        collect_at = now_m + min(1.0, self.rules.hang_dump_wait_s * 0.5)
        for rs in ranks:
            ring = rs.ring
            if ring is None or rs.ended:
                continue
            if not ring.flags & FLAG_STACKS or not ring.stacks_path:
                log.warning(
                    "monitor: rank %d (pid %d) has no stack dump handler: not signalled",
                    rs.rank,
                    ring.pid,
                )
                continue
            try:
                offset = os.path.getsize(ring.stacks_path)
            except OSError:
                offset = 0
            proc_start = rs.info.get("proc_start", 0.0)
            if not ring.alive(proc_start):
                continue
            why = ring.signal_refusal(proc_start)
            if why is not None:
                log.warning("monitor: no stack dump of rank %d: not signalled: %s", rs.rank, why)
                continue
            try:
                os.kill(ring.pid, signal.SIGUSR1)
            except OSError as e:
                log.warning("monitor: cannot signal rank %d (pid %d): %s", rs.rank, ring.pid, e)
                continue
            self._stack_reads.append((collect_at, rs.rank, ring.pid, ring.stacks_path, offset))

    def act(self, ranks: Collection[RankState], now_m: float, now_w: float) -> None:
        """Logs the stack dumps that are due, kills the hung ranks whose dump wait is over."""
        due = [r for r in self._stack_reads if r[0] <= now_m]
        self._stack_reads = [r for r in self._stack_reads if r[0] > now_m]
        for _, rank, pid, path, offset in due:
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    text = f.read(1 << 20).decode(errors="replace")
            except OSError as e:
                text = f"(cannot read {path}: {e})"
            log.warning(
                "monitor: Python stacks of rank %d (pid %d), from %s:\n%s", rank, pid, path, text
            )
            self._emit({"event": "stacks", "rank": rank, "pid": pid, "path": path})
        for rs in ranks:
            if rs.kill_at is None or now_m < rs.kill_at or rs.hang is None:
                continue
            rs.kill_at = None
            ring = rs.ring
            proc_start = rs.info.get("proc_start", 0.0)
            if ring is None or rs.ended or not ring.alive(proc_start):
                continue
            why = ring.signal_refusal(proc_start)
            if why is not None:
                # Never a pid that may be another process's: the hang stays reported, unkilled.
                log.error(
                    "monitor: NOT killing hung rank %d (pid %d): %s; restart it yourself (or "
                    "let its launcher's timeout do it)",
                    rs.rank,
                    ring.pid,
                    why,
                )
                self._emit(
                    {"event": "hang_kill_refused", "rank": rs.rank, "pid": ring.pid, "why": why}
                )
                continue
            try:
                os.kill(ring.pid, signal.SIGKILL)
            except OSError as e:
                log.error("monitor: cannot kill hung rank %d (pid %d): %s", rs.rank, ring.pid, e)
                continue
            rs.killed = True
            log.error(
                "monitor: killed hung rank %d (pid %d) so its launcher restarts it",
                rs.rank,
                ring.pid,
            )
            self._emit({"event": "hang_kill", "rank": rs.rank, "pid": ring.pid})

    # -- stragglers ----------------------------------------------------------------------------
    def check_stragglers(self, ranks: Collection[RankState], now_w: float) -> None:
        """Flags (and clears) the ranks whose median part exceeds the others' (module doc)."""
        cfg = self.rules
        live = [
            rs
            for rs in ranks
            if rs.ring is not None
            and not rs.ended
            and rs.started
            and len(rs.window) >= cfg.straggler_min_steps
        ]
        if len(live) < 2:
            return
        metric = cfg.straggler_metric
        recent = {rs.rank: list(rs.window)[-cfg.straggler_window :] for rs in live}
        if metric == "compute" and any(
            all(r[PART_INDEX["forward"]] == 0 and r[PART_INDEX["optimizer"]] == 0 for r in recs)
            for recs in recent.values()
        ):
            metric = "step"  # the model's forward or the optimizer is not seen

        def value(r: tuple[Any, ...]) -> float:
            if metric == "compute":
                return float(r[PART_INDEX["forward"]] + r[PART_INDEX["optimizer"]])
            return float(r[PART_INDEX[metric]])

        med = {rank: statistics.median(value(r) for r in recs) for rank, recs in recent.items()}
        for rs in live:
            mine = med[rs.rank]
            others = statistics.median(v for r, v in med.items() if r != rs.rank)
            ratio = mine / others if others > 0 else (float("inf") if mine > 0 else 1.0)
            slow = ratio > cfg.straggler_factor and mine - others >= cfg.straggler_min_ms
            if slow and rs.straggler is None:
                rs.straggler = {
                    "kind": "straggler",
                    "rank": rs.rank,
                    "since": now_w,
                    "metric": metric,
                    "median_ms": mine,
                    "others_ms": others,
                    "ratio": ratio,
                    "message": f"rank {rs.rank} is a straggler: {metric} median {mine:.1f} ms "
                    f"vs {others:.1f} ms on the other ranks (x{ratio:.2f})",
                }
                log.warning("monitor: STRAGGLER: %s", rs.straggler["message"])
                self._emit({"event": "straggler", **rs.straggler})
                self.recent.append(dict(rs.straggler))
            elif slow and rs.straggler is not None:
                rs.straggler.update(median_ms=mine, others_ms=others, ratio=ratio)
            elif not slow and rs.straggler is not None:
                rs.straggler = None
                self._emit({"event": "straggler_cleared", "rank": rs.rank, "ratio": ratio})
