"""Restore: one pipeline, run collectively by every rank on entry.

1. plan: the ranks agree on the newest step every rank can obtain, and from which source;
2. read: each rank's source reads its state of that step into a :class:`SavedStep`;
3. fit: DTensor pieces are fitted to this run's layout (resharded), and the state is checked
   against the model;
4. apply: the state goes into the model, optimizer and the user's objects.

A rank that cannot read or fit the step says so in an all-reduce; the ranks then plan again
without it (or only without that rank's copy, where only its memory failed its data hash), or
stop where the failure is no bad copy but a state that does not fit: every rank then raises a
:class:`~flashckpt.errors.RestoreError` naming each failed rank and its error.

The sources, in order of preference (:data:`SOURCES`): this rank's own memory, a sharded state
rebuilt from the memory of this world's ranks (with, at a new world size, the replicas their
node agents hold of lost machines' snapshots), a replica's memory, this rank's snapshot from a
peer machine's memory (the agents' replicas, pulled by this rank's agent), storage. A step is
agreed only where every rank has it from one of them. A new source (a
local-disk tier, a peer machine's memory) is one class implementing :class:`RestoreSource`,
added to that list.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flashckpt.errors import RestoreError
from flashckpt.format.storage import CorruptCheckpointError
from flashckpt.trainer.interval import RESTARTS_ENV
from flashckpt.trainer.rankctx import RankContext
from flashckpt.trainer.restore.saved import RestoreEnv, RestorePlan, RestoreSource, SavedStep
from flashckpt.trainer.restore.sources import (
    DataParallelSource,
    K,
    MemoryReshardSource,
    MemorySource,
    ReplicaPullSource,
    StorageSource,
    discarded_name,
)
from flashckpt.trainer.snapshot import BadMemory, TornSnapshot

if TYPE_CHECKING:
    from flashckpt.trainer.restore.apply import Applier

__all__ = ["ERROR_TEXT_BYTES", "SOURCES", "Restorer", "agree"]

log = logging.getLogger("flashckpt")

SOURCES: tuple[Callable[[RestoreEnv], RestoreSource], ...] = (
    MemorySource,
    MemoryReshardSource,
    DataParallelSource,
    ReplicaPullSource,
    StorageSource,
)
"""Every restore source, most preferred first (built in this order, once per restore)."""


def agree(env: RestoreEnv, sources: list[RestoreSource], excluded: set[int]) -> RestorePlan | None:
    """Agrees (collectively) on the newest step every rank can obtain, and from where.

    Per rank, the first source (in ``sources`` order) that offers a step is the one it reads
    from; a step counts where every rank has one. A whole-world source then replaces that plan
    where it offers a newer step, or the same step where the plan needs a less preferred source
    than it on some rank.
    """
    ctx = env.ctx
    ranked = [(i, s) for i, s in enumerate(sources) if not s.whole_world]
    offers = [
        sorted(set(s.offer(excluded, lambda _: True)) - excluded, reverse=True)[:K]
        for _, s in ranked
    ]
    got = ctx.gather_sets(offers, K)  # got[j][rank]: the steps ranked[j] offers on that rank
    best: RestorePlan | None = None
    for step in sorted(set().union(*(g for per in got for g in per)), reverse=True):
        choice: dict[int, int] = {}
        for r in range(ctx.world):
            j = next((j for j in range(len(ranked)) if step in got[j][r]), None)
            if j is None:
                break
            choice[r] = j
        else:
            best = RestorePlan(
                step,
                {r: ranked[j][1].name for r, j in choice.items()},
                tier=max(ranked[j][0] for j in choice.values()),
            )
            break
    for i, s in enumerate(sources):
        if not s.whole_world:
            continue

        def wanted(step: int, i: int = i, best: RestorePlan | None = best) -> bool:
            return best is None or step > best.step or (step == best.step and i < best.tier)

        steps = [x for x in s.offer(excluded, wanted) if x not in excluded]
        if steps and wanted(max(steps)):
            best = RestorePlan(max(steps), dict.fromkeys(range(ctx.world), s.name), tier=i)
    return best


class Restorer:
    """Runs the restore pipeline on entry (collective: every rank of the world runs it)."""

    def __init__(self, env: RestoreEnv, applier: Applier) -> None:
        self.env = env
        self.applier = applier
        self.step: int | None = None
        """The restored step (None: nothing restored)."""
        self.source: str | None = None
        """Where it came from (``restored_from``)."""
        self.seconds: float | None = None
        """How long the restore took (or looking for something to restore)."""
        self.info: dict[str, Any] = {}
        """Details of the restore for ``status()``."""

    def run(self) -> None:
        t0 = time.perf_counter()
        env, ctx = self.env, self.env.ctx
        sources: list[RestoreSource] = [make(env) for make in SOURCES]
        by_name = {s.name: s for s in sources}
        excluded: set[int] = set()
        while True:
            plan = agree(env, sources, excluded)
            if plan is None:
                if env.mem or env.stored - excluded:
                    warnings.warn(
                        f"flashckpt: rank {ctx.rank} holds steps {sorted(env.mem)} in memory and "
                        f"{sorted(env.stored)} in storage, but no step can be obtained by every "
                        "rank; nothing restored",
                        stacklevel=3,
                    )
                # Collective (every rank finds no plan): a replacement machine (restart count 0)
                # says it too, where a survivor of the same failure restarted.
                restarts = ctx.all_max(_restart_count())
                if restarts > 0:
                    # The advice fits what the job has: "give it storage=" to a job that gave
                    # it sent users after a setting they had (issue 41).
                    fix = (
                        f"its storage {env.storage.url!r} holds no committed step every rank "
                        "can read (the run before ended before its first commit, or storage "
                        "failed: see the errors above)"
                        if env.storage is not None
                        else "give the job storage= (or keep replicas on, more than one "
                        "machine) to resume after a failure"
                    )
                    warnings.warn(
                        f"flashckpt: rank {ctx.rank} starts from step 0 on restart {restarts} of "
                        "the job: no step of the run before is in every rank's reach (own "
                        f"memory, a peer's replica, storage), so its work is lost; {fix}",
                        stacklevel=3,
                    )
                for path, why, was in getattr(by_name.get("memory"), "discarded", []):
                    log.warning(
                        "flashckpt: rank %d restored nothing and starts from step 0: %s was "
                        "discarded (%s) and no other source holds a step every rank can have",
                        ctx.rank,
                        discarded_name(path, was),
                        why,
                    )
                self.applier.invalidate_after(env.snap, -1)
                self.seconds = time.perf_counter() - t0
                return
            step = plan.step
            reader = by_name[plan.sources[ctx.rank]]
            self.info = {}
            code, memory_only = 0, False
            err: Exception | None = None
            saved: SavedStep | None = None
            state: dict[str, Any] | None = None
            try:
                _prepare(sources, plan)
                saved = reader.read(plan)
                state = self._fit(saved)
                self.info = dict(saved.info)
            except BadMemory as e:
                # Only this copy is bad: the step may still come from storage (or a replica).
                code, err = 1, e
                reader.drop(step)
                memory_only = True
                warnings.warn(f"flashckpt: {e}; trying another source", stacklevel=3)
            except (CorruptCheckpointError, FileNotFoundError, TornSnapshot) as e:
                code, err = 1, e
                warnings.warn(
                    f"flashckpt: cannot restore step {step}: {e}; trying an older step",
                    stacklevel=3,
                )
            except Exception as e:  # every rank takes part in the all-reduce below, then raises
                code, err = 2, e
            worst = ctx.all_max(code)
            if worst == 0:
                assert saved is not None and state is not None
                self.applier.apply(state, saved.private, saved.shared)
                self.step, self.source = step, saved.source
                self.seconds = time.perf_counter() - t0
                self.info.update(step=step, source=self.source, seconds=self.seconds)
                self.applier.invalidate_after(env.snap, step)
                for path, why, was in getattr(by_name.get("memory"), "discarded", []):
                    log.warning(
                        "flashckpt: rank %d restored step %d from %s: %s was discarded (%s)",
                        ctx.rank,
                        step,
                        self.source,
                        discarded_name(path, was),
                        why,
                    )
                return
            if worst == 2:
                raise _failed(ctx, step, err if code == 2 else None, _start_over(env))
            # Every rank takes part: the step is excluded unless each failure was a bad copy in
            # memory (those ranks dropped it from their memory steps and plan again).
            if ctx.all_max(0 if code == 0 or memory_only else 1):
                excluded.add(step)

    def _fit(self, saved: SavedStep) -> dict[str, Any]:
        """Fits a saved step to this run's layout and checks it against the model."""
        state = self.env.resharder.resolve_sharded(
            saved.step, saved.state, saved.manifest, saved.pieces
        )
        self.applier.check_model(state)
        why = saved.check() if saved.check is not None else None
        if why is not None:
            raise TornSnapshot(why)
        if saved.note:
            log.info("%s", saved.note)
        return state


