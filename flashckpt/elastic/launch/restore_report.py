"""What ``flashckpt run`` prints about restores and, at the end, the job: read from the node agent.

The node agent's monitor appends JSON lines to ``<run_dir>/<job>.<node>.events.jsonl``; its
``start`` event of each trainer incarnation carries the step it resumed at (``resume_step``),
where the state came from (``restored_from``: ``memory``, ``replica``, ``peer-memory`` (a
lost machine's ranks from another machine's replica), ``storage``, ``memory-reshard``,
``peer-reshard`` (resharded to a new world size with pieces from another machine's
replica)...,
``None`` for a fresh start) and how long the entry took (``restore_s``,
from entering ``checkpointing()`` to the first step). After every (re)start of the workers
:class:`RestoreReporter` waits, in a daemon thread, for the ``start`` events of this round's
local ranks and prints one line for the machine::

    [flashckpt run n0] round 2: ranks 0-1 restored step 40 from memory in 0.84 s

At the end :func:`job_summary` condenses the whole events file (every round of the job on this
machine) with :mod:`flashckpt.monitor.goodput`: the steps completed, iterations run and recomputed,
restarts, goodput.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from flashckpt import names
from flashckpt.monitor.goodput import (
    compute_goodput,
    incarnations_from_events,
    read_events,
    steps_span,
)

__all__ = ["RestoreReporter", "events_path", "format_restore_line", "job_summary", "say"]

logger = logging.getLogger("flashckpt.launcher")

_POLL_S = 0.2
_MAX_WAIT_S = 3600.0  # a trainer may take long to import and restore; the next round ends it
_MAX_LINE = 1 << 20  # a line longer than this is not the monitor's
_GRACE_S = 5.0


def say(line: str, stream: TextIO | None = None) -> None:
    """Prints one line of the launcher's report (stdout by default). A stream that refuses the
    write (EPIPE: ``flashckpt run ... | tee log`` after a Ctrl-C killed ``tee``; EIO: a hung-up
    terminal) is pointed at ``/dev/null`` from then on: a report never cuts the teardown short,
    nor leaves unwritten bytes that would fail the interpreter's exit."""
    out = stream if stream is not None else sys.stdout
    try:
        print(line, file=out, flush=True)
    except (OSError, ValueError):  # ValueError: a closed file object
        silence(out)


def silence(stream: TextIO) -> None:
    """Points ``stream``'s descriptor at ``/dev/null`` and drops what its buffer holds."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    with contextlib.suppress(OSError, ValueError):
        stream.flush()  # to /dev/null now: the bytes that failed are gone


def events_path(run_dir: str, job: str, node: str) -> str:
    """The node agent's events file of one job and machine."""
    return names.events_path(run_dir, job, node)


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("ranks " if len(ranks) > 1 else "rank ") + ",".join(map(str, ranks))


SOURCE_NOTES = {
    "peer-memory": "another machine's replica",
    "peer-reshard": "resharded, with another machine's replica",
}
"""What a source name means, where the name alone does not say it (shown after it)."""


def format_restore_line(round_no: int, starts: Sequence[dict[str, Any]]) -> str:
    """One line for the machine: what each group of its ranks restored, from where, how fast.

    Args:
        round_no: The rendezvous round of the start (the number in etcd, the same on every
            machine of the round).
        starts: The monitor's ``start`` events of this round, one per local rank.
    """
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for ev in starts:
        groups.setdefault((ev.get("resume_step"), ev.get("restored_from")), []).append(ev)
    parts = []
    for (step, source), evs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        ranks = _ranks_text([int(e.get("rank", -1)) for e in evs])
        times = [float(e["restore_s"]) for e in evs if isinstance(e.get("restore_s"), int | float)]
        took = f" in {max(times):.2f} s" if times else ""
        if source:
            note = SOURCE_NOTES.get(str(source))
            where = f"{source} ({note})" if note else str(source)
            parts.append(f"{ranks} restored step {step} from {where}{took}")
        else:
            parts.append(f"{ranks} started at step {step} with nothing to restore{took}")
    return f"round {round_no}: " + "; ".join(parts)


