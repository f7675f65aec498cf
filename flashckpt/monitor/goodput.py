"""Goodput accounting: where the wall time of a training job went.

The node agent's monitor (:mod:`flashckpt.monitor.step_monitor`) appends JSON lines to
``<events_dir>/<job>.<node>.events.jsonl``. This module turns those events (from one or several
machines) into a breakdown of each rank's wall time, as text, JSON and a PNG chart::

    flashckpt goodput /tmp/flashckpt-1000/job7.*.events.jsonl --png goodput.png

The events it reads (times ``t``, ``proc_start``, ``enter``, ``ready``, ``t1`` are wall-clock
seconds; durations are seconds):

- ``{"event": "start", "rank", "token", "proc_start", "enter", "ready", "resume_step", ...}``:
  a trainer process (an *incarnation* of a rank, named by ``token``) entered
  ``flashckpt.checkpointing()`` at ``enter`` and began its first step at ``ready``; the process
  was created at ``proc_start``. ``ready`` is null if it never got that far.
- ``{"event": "steps", "v": 2, "rank", "token", "first", "last", "n", "t1", "step_s",
  "ckpt_s", "recomputed_s", "recomputed_n", ...}``: ``n`` iterations ended by ``t1``; together
  they took ``step_s``; of that, ``recomputed_s`` went to iterations run before (re-run after a
  resume) and ``ckpt_s`` to checkpoint stalls of the others. ``first`` and ``last`` count steps
  completed (``ckpt.steps_done``) after the batch's first and last iteration, as every step
  flashckpt prints; lines without ``v`` (written before it) carry the iterations' 0-based
  indices there instead: read both with :func:`steps_span`, never the fields themselves.
- ``{"event": "end", "rank", "token", "reason": "exit" | "died" | "killed", "t"}``: the
  incarnation exited cleanly at ``t``, or was found dead (or killed as hung) at ``t``.

Each rank's wall time, from the first process start to the end of its last incarnation, is split
into:

- ``useful``: iterations run for the first time, less their checkpoint stalls;
- ``checkpoint``: time the loop was blocked by flashckpt (snapshot copies, waits for a copy before
  ``optimizer.step()``, flushes, the final save and commit at exit);
- ``failure_detection``: from the last progress of an incarnation that failed (died, hung and was
  killed) to the start of its replacement process: the lost partial step, the time to notice,
  the restart;
- ``rendezvous``: from process start to ``checkpointing()`` entry: imports, process group
  initialisation and the rendezvous;
- ``restore``: inside ``checkpointing()`` entry: agent connection, the restore agreement and
  load, slot allocation;
- ``recomputed``: iterations re-run after a resume (steps already done before the failure);
- ``other``: the rest (idle gaps after a clean exit, iterations whose records were lost).

The job's figures are the mean over ranks.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CATEGORIES",
    "GoodputReport",
    "Incarnation",
    "build_parser",
    "compute_goodput",
    "format_report",
    "incarnations_from_events",
    "main",
    "plot_report",
    "read_events",
    "steps_span",
]

CATEGORIES: tuple[str, ...] = (
    "useful",
    "checkpoint",
    "failure_detection",
    "rendezvous",
    "restore",
    "recomputed",
    "other",
)
_LABELS = {
    "useful": "useful steps",
    "checkpoint": "checkpoint stalls",
    "failure_detection": "failure detection",
    "rendezvous": "rendezvous",
    "restore": "restore",
    "recomputed": "recomputed steps",
    "other": "other",
}
_COLORS = {
    "useful": "#2ca02c",
    "checkpoint": "#1f77b4",
    "failure_detection": "#d62728",
    "rendezvous": "#9467bd",
    "restore": "#ff7f0e",
    "recomputed": "#e377c2",
    "other": "#7f7f7f",
}


@dataclass(slots=True)
class Incarnation:
    """One trainer process of one rank, as far as the events tell."""

    rank: int
    token: str
    proc_start: float
    enter: float
    ready: float | None = None
    node: str | None = None
    resume_step: int | None = None
    n: int = 0
    lost: int = 0
    """Iterations whose records were overwritten before the monitor read them (they ran)."""
    recomputed_n: int = 0
    step_s: float = 0.0
    ckpt_s: float = 0.0
    recomputed_s: float = 0.0
    last_progress: float | None = None
    """End of the last recorded iteration (wall clock)."""
    end_reason: str | None = None
    end_t: float | None = None

    @property
    def records_read(self) -> int:
        """How many of its ring's records the events account for (read or lost): where a
        monitor that takes over its ring (an agent started again) goes on reading."""
        return self.n + self.lost

    @property
    def progress_at(self) -> float:
        """The last moment this incarnation is known to have made progress."""
        if self.last_progress is not None:
            return self.last_progress
        return self.ready if self.ready is not None else self.enter


@dataclass(slots=True)
class GoodputReport:
    """Seconds per category, per rank and for the job (the mean over ranks)."""

    ranks: dict[int, dict[str, float]] = field(default_factory=dict)
    walls: dict[int, float] = field(default_factory=dict)
    incarnations: dict[int, int] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    recomputed_steps: dict[int, int] = field(default_factory=dict)

    @property
    def wall(self) -> float:
        return _mean(self.walls.values())

    @property
    def job(self) -> dict[str, float]:
        return {c: _mean(r[c] for r in self.ranks.values()) for c in CATEGORIES}

    @property
    def goodput(self) -> float:
        """Useful time over wall time (0 when nothing ran)."""
        return self.job["useful"] / self.wall if self.wall > 0 else 0.0

    @property
    def restarts(self) -> int:
        return max((n - 1 for n in self.incarnations.values()), default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall,
            "goodput": self.goodput,
            "restarts": self.restarts,
            "job_s": self.job,
            "ranks": {
                str(r): {
                    "wall_s": self.walls[r],
                    "incarnations": self.incarnations[r],
                    "steps": self.steps[r],
                    "recomputed_steps": self.recomputed_steps[r],
                    **{f"{c}_s": v for c, v in cats.items()},
                }
                for r, cats in sorted(self.ranks.items())
            },
        }


def _mean(xs: Iterable[float]) -> float:
    vals = list(xs)
    return sum(vals) / len(vals) if vals else 0.0


def read_events(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Reads JSON-lines event files (glob patterns allowed); skips torn or foreign lines.

    Raises:
        FileNotFoundError: a path (or pattern) matches no file.
    """
    events: list[dict[str, Any]] = []
    for pattern in paths:
        files = sorted(glob.glob(pattern)) or [pattern]
        for path in files:
            with open(path) as f:  # raises FileNotFoundError naming the path
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        ev = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line torn by a crash mid-write
                    if isinstance(ev, dict) and "event" in ev:
                        events.append(ev)
    return events