ERROR_TEXT_BYTES = 4096
"""The most bytes of one rank's error text the other ranks are told (on a failed restore)."""


def _start_over(env: RestoreEnv) -> str:
    """How this run starts from scratch instead, in words that work: ``restore=False`` alone is
    refused where a storage root holds committed steps of the earlier run (issue 41: the advice
    led to a second refusal), so it names ``overwrite=True`` and what that deletes there."""
    held = []
    if env.storage is not None and env.stored:
        held.append(f"{sorted(env.stored)} of storage {env.storage.url}")
    if env.agent_root is not None and env.agent_root[1]:
        url, steps = env.agent_root
        held.append(f"{sorted(steps)} of the node agent's storage {url}")
    if not held:
        return "pass restore=False to start from scratch"
    return (
        "pass restore=False, overwrite=True to start from scratch (overwrite=True deletes the "
        f"committed steps {' and '.join(held)}), or give this run a new storage root"
    )


def _failed(ctx: RankContext, step: int, err: Exception | None, start_over: str) -> RestoreError:
    """The error every rank raises where some rank's restore of ``step`` failed for good
    (collective): each rank tells the others its error text (empty: it did not fail), so each
    raises one naming every failed rank; a failed rank's own text is whole, and it is raised
    from its own error."""
    own = f"{type(err).__name__}: {err}" if err is not None else ""
    texts = ctx.gather_texts(own, ERROR_TEXT_BYTES)
    failures = {r: t for r, t in enumerate(texts) if t}
    if err is not None:
        failures[ctx.rank] = own
    error = RestoreError(step, failures, start_over=start_over)
    error.__cause__ = err
    return error


def _restart_count() -> int:
    """How often the launcher restarted this rank's worker group (``$TORCHELASTIC_RESTART_COUNT``;
    0 when not under a launcher or for a machine that joined since)."""
    raw = os.environ.get(RESTARTS_ENV, "0")
    return int(raw) if raw.isdigit() else 0


def _prepare(sources: list[RestoreSource], plan: RestorePlan) -> None:
    """Every source prepares the plan (each takes part in its own exchanges even where an
    earlier one failed, so no peer waits); the first failure is raised after all."""
    first: Exception | None = None
    for s in sources:
        try:
            s.prepare(plan)
        except Exception as e:  # raised once every source took part
            first = first or e
    if first is not None:
        raise first