class RestoreReporter:
    """Prints one restore line per (re)start of the workers; see the module docstring.

    Args:
        path: The node agent's events file.
        nproc: Local ranks per round.
        emit: Where lines go (default: stdout with the launcher's prefix, and the log).
    """

    def __init__(
        self, path: str, nproc: int, *, prefix: str = "", emit: Callable[[str], None] | None = None
    ) -> None:
        self.path = path
        self.nproc = nproc
        self._prefix = prefix
        self._emit = emit or self._print
        self._round = 0
        self._starts: list[float] = []
        self._lock = threading.Lock()
        self.lines: list[str] = []
        """Every line printed so far."""

    def _print(self, line: str) -> None:
        say(f"{self._prefix}{line}")

    def workers_started(self, since: float, *, round_no: int | None = None) -> None:
        """Called when a round's workers start (wall clock ``since``); returns at once.

        Args:
            since: The wall clock of the start.
            round_no: The rendezvous round (the number in etcd) the line names; None: this
                launcher's count of its starts (1: the first), for a launcher without one.
        """
        with self._lock:
            self._round += 1
            start_no = self._round
            self._starts.append(since)
        threading.Thread(
            target=self._watch,
            args=(start_no, start_no if round_no is None else round_no),
            name=f"flashckpt-restore-{start_no}",
            daemon=True,
        ).start()

    def _watch(self, start_no: int, round_no: int) -> None:
        try:
            starts = self._wait_starts(start_no)
        except Exception:  # a report, never a reason to stop the launcher
            logger.exception("reading the node agent's events failed")
            return
        if not starts:
            return
        line = format_restore_line(round_no, starts)
        with self._lock:
            self.lines.append(line)
        self._emit(line)

    def _window(self, start_no: int) -> tuple[float, float | None]:
        """Trainers of this start entered ``checkpointing()`` in ``[since, until)`` (wall)."""
        with self._lock:
            since = self._starts[start_no - 1]
            until = self._starts[start_no] if len(self._starts) > start_no else None
        return since, until

    def _wait_starts(self, start_no: int) -> list[dict[str, Any]]:
        by_rank: dict[int, dict[str, Any]] = {}
        offset = 0
        deadline = time.monotonic() + _MAX_WAIT_S
        superseded_at: float | None = None
        while time.monotonic() < deadline:
            since, until = self._window(start_no)
            offset = self._read_new(offset, since, until, by_rank)
            if len(by_rank) >= self.nproc:
                break
            if until is not None:
                # Restarted before every rank came up: the monitor may still report the ones
                # that did (it scans a few times a second); then say what is known.
                superseded_at = superseded_at or time.monotonic()
                if time.monotonic() - superseded_at > _GRACE_S:
                    break
            time.sleep(_POLL_S)
        return [by_rank[r] for r in sorted(by_rank)]

    def _read_new(
        self, offset: int, since: float, until: float | None, by_rank: dict[int, dict[str, Any]]
    ) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return offset
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        for raw in data[:end].splitlines():
            if len(raw) > _MAX_LINE:
                continue
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(ev, dict) or ev.get("event") != "start":
                continue
            # When the trainer entered checkpointing() (its own clock reading, unlike
            # proc_start, which psutil derives from the boot time in whole seconds).
            born, rank = ev.get("enter"), ev.get("rank")
            if not isinstance(born, int | float) or not isinstance(rank, int):
                continue
            if born < since or (until is not None and born >= until):
                continue  # another round's trainer
            if ev.get("ready") is None:
                continue  # died before its first step: no restore to report
            by_rank.setdefault(rank, ev)
        return offset + end


def job_summary(path: str, *, restarts: int) -> str | None:
    """The job's short summary on this machine, from the node agent's events file.

    Args:
        path: The events file.
        restarts: How many times this launcher restarted its workers.

    Returns:
        ``None`` when there is nothing to summarize (no trainer ever reported).
    """
    try:
        events = read_events([path])
    except FileNotFoundError:
        return None
    rep = compute_goodput(incarnations_from_events(events))
    if not rep.ranks:
        return None
    # Steps completed (the convention of ckpt.steps_done, status, the storage's step
    # numbers), so a run of 60 steps says 60; steps_span reads old files' 0-based indices too.
    done = [d for e in events if e.get("event") == "steps" for d in steps_span(e)[1:]]
    last = [d for d in done if d is not None]
    reached = f"{max(last)} steps completed" if last else "no step completed"
    iterations = max(rep.steps.values(), default=0)
    recomputed = max(rep.recomputed_steps.values(), default=0)
    return (
        f"summary: {reached}, {iterations} iterations per rank ({recomputed} recomputed), "
        f"{restarts} restart(s), goodput {100 * rep.goodput:.1f}% of {rep.wall:.1f} s"
    )