STEPS_EVENT_VERSION = 2
"""The ``v`` of the ``steps`` events written now: ``first``/``last`` count steps completed. A
line without ``v`` is version 1: 0-based iteration indices."""


def steps_span(ev: dict[str, Any]) -> tuple[int | None, int | None]:
    """A ``steps`` event's ``(first, last)`` as steps completed (``ckpt.steps_done`` after the
    batch's first and last iteration; None where the batch had none), whichever version wrote it.

    Raises:
        ValueError: a version this flashckpt does not know (a newer one wrote the line): its
            numbers are not guessed at.
    """
    v = ev.get("v", 1)
    if v == 1:
        shift = 1  # 0-based iteration indices
    elif v == STEPS_EVENT_VERSION:
        shift = 0
    else:
        raise ValueError(
            f"a 'steps' event of version {v!r} (this flashckpt reads 1 and "
            f"{STEPS_EVENT_VERSION}): written by a newer flashckpt; read the file with that one"
        )
    first, last = ev.get("first"), ev.get("last")
    return (
        None if first is None else int(first) + shift,
        None if last is None else int(last) + shift,
    )


def incarnations_from_events(events: Iterable[dict[str, Any]]) -> dict[int, list[Incarnation]]:
    """Builds each rank's incarnations (ordered by process start) from monitor events."""
    by_token: dict[str, Incarnation] = {}
    for ev in events:
        kind = ev.get("event")
        token = str(ev.get("token", ""))
        if kind == "start":
            if token in by_token:
                continue  # re-announced by an agent that adopted a running trainer
            by_token[token] = Incarnation(
                rank=int(ev["rank"]),
                token=token,
                proc_start=float(ev["proc_start"]),
                enter=float(ev["enter"]),
                ready=None if ev.get("ready") is None else float(ev["ready"]),
                node=ev.get("node"),
                resume_step=ev.get("resume_step"),
            )
            continue
        inc = by_token.get(token)
        if inc is None:
            continue
        if kind == "steps":
            inc.n += int(ev.get("n", 0))
            inc.lost += int(ev.get("lost", 0) or 0)
            inc.recomputed_n += int(ev.get("recomputed_n", 0))
            inc.step_s += float(ev.get("step_s", 0.0))
            inc.ckpt_s += float(ev.get("ckpt_s", 0.0))
            inc.recomputed_s += float(ev.get("recomputed_s", 0.0))
            if ev.get("n") and ev.get("t1"):  # a batch of only lost records has no end time
                t1 = float(ev["t1"])
                inc.last_progress = t1 if inc.last_progress is None else max(inc.last_progress, t1)
        elif kind == "end" and inc.end_reason is None:
            inc.end_reason = str(ev.get("reason", "died"))
            inc.end_t = float(ev["t"])
    out: dict[int, list[Incarnation]] = {}
    for inc in by_token.values():
        out.setdefault(inc.rank, []).append(inc)
    for incs in out.values():
        incs.sort(key=lambda i: i.proc_start)
    return out


