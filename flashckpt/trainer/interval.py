"""``every="auto"``: the snapshot interval in steps from the measured stall, step time and
failure rate.

The interval that minimises lost time is Daly's optimum of the expected wall time per useful
second (:func:`flashckpt.planning.choose_interval`; about Young's ``sqrt(2 * stall * MTBF)``).
It is in seconds; divided by the measured step time it becomes a number of steps. Inputs:

- **stall** (delta): seconds the loop is blocked per snapshot: the median of the recent
  ``save()`` stalls plus the median of the recent waits for a background copy;
- **step time**: the median of the recent iteration times (the time between ``ckpt.step()``
  calls, snapshots included: the median keeps them out);
- **MTBF** (M): a prior, updated with the failures seen so far. The prior is a per-GPU MTBF of
  ``GPU_MTBF_PRIOR_H`` = 50,000 hours (Meta's Llama 3 report: 419 unexpected interruptions in
  54 days on 16,384 GPUs, i.e. about 50,700 GPU-hours per interruption) divided by the world
  size, unless ``mtbf_s`` gives the job MTBF. Failures are torch elastic's worker-group
  restarts (``$TORCHELASTIC_RESTART_COUNT``, set for the workers of ``flashckpt run`` and
  torchrun) over the time since the launcher started (``$FLASHCKPT_JOB_START``, set by
  ``flashckpt run``; otherwise since ``checkpointing()`` was entered). The estimate is the mean
  of a gamma posterior with the prior counted as one failure-free MTBF of observation:
  ``M = (prior + elapsed) / (1 + failures)``. So a few restarts early in a run move M
  little, and a steady failure rate takes over as the run goes on.

Every rank must snapshot at the same steps (a step is committed when every rank's part is in),
so the ranks agree on each new interval: each proposes one and they take the smallest (one
all-reduce of one integer, at snapshot steps only). The first snapshot comes ``first_steps``
steps after the start (it measures the stall); the interval is chosen again after every
snapshot, from the newest measurements.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from flashckpt import envnames

__all__ = [
    "GPU_MTBF_PRIOR_H",
    "JOB_START_ENV",
    "AutoInterval",
    "estimate_mtbf_s",
    "interval_steps",
]

JOB_START_ENV = envnames.JOB_START
"""Wall-clock time (``time.time()``) the launcher started; set by ``flashckpt run``."""
RESTARTS_ENV = "TORCHELASTIC_RESTART_COUNT"
GPU_MTBF_PRIOR_H = 50_000.0
"""Prior per-GPU MTBF in hours (see the module docstring)."""
MAX_STEPS = 1_000_000
"""The longest interval ``auto`` picks, in steps."""


def estimate_mtbf_s(prior_s: float, elapsed_s: float, failures: int) -> float:
    """Job MTBF from a prior and the failures seen: ``(prior + elapsed) / (1 + failures)``.

    Args:
        prior_s: The prior job MTBF in seconds (> 0).
        elapsed_s: Seconds of the job observed so far (>= 0).
        failures: Failures (restarts) seen in that time (>= 0).
    """
    if not prior_s > 0:
        raise ValueError(f"prior MTBF {prior_s!r} s: must be > 0 seconds")
    if elapsed_s < 0 or failures < 0:
        raise ValueError(f"elapsed {elapsed_s} s, failures {failures}: must be >= 0")
    return (prior_s + elapsed_s) / (1 + failures)


def interval_steps(
    stall_s: float, step_s: float, mtbf_s: float, *, max_steps: int = MAX_STEPS
) -> tuple[int, float]:
    """The snapshot interval that minimises lost time, in steps and in seconds.

    Args:
        stall_s: Seconds the loop blocks per snapshot (> 0).
        step_s: Seconds per training step (> 0).
        mtbf_s: Job MTBF in seconds (> 0).
        max_steps: Upper bound on the answer.

    Returns:
        ``(steps, seconds)``: ``seconds`` from :func:`flashckpt.planning.choose_interval`, ``steps``
        its rounding to whole steps, at least 1 and at most ``max_steps``.
    """
    from flashckpt.planning import choose_interval

    if not step_s > 0:
        raise ValueError(f"step time {step_s!r} s: must be > 0")
    tau = choose_interval(stall_s, mtbf_s)
    return max(1, min(max_steps, round(tau / step_s))), tau


def _env_float(name: str) -> float | None:
    v = os.environ.get(name)
    try:
        return float(v) if v else None
    except ValueError:
        return None


class AutoInterval:
    """The state of ``every="auto"`` for one rank (driven by the checkpointer's ``step()``).

    Args:
        world: Ranks of the job (GPUs), for the prior.
        mtbf_s: The job MTBF prior in seconds; None: ``GPU_MTBF_PRIOR_H`` / world.
        start_step: Steps done when this process started (``ckpt.start_step``).
        first_steps: Steps before the first snapshot (it measures the stall).
        window: Recent iterations and snapshots the medians are taken over.
        clock: Monotonic clock (for tests).
        now: Wall clock (for tests).
    """

    def __init__(
        self,
        *,
        world: int,
        mtbf_s: float | None = None,
        start_step: int = 0,
        first_steps: int = 10,
        window: int = 50,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], float] = time.time,
    ) -> None:
        if world < 1:
            raise ValueError(f"world={world}: must be >= 1")
        if mtbf_s is not None and not mtbf_s > 0:
            raise ValueError(f"mtbf_s={mtbf_s!r}: the job MTBF must be > 0 seconds")
        if first_steps < 1:
            raise ValueError(f"first_steps={first_steps}: must be >= 1")
        self.prior_s = mtbf_s if mtbf_s is not None else GPU_MTBF_PRIOR_H * 3600.0 / world
        self._clock, self._now = clock, now
        self._entered = now()
        self.job_start = _env_float(JOB_START_ENV) or self._entered
        self._times: deque[float] = deque(maxlen=window)
        self._window = window
        self._last: float | None = None
        self.next_due = start_step + first_steps
        """The label of the next snapshot: the number of steps done when it is taken."""
        self.steps: int | None = None
        """The interval in steps last chosen (None before the first snapshot)."""
        self.seconds: float | None = None
        self.stall_s: float | None = None
        self.step_s: float | None = None
        self.mtbf_s: float | None = None
        self.failures = 0
        self.decisions = 0
        self.proposed: int | None = None
        """This rank's own choice at the last decision (before the ranks agreed)."""

    def tick(self) -> None:
        """Called at every ``ckpt.step()``: records the iteration's duration."""
        t = self._clock()
        if self._last is not None:
            self._times.append(t - self._last)
        self._last = t

    def due(self, done: int) -> bool:
        """Whether a snapshot is due once ``done`` steps are completed (it is labelled ``done``)."""
        return done >= self.next_due

    def decide(
        self,
        step: int,
        stalls: Sequence[float],
        waits: Sequence[float],
        agree: Callable[[int], int] = lambda n: n,
    ) -> int:
        """Chooses the next interval after the snapshot labelled ``step``.

        Args:
            step: The label of the snapshot just taken (the steps done).
            stalls: ``save()`` stalls so far (seconds).
            waits: Waits for background copies so far (seconds).
            agree: Makes every rank use the same interval (the checkpointer's all-reduce of
                the minimum); identity for one rank.

        Returns:
            The interval in steps; the next snapshot is labelled ``step + interval``.
        """
        recent = list(stalls)[-self._window :]
        stall = statistics.median(recent) if recent else 0.0
        recent_w = list(waits)[-self._window :]
        stall += statistics.median(recent_w) if recent_w else 0.0
        step_s = statistics.median(self._times) if self._times else None
        restarts = os.environ.get(RESTARTS_ENV, "0")
        self.failures = int(restarts) if restarts.isdigit() else 0
        elapsed = max(0.0, self._now() - self.job_start)
        self.mtbf_s = estimate_mtbf_s(self.prior_s, elapsed, self.failures)
        if step_s and step_s > 0 and stall > 0:
            steps, seconds = interval_steps(stall, step_s, self.mtbf_s)
        else:  # nothing measured (no time passes on this clock): keep the first spacing
            steps, seconds = max(1, self.steps or 1), math.nan
        self.proposed = steps
        steps = max(1, agree(steps))
        self.steps, self.seconds = steps, seconds
        self.stall_s, self.step_s = stall, step_s
        self.next_due = step + steps
        self.decisions += 1
        return steps

    def status(self) -> dict[str, Any]:
        """What ``ckpt.status()["every"]`` shows."""
        return {
            "mode": "auto",
            "interval_steps": self.steps,
            "proposed_steps": self.proposed,
            "interval_s": None
            if self.seconds is None or math.isnan(self.seconds)
            else self.seconds,
            "next_snapshot_step": self.next_due,
            "stall_s": self.stall_s,
            "step_s": self.step_s,
            "mtbf_s": self.mtbf_s,
            "prior_mtbf_s": self.prior_s,
            "failures": self.failures,
            "decisions": self.decisions,
        }