def compute_goodput(incarnations: dict[int, list[Incarnation]]) -> GoodputReport:
    """Splits each rank's wall time into the categories of :data:`CATEGORIES`.

    A last incarnation that is still running counts up to its last progress: its current
    iteration is not done yet.

    Args:
        incarnations: per rank, its incarnations ordered by process start.

    Returns:
        The report; for every rank the categories add up to its wall time.
    """
    rep = GoodputReport()
    for rank, incs in sorted(incarnations.items()):
        if not incs:
            continue
        cats = dict.fromkeys(CATEGORIES, 0.0)
        end = incs[0].proc_start
        for i, inc in enumerate(incs):
            cats["rendezvous"] += max(0.0, inc.enter - inc.proc_start)
            if inc.ready is not None:
                cats["restore"] += max(0.0, inc.ready - inc.enter)
            cats["recomputed"] += inc.recomputed_s
            cats["checkpoint"] += inc.ckpt_s
            cats["useful"] += max(0.0, inc.step_s - inc.ckpt_s - inc.recomputed_s)
            last = inc.progress_at
            nxt = incs[i + 1] if i + 1 < len(incs) else None
            if inc.end_reason == "exit":
                stop = inc.end_t if inc.end_t is not None else last
                cats["checkpoint"] += max(0.0, stop - last)  # the final save + commit
                if nxt is not None:
                    cats["other"] += max(0.0, nxt.proc_start - stop)
                end = max(end, stop)
            elif nxt is not None:
                cats["failure_detection"] += max(0.0, nxt.proc_start - last)
                end = max(end, last)
            elif inc.end_reason is not None and inc.end_t is not None:
                cats["failure_detection"] += max(0.0, inc.end_t - last)
                end = max(end, inc.end_t)
            else:
                end = max(end, last)  # still running
        wall = max(0.0, end - incs[0].proc_start)
        covered = sum(v for k, v in cats.items() if k != "other")
        # Whatever the events do not account for (lost records, gaps) is "other"; overlaps
        # (clock skew between processes) make it negative, and are clamped.
        cats["other"] = max(0.0, wall - covered)
        rep.ranks[rank] = cats
        rep.walls[rank] = max(wall, covered)
        rep.incarnations[rank] = len(incs)
        rep.steps[rank] = sum(i.n for i in incs)
        rep.recomputed_steps[rank] = sum(i.recomputed_n for i in incs)
    return rep


def format_report(rep: GoodputReport) -> str:
    """The report as a short text table (job means, then one line per rank)."""
    if not rep.ranks:
        return "goodput: no trainer events recorded"
    wall = rep.wall
    lines = [
        f"goodput report: {len(rep.ranks)} rank(s), wall {wall:.1f} s, "
        f"restarts {rep.restarts}, goodput {100 * rep.goodput:.1f}%",
    ]
    job = rep.job
    for c in CATEGORIES:
        share = 100 * job[c] / wall if wall > 0 else 0.0
        lines.append(f"  {_LABELS[c]:<20} {job[c]:>10.1f} s {share:>6.1f}%")
    lines.append(
        f"  {'rank':>4} {'wall s':>9} {'steps':>7} {'recomp':>7} {'incarn':>6}  "
        + " ".join(f"{c[:8]:>8}" for c in CATEGORIES)
    )
    for r, cats in sorted(rep.ranks.items()):
        lines.append(
            f"  {r:>4} {rep.walls[r]:>9.1f} {rep.steps[r]:>7} {rep.recomputed_steps[r]:>7} "
            f"{rep.incarnations[r]:>6}  " + " ".join(f"{cats[c]:>8.1f}" for c in CATEGORIES)
        )
    return "\n".join(lines)


def plot_report(rep: GoodputReport, path: str, title: str | None = None) -> None:
    """Draws the breakdown as a PNG: one stacked bar for the job and one per rank.

    Raises:
        ImportError: matplotlib is not installed (names the package to install).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "the goodput chart needs matplotlib: pip install matplotlib "
            "(or drop --png to get the text report only)"
        ) from None
    rows = [("job", rep.job, rep.wall)] + [
        (f"rank {r}", cats, rep.walls[r]) for r, cats in sorted(rep.ranks.items())
    ]
    height = 1.2 + 0.4 * len(rows)
    fig = Figure(figsize=(9, height))
    ax = fig.add_subplot(1, 1, 1)
    labels = [name for name, _, _ in rows][::-1]
    for c in CATEGORIES:
        lefts = []
        widths = []
        for _, cats, wall in rows[::-1]:
            before = sum(cats[k] for k in CATEGORIES[: CATEGORIES.index(c)])
            lefts.append(100 * before / wall if wall > 0 else 0.0)
            widths.append(100 * cats[c] / wall if wall > 0 else 0.0)
        ax.barh(labels, widths, left=lefts, color=_COLORS[c], label=_LABELS[c])
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of wall time")
    ax.set_title(
        title or f"goodput {100 * rep.goodput:.1f}% of {rep.wall:.0f} s (restarts {rep.restarts})"
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def build_parser() -> argparse.ArgumentParser:
    """The ``flashckpt goodput`` flags."""
    p = argparse.ArgumentParser(
        prog="flashckpt goodput",
        description="Break a job's wall time down from the node agents' event files.",
    )
    p.add_argument("events", nargs="+", help="events.jsonl files (glob patterns allowed)")
    p.add_argument("--png", default=None, help="also draw the breakdown to this PNG file")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """``flashckpt goodput EVENTS... [--png PATH] [--json]``."""
    args = build_parser().parse_args(argv)
    try:
        events = read_events(args.events)
    except OSError as e:
        print(f"flashckpt goodput: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    rep = compute_goodput(incarnations_from_events(events))
    if args.json:
        print(json.dumps(rep.to_json(), indent=1))
    else:
        print(format_report(rep))
    if args.png:
        try:
            plot_report(rep, args.png)
        except ImportError as e:
            print(f"flashckpt goodput: {e}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"chart written to {args.png}")
    return 0 if rep.ranks else 1
