"""The trainer side: snapshot a rank's state into its shared-memory slots, restore it on start.

Usage::

    with flashckpt.checkpointing(model, optimizer, scheduler=sched,
                                 storage="file:///ckpt/run1", every=10) as ckpt:
        for i in range(ckpt.start_step, total_steps):
            train_one_step(i)
            ckpt.step()              # one more step done; snapshots after 10, 20, ... steps

The library owns the step count: every number it shows or takes (``ckpt.step(n)``, snapshot
labels, ``start_step``, ``save()``, ``every``, storage step names) is a number of steps
*completed*, the ecosystem's ``global_step``. ``start_step`` is then also the 0-based index of the
next iteration. ``ckpt.step(n)`` checks ``n`` against the count and raises on a mismatch.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import operator
import os
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch

from flashckpt import envnames, names
from flashckpt.errors import PersistError
from flashckpt.format.storage import MANIFEST, Storage
from flashckpt.monitor.ring import StepRecorder, open_recorder, pid_namespace
from flashckpt.protocol.channel import AgentError
from flashckpt.protocol.messages import Done, Hello
from flashckpt.state.rng import capture_rng
from flashckpt.trainer.config import (
    COPY_MODES,
    CheckpointConfig,
    Stats,
    check_scheduler_given,
    parse_mirror_every,
    parse_persist_every,
    resolve_copy_mode,
    resolve_prefault,
    unknown_options,
)
from flashckpt.trainer.interval import AutoInterval
from flashckpt.trainer.link import AgentLink
from flashckpt.trainer.rankctx import RankContext
from flashckpt.trainer.restore.apply import Applier
from flashckpt.trainer.restore.pipeline import Restorer
from flashckpt.trainer.restore.reshard import Resharder
from flashckpt.trainer.restore.saved import RestoreEnv
from flashckpt.trainer.snapshot import SnapshotHandle, Snapshotter
from flashckpt.trainer.storageroot import (
    AgentRoot,
    check_agent_root,
    check_owner,
    probe_storage,
    start_fresh,
    start_fresh_agent,
)

__all__ = ["CheckpointConfig", "Checkpointer", "SnapshotHandle", "Stats", "checkpointing"]

log = logging.getLogger("flashckpt")


def _check_arguments(
    model: Any,
    optimizer: Any,
    scheduler: Any,
    stateful: Mapping[str, Any] | None,
    per_rank: Mapping[str, Any] | None,
    extras: Any,
    config: CheckpointConfig,
) -> None:
    """The checks of :class:`Checkpointer`'s arguments, each naming the argument at fault."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
    for what, objs in (("stateful", stateful), ("per_rank", per_rank)):
        for name, obj in (objs or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{what}[{name!r}] has no state_dict()/load_state_dict()")
    both = sorted(set(stateful or {}) & set(per_rank or {}))
    if both:
        raise ValueError(f"{both} given in both stateful= and per_rank=: pick one")
    if extras is not None and not isinstance(extras, dict):
        raise TypeError(f"extras must be a dict of JSON-serialisable values, got {type(extras)}")
    if scheduler is not None and not hasattr(scheduler, "state_dict"):
        raise TypeError("scheduler has no state_dict()/load_state_dict()")
    if optimizer is not None and scheduler is None and not config.allow_unsaved_scheduler:
        check_scheduler_given(optimizer, {**(stateful or {}), **(per_rank or {})})


class Checkpointer:
    """Flash checkpointing of one rank's training state. Use through :func:`checkpointing`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scheduler: Any = None,
        stateful: Mapping[str, Any] | None = None,
        per_rank: Mapping[str, Any] | None = None,
        extras: dict[str, Any] | None = None,
        process_group: Any = None,
        config: CheckpointConfig,
    ) -> None:
        _check_arguments(model, optimizer, scheduler, stateful, per_rank, extras, config)
        _warn_unfixed_ddp(model)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.stateful = dict(stateful or {})
        self.per_rank = dict(per_rank or {})
        self.extras: dict[str, Any] = extras if extras is not None else {}
        # A copy: entry resolves replicated=None in it (a config may serve several models).
        self.config = copy.copy(config)
        self.stats = Stats()
        self.start_step = 0
        """Steps completed when the ``with`` block was entered (the restored step; 0 on a fresh
        start), which is also the 0-based index of the next iteration."""
        self.restored_from: str | None = None
        """Where the restored state came from: ``memory``, ``storage``, ``mirror`` (the remote
        tier, ``mirror=``), ``replica`` (a data-parallel peer's memory), ``peer-memory`` (a
        replica of this rank's snapshot that another machine's agent held, pulled into this
        rank's slot), ``memory-reshard`` (a sharded state rebuilt from the pieces this world's
        ranks hold in memory) or ``peer-reshard`` (the same, with pieces from the replicas the
        agents hold of lost machines' snapshots); None when nothing was restored."""
        self._pg = process_group
        self._storage = Storage(config.storage) if config.storage else None
        self._agent_root: AgentRoot | None = None  # the agent's own root (no storage= here)
        self._hooks: list[Any] = []
        self._count = 0  # steps completed (the library's step count)
        # Optimizer steps taken inside the block, per optimizer given (see _uncounted_steps).
        self._opt_steps: dict[int, int] = {}
        self._uncounted_warned = False
        self._last_saved_step: int | None = None
        # persist_every over save() calls, mirror_every over the snapshots marked for storage
        # (both parsed once; the config checked them); the same calls on every rank.
        self._persist_cadence = _Cadence(*parse_persist_every(self.config.persist_every))
        self._mirror_cadence = _Cadence(*parse_mirror_every(self.config.mirror_every))
        # The carried mark (see _persist_due): the newest step marked for storage that this
        # rank has not heard its node agent persist (None: none owed), whether that mark was
        # for the mirror too, and whether the ranks last agreed that some rank still waits to
        # hear (the same on every rank: it says when the count form asks the others).
        self._owed: int | None = None
        self._owed_mirror = False
        self._outstanding = False
        # The exit's final snapshot: marked for both tiers whatever the cadences, without a
        # collective (the exit's flush persists it anyway, and a rank whose last snapshot was
        # skipped takes this one where the others do not: an all-reduce here could hang).
        self._mirror_final = False
        self._carried = False  # this save's mark carries a lost one forward (_persist_due)
        self._inherit_mirror = False  # ... and with it the lost mark's mirror mark
        self._entered = False
        self._rank_lock: _RankLock | None = None
        self._mon: StepRecorder | None = None
        self._auto: AutoInterval | None = None
        self._restore_s: float | None = None
        self._phase_t = 0.0  # perf_counter() at the end of the previous entry phase
        self._restore_info: dict[str, Any] = {}
        self._timeline_start = -1  # the step this run resumed at; -1: started from scratch
        self._wire()

    def _wire(self) -> None:
        """The collaborators, one job each; the methods below guard, then delegate to them."""
        cfg = self.config
        self._ctx = RankContext()
        self._snap = Snapshotter(
            self.model,
            self.optimizer,
            scheduler=self.scheduler,
            stateful=self.stateful,
            config=cfg,
            ctx=self._ctx,
            link=None,  # type: ignore[arg-type]  # set just below (they know each other)
            stats=self.stats,
        )
        self._link = AgentLink(
            cfg,
            self._ctx,
            self.stats,
            adopt_slots=self._snap.adopt_hello_slots,
            timeline_start=lambda: self._timeline_start,
        )
        self._snap.link = self._link
        self._applier = Applier(
            self.model,
            self.optimizer,
            scheduler=self.scheduler,
            stateful=self.stateful,
            per_rank=self.per_rank,
            extras=self.extras,
            ctx=self._ctx,
            registrar=self._snap.registrar,
        )
        self._resharder = Resharder(
            self.model,
            self.optimizer,
            config=cfg,
            ctx=self._ctx,
            storage=self._storage,
            hooks=self._hooks,
        )
        self._restorer = Restorer(
            RestoreEnv(
                model=self.model,
                config=cfg,
                ctx=self._ctx,
                storage=self._storage,
                snap=self._snap,
                resharder=self._resharder,
            ),
            self._applier,
        )

    @property
    def job(self) -> str:
        """The job id (names the segments and the agent); set on entry."""
        return self._ctx.job

    @property
    def node(self) -> str:
        """The node id; set on entry."""
        return self._ctx.node

    @property
    def agent_restarts(self) -> int:
        """Times this rank lost its node agent and found (or started) another one."""
        return self._link.restarts

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        enter_wall = time.time()
        self.stats.entry_phases_s = {}
        self._phase_t = time.perf_counter()
        try:
            self._setup()
        except BaseException:
            self._link.close(done=False)  # refused at entry (e.g. its agent's root): let go
            if self._rank_lock is not None:
                self._rank_lock.release()
                self._rank_lock = None
            raise
        ctx = self._ctx
        shm_dir = self._snap.shm_dir
        if shm_dir and ctx.run_dir:
            self._mon = open_recorder(
                shm_dir=shm_dir,
                run_dir=ctx.run_dir,
                job=ctx.job,
                node=ctx.node,
                rank=ctx.rank,
                world=ctx.world,
                enter_wall=enter_wall,
            )
        try:
            self._entry_phase("hello")
            if self.config.restore:
                restorer = self._restorer
                restorer.run()
                self._restore_s, self._restore_info = restorer.seconds, restorer.info
                if restorer.step is not None:
                    self.start_step = self._last_saved_step = restorer.step
                    self.restored_from = restorer.source
            else:
                # Refused (storage holds steps, no overwrite=True) before memory is touched.
                self._start_fresh()
                # A past timeline's snapshots must never be resumed from after this run's start.
                self._applier.invalidate_after(self._snap, -1)
            self._entry_phase("restore")
            if self.restored_from is None and self.config.restore:
                self._start_fresh()
            self._count = self.start_step
            self._timeline_start = self.start_step if self.restored_from else -1
            # Tells the node agent where this run's timeline starts (-1: from scratch): a
            # committed step after it is not this run's, so it is neither taken as already
            # persisted nor reported by flush(). An agent that dies meanwhile is told again
            # by the next one's link (relink), so its loss costs no entry.
            self._link.restored(self._timeline_start)
            if self._mon is not None:  # before the optimizer hook below: it times its wait
                self._hooks.extend(self._mon.attach(self.model, self.optimizer))
            self._hook_optimizer()
            self._snap.executor = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-copy")
            self._entry_phase("timeline")
            # A resume: the first step comes first. The slots it has (those just restored
            # from) get their pages beside it; the ones it lacks (a machine that took its
            # snapshot from a peer or storage) are checked for room now and allocated by a
            # thread the first snapshot waits for.
            resume = self.restored_from is not None
            if not resume:
                self._snap.preallocate()
                self._entry_phase("preallocate")
            self._prefault()
            self._entry_phase("prefault")
            if resume:
                self._snap.preallocate(background=True)
                self._entry_phase("preallocate")
        except BaseException:
            self._teardown()
            raise
        self._entered = True
        if self._mon is not None:
            self._mon.ready(self.start_step, self.restored_from)
        self._log_entry()
        return self

    def _start_fresh(self) -> None:
        """A run from step 0: refused over committed steps of storage (``storage=``, else the
        node agent's own root), unless ``overwrite=True``, which deletes them."""
        start_fresh(self._storage, self._ctx, self.config)
        start_fresh_agent(self._agent_root, self._link, self._ctx, self.config)

    def _entry_phase(self, name: str) -> None:
        """Records the seconds since the previous phase of the entry (``stats.entry_phases_s``)."""
        now = time.perf_counter()
        self.stats.entry_phases_s[name] = now - self._phase_t
        self._phase_t = now

    def _prefault(self) -> None:
        """Populates the slots' pages: waits for them here, or leaves a thread at it
        (``config.prefault``, resolved as :func:`resolve_prefault` says)."""
        devices = {p.device.type for p in self.model.parameters()}
        if self.optimizer is not None:
            devices |= {
                v.device.type
                for st in self.optimizer.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor)
            }
        how, why = resolve_prefault(self.config.prefault, devices, self.restored_from is not None)
        self.stats.prefault, self.stats.prefault_reason = how, why
        thread = self._snap.prefault_all()
        if thread is not None and how == "entry":
            t0 = time.perf_counter()
            thread.join()
            self.stats.prefault_wait_s = time.perf_counter() - t0

    def _log_entry(self) -> None:
        if self.restored_from is not None:
            log.info(
                "flashckpt: rank %d restored step %d from %s in %.2f s",
                self._ctx.rank,
                self.start_step,
                self.restored_from,
                self._restore_s or 0.0,
            )
        else:
            log.info(
                "flashckpt: rank %d starts at step 0: %s",
                self._ctx.rank,
                "restore=False"
                if not self.config.restore
                else f"nothing to restore (looked for {self._restore_s or 0.0:.2f} s)",
            )

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._mon is not None:
            self._mon.finishing()
        lost: PersistError | None = None
        try:
            if exc_type is None:
                self.wait()
                self._check_counted("exit")
                if self._count == self.start_step and self._optimizer_steps() > 0:
                    # ckpt.step() was never called, yet the optimizer stepped: the state held
                    # is that many steps past the start; it is snapshotted and committed under
                    # that count (the warning above said so) rather than dropped.
                    self._count = self.start_step + self._optimizer_steps()
                count = self._count
                if count > self.start_step and (
                    self._last_saved_step is None or self._last_saved_step < count
                ):
                    self._mirror_final = True  # the last step goes to the remote tier too
                    self.save(mode="sync", when_busy="wait")
                lost = self._lost_work(self.flush())
                if lost is None:
                    lost = self._lost_mirror()
            else:
                with contextlib.suppress(Exception):
                    self.wait()
        finally:
            self._teardown(done=exc_type is None)
        if lost is not None:
            if self.config.on_persist_failure == "raise":
                raise lost
            log.error("flashckpt: %s", lost)
            warnings.warn(f"flashckpt: {lost}", stacklevel=2)

    def _storage_url(self) -> str | None:
        """The storage the node agent persists to: ``storage=``, else the launcher's
        (``flashckpt run --storage``, in ``$FLASHCKPT_STORAGE``: its agent persists there even
        when the script passes no ``storage=``, and a final persist that failed there must fail
        the run as loudly), else the agent's own (``flashckpt agent --storage``, as its hello
        reply named it: the exit waits for its commit there too)."""
        if self._storage is not None:
            return self._storage.url
        launcher = envnames.get(envnames.STORAGE)
        if launcher is None and self._agent_root is not None:
            return self._agent_root.url
        return launcher

    def _lost_work(self, committed: int | None) -> PersistError | None:
        """The error to raise on exit when the newest snapshot is not committed, else None."""
        step = self.stats.last_snapshot_step
        url = self._storage_url()
        if url is None or step is None or (committed is not None and committed >= step):
            return None
        # The storage tier's errors (the mirror's are _lost_mirror's).
        errors = [
            e
            for e in list(self.stats.persist_errors)
            if not str(e.get("error", "")).startswith("mirror ")
        ]
        if self._storage is None and not errors:
            return None  # the launcher's agent has no storage (flush said so): nothing lost
        why = f": {errors[-1]['error']}" if errors else ""
        durable = self.stats.last_committed_step
        if self._storage is not None:
            tier = f"storage {url}"
        elif envnames.get(envnames.STORAGE) is None:
            tier = f"storage {url} (the node agent's own --storage)"
        else:
            tier = f"storage {url} (the launcher's --storage, ${envnames.STORAGE})"
        return PersistError(
            f"step {step} (the final snapshot) was not committed to {tier}{why}. It is in this "
            f"machine's shared memory only (the node "
            f"agent keeps retrying while it runs); the newest committed step is "
            f"{'none' if durable is None else durable}. Fix the storage and run again to resume, "
            "or pass on_persist_failure='warn' to exit normally anyway",
            step=step,
            errors=errors,
        )

    def _lost_mirror(self) -> PersistError | None:
        """The error to raise on exit when the remote tier (``mirror=``) failed during the run
        and the final step never reached it, else None.

        The mirror is copied by the node agent in the background, from the committed storage
        step, and its errors reach ``stats.persist_errors`` (``"mirror <url>: ..."``). When
        none came, the exit does not wait for the mirror (a healthy remote upload may take
        minutes; the agent mirrors the final step once every rank said done, and its stop
        retries it for ``commit_timeout``, exiting with code 5 if it never gets there). When
        the mirror did fail during the run, the exit tells the agent this rank is done (so it
        sends the final step to the mirror) and waits, up to ``flush_timeout``, for the final
        step to be committed in the mirror root or for the mirror's error on it: a mirror that
        fails is as loud as the storage tier, the run's exit fails.
        """
        url = self.config.mirror
        step = self.stats.last_snapshot_step
        if url is None or step is None or not self._mirror_errors(None):
            return None
        mirror = Storage(url)
        link = self._link
        if link.client is not None and link.alive():
            with contextlib.suppress(AgentError):  # the agent mirrors the last step once all did
                link.client.call(
                    Done(rank=self._ctx.rank, local_rank=self._ctx.local_rank), timeout=10
                )
        deadline = time.monotonic() + self.config.flush_timeout
        if self._mon is not None:
            self._mon.pause()  # waiting for the mirror is no hang
        try:
            while True:
                with contextlib.suppress(OSError):
                    if mirror.fs.exists(mirror.step_path(step, MANIFEST)):
                        return None
                failed = self._mirror_errors(step)
                if failed or not link.alive() or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
        finally:
            if self._mon is not None:
                self._mon.resume()
        errors = self._mirror_errors(None)
        why = (
            f"the mirror's error: {errors[-1]['error']}"
            if failed
            else "the node agent went away"
            if not link.alive()
            else f"not there within {self.config.flush_timeout:g} s (flush_timeout)"
        )
        durable = self.stats.last_committed_step
        return PersistError(
            f"step {step} (the final snapshot) did not reach the mirror {url} ({why}). It is "
            f"committed in storage {self._storage_url()} (newest committed step "
            f"{'none' if durable is None else durable}), so a rerun resumes from it; the "
            f"node agent tries the mirror copy again at its stop for up to its commit_timeout "
            "(exit code 5 if it never gets there). Fix the mirror (space, permissions, "
            "credentials) or pass mirror=None; on_persist_failure='warn' exits normally anyway",
            step=step,
            errors=errors,
        )

    def _mirror_errors(self, step: int | None) -> list[dict[str, Any]]:
        """The mirror errors the agent reported (``"mirror <url>: ..."``); with ``step``, only
        those of that step or a newer one (or of no step)."""
        return [
            e
            for e in list(self.stats.persist_errors)
            if str(e.get("error", "")).startswith("mirror ")
            and (step is None or e.get("step") is None or e["step"] >= step)
        ]

    # -- public API --------------------------------------------------------------------------
    @property
    def steps_done(self) -> int:
        """Steps completed so far: ``start_step`` plus the ``step()`` calls of this run."""
        return self._count

    def step(self, n: int | None = None) -> SnapshotHandle | None:
        """Marks one more training step done; snapshots when due (see ``every``).

        Call it once per training step (per optimizer step under gradient accumulation), at
        its end. The snapshot it takes is labelled with the number of steps done.

        Args:
            n: optional, the number of steps completed so far (a 1-based ``global_step``): it
                must be the library's count plus one. Checked so that a 0-based iteration index
                or a skipped step raises instead of labelling snapshots off by one.

        Returns:
            The snapshot's handle when one was taken, else None.

        Raises:
            ValueError: ``n`` is not the library's count plus one.
        """
        if not self._entered:
            raise RuntimeError("step() outside the `with flashckpt.checkpointing(...)` block")
        done = self._count + 1
        if n is not None and n != done:
            self._bad_step(n, done)
        self._count = done
        every = self.config.every
        if every == "auto":
            handle = self._auto_step(done)
        else:
            handle = self.save() if every and done % every == 0 else None
        if self._mon is not None:
            self._mon.step(done - 1)  # the monitor records the 0-based iteration index
        return handle

    def _bad_step(self, n: Any, done: int) -> None:
        try:
            k = operator.index(n)
        except TypeError:
            raise TypeError(
                f"ckpt.step({n!r}): pass the number of steps completed (an int), or nothing"
            ) from None
        if k == done:
            return
        count = self._count
        conventions = (
            "flashckpt counts steps completed: ckpt.step() with no argument marks one more "
            "step done, and ckpt.step(n) takes the number of steps completed so far (the "
            "1-based global_step of torchtitan, Lightning and Hugging Face), not the 0-based "
            "index of the iteration just finished. Fix: call ckpt.step() at the end of every "
            "iteration, or ckpt.step(i + 1) at the end of iteration i (ckpt.start_step is the "
            "index of the next iteration)"
        )
        if k == count and count == self.start_step:
            raise ValueError(
                f"ckpt.step({k}) looks like a 0-based iteration index: {count} steps were "
                f"already done before it (ckpt.start_step={self.start_step}), so this call "
                f"would mark step {done} done. {conventions}"
            )
        if k <= count:
            raise ValueError(
                f"ckpt.step({k}) after {count} steps done: the count must grow by one per "
                f"call, this one would be step {done}. {conventions}"
            )
        raise ValueError(
            f"ckpt.step({k}) after {count} steps done skips {k - done} step(s): a snapshot "
            f"would carry a count no run reached and a resume would start at the wrong "
            f"iteration. Call ckpt.step() once per training step (once per optimizer step "
            f"under gradient accumulation); a loop with a step counter of its own starts it at "
            f"ckpt.start_step. {conventions}"
        )

    def _persist_due(self) -> bool:
        """Whether this snapshot is marked for storage (``persist_every``), on every rank alike.

        Every rank calls ``save()`` at the same steps, so the count form agrees without
        talking; the time form takes the ranks' OR (a rank whose clock says "due" decides for
        all). A mark also carries forward: when the last marked snapshot is lost on some rank
        before its node agent began persisting it (a newer snapshot replaces it in the slot,
        or it was skipped), this snapshot is marked in its place, on every rank (the ranks' OR
        again: a commit needs every rank's shard of one step), so storage does not wait for
        the next mark. The ranks' word on the carried mark rides the time form's all-reduce;
        the count form asks only while some rank has not yet heard its agent persist the last
        mark (no collective at all while nothing is owed).
        """
        cadence = self._persist_cadence
        if self._storage is None or cadence.every_n == 1:
            verdict = cadence.decide(self._ctx, None)  # nothing to carry forward
        else:
            verdict = cadence.decide(self._ctx, self._mark_code if self._outstanding else None)
        due = verdict >= _LOST
        self._carried = verdict == _LOST
        # The last mark's mirror mark goes with this one while the ranks last agreed it is
        # still owed (a carried mark replaces it; a new one may come before it is persisted).
        self._inherit_mirror = self._outstanding and self._owed_mirror
        if due:
            self.stats.persist_marked += 1
            if self._carried:
                self.stats.persist_carried += 1
            self._owed = self._count
            self._outstanding = self._storage is not None and cadence.every_n != 1
        else:
            self._outstanding = verdict == _PENDING
        return due

    def _mark_code(self) -> int:
        """This rank's word on the last mark (``_owed``): ``_NONE`` when its node agent
        persisted it or a newer step (or storage committed one), ``_PENDING`` while it is
        still in memory for the agent (the newest snapshot, or the agent reads it now),
        ``_LOST`` when the snapshot about to be taken replaces it before the agent began on
        it (or it is gone already: replaced, skipped, its slot reallocated)."""
        owed = self._owed
        if owed is None:
            return _NONE
        s = self.stats
        heard = max(
            s.last_persisted_step if s.last_persisted_step is not None else -1,
            s.last_committed_step if s.last_committed_step is not None else -1,
        )
        if heard >= owed:
            self._owed = None
            return _NONE
        if owed == self._last_saved_step:
            return _PENDING  # the newest snapshot: this one goes to the other slot
        alive = self._link.alive()  # a dead agent's pin means nothing (the trainer ignores it)
        writing = s.persisting_step
        if alive and writing is not None and writing >= owed:
            # The agent writes it (or a newer step) now, from a copy once slow storage made it
            # let the slot go: passing the mark on would start the next persist as soon as
            # this one ends, one after another, whatever persist_every says (issue 30).
            return _PENDING
        for sm in self._snap.slots:
            if sm is not None and sm.step == owed:
                return _PENDING if alive and sm.slot.pinned() else _LOST
        return _LOST

    def _mirror_due(self, persist: bool) -> bool:
        """Whether this snapshot is marked for the remote tier too (``mirror_every``, counted
        over the snapshots marked for storage; the exit's final snapshot always is). Called on
        every rank with the same ``persist``, so the time form's all-reduce is collective. A
        mark carried forward (see :meth:`_persist_due`) keeps the lost mark's mirror mark and
        is not counted by ``mirror_every`` (it replaces a snapshot that was); a new mark made
        while the last one is still owed keeps its mirror mark too."""
        if self.config.mirror is None:
            return False
        if self._mirror_final:
            return True
        if not persist:
            return False
        if self._carried:
            return self._inherit_mirror
        return self._mirror_cadence.due(self._ctx) or self._inherit_mirror

    def _auto_step(self, done: int) -> SnapshotHandle | None:
        auto = self._auto
        if auto is None:
            auto = self._auto = AutoInterval(
                world=self._ctx.world, mtbf_s=self.config.mtbf_s, start_step=self.start_step
            )
        auto.tick()
        if not auto.due(done):
            return None
        handle = self.save()
        # Every rank reaches this step: they agree on the next interval (the smallest).
        auto.decide(done, self.stats.stall_s, self.stats.wait_s, lambda n: -self._ctx.all_max(-n))
        return handle

    def save(
        self,
        step: int | None = None,
        *,
        mode: Literal["auto", "overlap", "sync"] | None = None,
        when_busy: Literal["wait", "skip"] | None = None,
    ) -> SnapshotHandle:
        """Snapshots the state into shared memory now, labelled with the steps done.

        Returns at once in overlap mode (the bulk copy runs in the background and the optimizer's
        next ``step()`` waits for it). Never mutates the caller's state and never pickles. The
        configured ``mode="auto"`` is resolved at the first save, from the devices of the
        state's tensors, and kept (``stats.copy_mode``).

        Args:
            step: optional, the label; it must equal the steps done (``steps_done``): a
                snapshot's label is what a resume starts at, so it is never set apart from the
                count.
            mode: overrides the configured ``mode`` for this snapshot (``"auto"``: the mode
                the configured one resolved to).
            when_busy: overrides the configured ``when_busy`` for this snapshot.

        Raises:
            ValueError: ``step`` differs from the steps done, or ``mode``/``when_busy`` is
                not one of the values they take.
        """
        if not self._entered:
            raise RuntimeError("save() outside the `with flashckpt.checkpointing(...)` block")
        if step is not None and step != self._count:
            raise ValueError(
                f"save(step={step!r}): {self._count} steps are done (ckpt.step() counts them) "
                f"and a snapshot is labelled with the steps done, the step a resume starts at. "
                "Call save() with no step, or mark the steps done first with ckpt.step() once "
                "per training step"
            )
        if mode is not None and mode not in COPY_MODES:
            raise ValueError(f"save(mode={mode!r}): use 'auto', 'overlap' or 'sync'")
        if when_busy is not None and when_busy not in ("wait", "skip"):
            raise ValueError(f"save(when_busy={when_busy!r}): use 'wait' or 'skip'")
        if not self._mirror_final:
            self._check_counted("save")
        step = self._count
        when_busy = when_busy or self.config.when_busy
        t0 = time.perf_counter()
        snap = self._snap
        flat, async_ptrs, model_sd = snap.collect()
        if self.stats.copy_mode is None:
            self._resolve_copy_mode(flat.tensors)
        copy_mode = self.stats.copy_mode if mode is None or mode == "auto" else mode
        assert copy_mode is not None
        per_rank = self._applier.per_rank_state()  # first: a loader's may draw from the RNGs
        meta_extra = {
            "step": step,
            "private": {
                "rng": capture_rng(),
                "extras": _json_copy(self.extras, "extras"),
                "buffers_xxh": snap.buffers_hash(model_sd),
                **per_rank,
            },
            "persist": (persist := self._mirror_final or self._persist_due()),
        }
        mirror = self._mirror_due(persist)
        if persist:
            self._owed_mirror = mirror  # the same on every rank, like both marks
        if mirror:
            meta_extra["mirror"] = self.config.mirror
            self.stats.mirror_marked += 1
        if not self._link.alive():
            self._link.relink()  # the agent died: find (or start) another; never waits
        handle = snap.write(step, flat, async_ptrs, meta_extra, copy_mode, when_busy)
        if handle.skipped is not None:
            self.stats.skips += 1
            self.stats.skipped_steps.append(step)
            warnings.warn(
                f"flashckpt: snapshot of step {step} skipped: {handle.skipped}"
                + (" (when_busy='skip')" if handle.skipped == "both slots busy" else ""),
                stacklevel=2,
            )
            return handle
        self._last_saved_step = step
        dt = time.perf_counter() - t0
        self.stats.saves += 1
        self.stats.stall_s.append(dt)
        if self.stats.first_save_s is None:
            self.stats.first_save_s = dt
        if self._mon is not None:
            self._mon.ckpt_stall(dt, snapshot=True)
        return handle

    def _resolve_copy_mode(self, tensors: list[torch.Tensor]) -> None:
        """Fixes the run's copy mode at the first save: ``mode="auto"`` follows the device of
        the state (the tensors this snapshot copies, a sharded state's local pieces)."""
        mode, why = resolve_copy_mode(self.config.mode, {t.device.type for t in tensors})
        self.stats.copy_mode, self.stats.copy_mode_reason = mode, why
        log.info("flashckpt: rank %d copies snapshots in %s mode (%s)", self._ctx.rank, mode, why)

    def wait(self) -> None:
        """Waits for the background copy of the last snapshot (and re-raises its failure)."""
        self._snap.wait()

    def flush(self, timeout: float | None = None) -> int | None:
        """Waits until the newest snapshot is committed to storage; returns the committed step.

        A storage failure does not raise here (training goes on from memory): it is logged and
        kept in ``stats.persist_errors``; the return value is then None. Leaving the ``with``
        block raises :class:`PersistError` when the final snapshot is not committed.
        """
        self.wait()
        step = self.stats.last_snapshot_step
        link = self._link
        if step is None or self._storage_url() is None or link.path is None:
            return None
        if not link.alive() and not link.relink(wait=True):
            log.error("flashckpt: step %d not persisted: no node agent", step)
            self.stats.persist_errors.append({"step": step, "error": "no node agent"})
            return None
        if self._mon is not None:
            self._mon.pause()  # waiting for storage is no hang
        try:
            for attempt in range(3):
                try:
                    committed = link.flush(step, timeout or self.config.flush_timeout)
                    break
                except AgentError as e:
                    # The agent died while persisting: its successor adopts the slots and
                    # persists the step; ask it.
                    if attempt < 2 and not link.alive() and link.relink(wait=True):
                        continue
                    if self._storage is None and str(e).startswith("no storage configured"):
                        return None  # $FLASHCKPT_STORAGE set, but this agent has none
                    log.error("flashckpt: step %d not persisted: %s", step, e)
                    self.stats.persist_errors.append({"step": step, "error": str(e)})
                    return None
        finally:
            if self._mon is not None:
                self._mon.resume()
        self.stats.last_committed_step = committed
        return self.stats.last_committed_step

    def status(self) -> dict[str, Any]:
        """The checkpointer's state: snapshots, commits, skips, errors, stalls, agent."""
        s = self.stats
        agent = self._link.status()
        return {
            "rank": self._ctx.rank,
            "world_size": self._ctx.world,
            "start_step": self.start_step,
            "steps_done": self._count,
            "restored_from": self.restored_from,
            "restore_s": self._restore_s,
            "restore": dict(self._restore_info),
            "saves": s.saves,
            "skips": s.skips,
            "skipped_steps": list(s.skipped_steps),
            "last_snapshot_step": s.last_snapshot_step,
            "last_committed_step": s.last_committed_step,
            "persist_errors": list(s.persist_errors),
            "first_save_s": s.first_save_s,
            "median_stall_s": _median(s.stall_s),
            "copy_mode": {
                "configured": self.config.mode,
                "resolved": s.copy_mode,
                "reason": s.copy_mode_reason,
            },
            "prefault": {
                "configured": self.config.prefault,
                "resolved": s.prefault,
                "reason": s.prefault_reason,
                "entry_wait_s": s.prefault_wait_s,
            },
            "entry": {
                "phases_s": dict(s.entry_phases_s),
                "total_s": sum(s.entry_phases_s.values()),
            },
            "every": self._auto.status()
            if self._auto is not None
            else {
                "mode": "auto" if self.config.every == "auto" else "steps",
                "interval_steps": self.config.every if self.config.every != "auto" else None,
            },
            "agent": agent,
        }

    # -- setup -------------------------------------------------------------------------------
    def _setup(self) -> None:
        cfg, ctx = self.config, self._ctx
        ctx.join(self._pg)
        if self._storage is not None:
            probe_storage(self._storage, ctx)
        if cfg.mirror is not None:
            probe_storage(Storage(cfg.mirror), ctx, what="mirror")
        ctx.name(job=cfg.job, node=cfg.node, run_dir=cfg.run_dir, storage=cfg.storage)
        assert ctx.socket is not None and ctx.run_dir is not None
        self._rank_lock = _RankLock.take(ctx.run_dir, ctx.job, ctx.node, ctx.rank)
        check_owner(self._storage, ctx, cfg)
        self._entry_phase("join")
        cfg.replicated, shard, num_shards, replica = ctx.shard_layout(
            self.model, self.optimizer, cfg.replicated
        )
        hello = self._link.hello(
            ctx.socket,
            ctx.run_dir,
            Hello(
                rank=ctx.rank,
                local_rank=ctx.local_rank,
                world_id=ctx.world_id,
                world_size=ctx.world,
                local_world_size=ctx.local_world,
                shard=shard,
                num_shards=num_shards,
                replica=replica,
                storage=cfg.storage,
                pid=os.getpid(),
            ),
        )
        # No storage= of its own: the root its agent persists to is checked (and claimed) here.
        self._agent_root = check_agent_root(hello, self._link, ctx, cfg)
        root = self._agent_root  # a failed restore's advice to start over names its steps
        self._restorer.env.agent_root = None if root is None else (root.url, list(root.steps))
        self._snap.shm_dir = hello.shm_dir
        self._snap.meta_static = {
            "job": ctx.job,
            "rank": ctx.rank,
            "world_id": ctx.world_id,
            "world_size": ctx.world,
            "local_world_size": ctx.local_world,
            "shard": shard,
            "num_shards": num_shards,
            "replica": replica,
        }
        self._snap.map_hello_slots(hello.slots)
        # A CUDA state: the slots are page-locked now, before a restore copies from them to
        # the GPU and before the first save() (which would otherwise pay the registration).
        self._snap.pin_for_cuda()

    def _hook_optimizer(self) -> None:
        if self.optimizer is not None:

            def pre_step(opt: Any, args: Any, kwargs: Any) -> None:
                t0 = time.perf_counter()
                self.wait()
                if self._mon is not None:
                    self._mon.ckpt_stall(time.perf_counter() - t0)

            self._hooks.append(self.optimizer.register_step_pre_hook(pre_step))
        # Every optimizer given (optimizer=, and any in stateful=/per_rank=) counts its steps,
        # so that a loop that steps them without ckpt.step() is told (_check_counted).
        opts = [self.optimizer, *self.stateful.values(), *self.per_rank.values()]
        seen: set[int] = set()
        for opt in opts:
            if not isinstance(opt, torch.optim.Optimizer) or id(opt) in seen:
                continue
            seen.add(id(opt))
            self._opt_steps[id(opt)] = 0

            def post_step(o: Any, args: Any, kwargs: Any, key: int = id(opt)) -> None:
                self._opt_steps[key] += 1
                self._check_counted("step")

            self._hooks.append(opt.register_step_post_hook(post_step))

    def _optimizer_steps(self) -> int:
        """Training steps the optimizers took inside the block: the most steps any one of them
        took (several optimizers each step once per training step; a step ``GradScaler``
        skipped for an inf/NaN gradient never calls ``step()`` and is not counted)."""
        return max(self._opt_steps.values(), default=0)

    def _check_counted(self, where: Literal["step", "save", "exit"]) -> None:
        """Warns (once) when the optimizers stepped more often than ``ckpt.step()`` was called:
        a loop that forgot ``ckpt.step()`` would otherwise train to the end with no snapshot and
        nothing in storage, silently.

        ``where="step"`` (an optimizer's step just ended) warns when a whole snapshot interval
        (``every``; 2 steps with ``every="auto"`` or 0) of optimizer steps went uncounted: the
        first point where a snapshot would have been due. ``ckpt.step()`` called before or after
        ``optimizer.step()`` in an iteration differs by one at most, gradient accumulation steps
        the optimizer once per ``ckpt.step()``, and ``GradScaler``'s skipped steps only lower the
        optimizer's count, so none of them warns. ``save()`` and the exit warn on any uncounted
        step (a snapshot is taken there).

        A warning, not an error: raising from inside ``optimizer.step()`` would end the run
        without its final snapshot (the exit's error path takes none), losing the very state
        this check protects; warned, the run goes on and the exit still snapshots and commits
        the state it holds (labelled with the optimizer's step count when ``ckpt.step()`` was
        never called).
        """
        if self._uncounted_warned or not self._opt_steps:
            return
        opt_steps = self._optimizer_steps()
        calls = self._count - self.start_step
        every = self.config.every
        interval = every if isinstance(every, int) and every > 0 else 0
        threshold = max(interval, 2) if where == "step" else 1
        if opt_steps - calls < threshold:
            return
        self._uncounted_warned = True
        due = (
            f"a snapshot was due every {interval} steps"
            if interval
            else "snapshots are due at the steps ckpt.step() counts"
        )
        msg = (
            f"flashckpt: the optimizer took {opt_steps} steps since entry but ckpt.step() was "
            f"called {calls} times: {due}, and no snapshot is taken for steps it does not "
            "count (nothing would reach memory or storage until the exit). Fix: call "
            "ckpt.step() once per optimizer step, at the end of each training iteration. "
            + (
                "The exit snapshots and commits the state held, labelled with the optimizer's "
                "step count."
                if calls == 0
                else "The exit snapshots the state held under ckpt.step()'s count."
            )
        )
        log.error("%s", msg)
        warnings.warn(msg, stacklevel=3)

    def _teardown(self, done: bool = False) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._snap.stop()
        if self._mon is not None:  # before "done": the agent may exit right after it
            self._mon.close(0 if done else 1)
            self._mon = None
        self._link.close(done=done)
        self._snap.unmap()
        self._entered = False
        if self._rank_lock is not None:
            self._rank_lock.release()
            self._rank_lock = None


_RANK_LOCK_FDS: set[int] = set()
"""The descriptors of this process's rank locks (a forked child closes its copies)."""

ORPHAN_WAIT_S = 30.0
"""How long a rank whose previous process is dead waits for that process's leftover children
(forked without Python's fork hooks) to let go of its lock before refusing."""


def _drop_inherited_rank_locks() -> None:
    # In a forked child (a data loader worker): its copy of the descriptor would keep this
    # rank's claim held after the trainer died, for as long as the child lives (an flock lives
    # while any descriptor of its open file description is open), and every restart of the
    # rank would be refused until then (issue 41).
    for fd in _RANK_LOCK_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _RANK_LOCK_FDS.clear()


os.register_at_fork(after_in_child=_drop_inherited_rank_locks)


class _RankLock:
    """This process's claim on a (job, node, rank): an ``flock`` on a pid file in the run
    directory, held while the checkpointer is entered. A second live process of the same job,
    node and rank would otherwise restore from the first one's live snapshot and then write the
    same slots and storage steps. The kernel drops the lock with its process (a ``kill -9``
    frees it for the next run); a forked child (a data loader worker) closes its copy of the
    descriptor at once, so a worker that outlives a killed trainer does not hold its claim."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @staticmethod
    def take(
        run_dir: str, job: str, node: str, rank: int, orphan_wait_s: float = ORPHAN_WAIT_S
    ) -> _RankLock:
        """Takes the claim; where the process the lock file names is dead but the lock is
        still held (by its leftover children), waits up to ``orphan_wait_s`` for them.

        Raises:
            RuntimeError: another live process holds the claim, or the dead one's leftovers
                hold it still after the wait, naming the pids and the fix."""
        import fcntl

        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        path = names.rank_lock_path(run_dir, job, node, rank)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        _RANK_LOCK_FDS.add(fd)  # before the lock: a fork from now on must not keep it
        waited_for: str | None = None
        deadline = time.monotonic() + orphan_wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = _lock_holder(fd)
                    if holder is None or not holder[1]:  # a live process (or unknown) has it
                        raise RuntimeError(
                            f"job {job!r} rank {rank} on node {node!r} is already running in "
                            f"process {holder[0] if holder else 'unknown'} (it holds {path}): "
                            "two processes of one job, node and rank would restore from and "
                            "write over each other's snapshots. Stop that process first, or "
                            f"give this run another job name (job= or ${envnames.JOB})"
                        ) from None
                    # Its process is dead: what holds the lock is a descendant that inherited
                    # the descriptor without Python's fork hooks; it may be on its way out.
                    late = time.monotonic() >= deadline
                    if waited_for is None or late:
                        others = _openers(path)  # a scan of /proc: at the start and the end
                    if waited_for is None:
                        waited_for = ", ".join(map(str, others)) or "unknown"
                        log.warning(
                            "flashckpt: rank %d's previous process %d is dead, but processes "
                            "it left behind (%s) still hold %s; waiting up to %g s for them "
                            "to exit",
                            rank,
                            holder[0],
                            waited_for,
                            path,
                            orphan_wait_s,
                        )
                    if late:
                        raise RuntimeError(
                            f"job {job!r} rank {rank} on node {node!r}: its previous process "
                            f"{holder[0]} is dead, but processes it left behind "
                            f"({', '.join(map(str, others)) or 'unknown'}: children that "
                            f"inherited its lock, such as data loader workers) still hold "
                            f"{path} after {orphan_wait_s:g} s. End them (kill "
                            f"{' '.join(map(str, others)) or '<pid>'}) and run again"
                        ) from None
                    time.sleep(0.1)
        except BaseException:
            _RANK_LOCK_FDS.discard(fd)
            os.close(fd)
            raise
        if waited_for is not None:
            log.warning("flashckpt: rank %d's lock is free again (%s exited)", rank, waited_for)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {pid_namespace()}\n".encode(), 0)
        return _RankLock(fd)

    def release(self) -> None:
        _RANK_LOCK_FDS.discard(self.fd)
        os.close(self.fd)  # drops the flock


def _lock_holder(fd: int) -> tuple[int, bool] | None:
    """The pid a rank lock file names and whether that process is known to be dead (it ran in
    this PID namespace and no process has its pid now); None: the file names no pid."""
    try:
        fields = os.pread(fd, 64, 0).decode().split()
        pid = int(fields[0])
        ns = int(fields[1]) if len(fields) > 1 else None
    except (OSError, ValueError, IndexError):
        return None
    if pid <= 0:
        return None
    if ns is None or ns != pid_namespace() or ns == 0:
        return pid, False  # another namespace (or a file of an earlier version): not judged
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid, True
    except OSError:  # alive (another user's: EPERM)
        pass
    return pid, False


def _openers(path: str) -> list[int]:
    """The pids of this user's processes that have ``path`` open (read from ``/proc``)."""
    try:
        want = os.stat(path)
    except OSError:
        return []
    out = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                for fd in os.scandir(f"/proc/{entry.name}/fd"):
                    st = os.stat(fd.path)
                    if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
                        out.append(int(entry.name))
                        break
    return sorted(out)


def _warn_unfixed_ddp(model: torch.nn.Module) -> None:
    """Warns (on the wrapper's rank 0) when ``model`` is a torch DDP wrapper whose resumes will
    not be bitwise (3+ ranks, buckets not fixed: :func:`flashckpt.trainer.ddp.resume_warning`)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    from flashckpt.trainer.ddp import resume_warning

    msg = resume_warning(model)
    if msg is not None and model.process_group.rank() == 0:
        log.warning("%s", msg)
        warnings.warn(msg, stacklevel=4)


def _json_copy(obj: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serialisable: {e}") from None


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2]


def checkpointing(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Any = None,
    stateful: Mapping[str, Any] | None = None,
    per_rank: Mapping[str, Any] | None = None,
    extras: dict[str, Any] | None = None,
    process_group: Any = None,
    **options: Any,
) -> Checkpointer:
    """Wraps a training loop with flash checkpointing.

    Args:
        model: the module whose ``state_dict`` is saved.
        optimizer: its optimizer (its ``step()`` waits for a pending snapshot copy).
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        stateful: more named objects with ``state_dict``/``load_state_dict``, saved with the
            model (under data parallelism one replica's copy is persisted).
        per_rank: named objects whose state differs by rank (a data loader, a sampler): their
            small ``state_dict`` (JSON values and small tensors) goes into each rank's own file
            with its RNG states, so every rank gets its own back, from memory or storage.
        extras: a dict of JSON values (step, data position, ...) saved with each snapshot and
            updated in place on restore.
        process_group: the group whose ranks agree on the resume step (default: the world).
        **options: fields of :class:`CheckpointConfig` (``storage``, ``every``, ``mode``, ...).

    Returns:
        A :class:`Checkpointer`; use it in a ``with`` block.
    """
    unknown = sorted(set(options) - set(CheckpointConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(unknown_options(unknown))
    config = CheckpointConfig(**options)
    return Checkpointer(
        model,
        optimizer,
        scheduler=scheduler,
        stateful=stateful,
        per_rank=per_rank,
        extras=extras,
        process_group=process_group,
        config=config,
    )


_NONE, _PENDING, _LOST, _DUE = 0, 1, 2, 3
"""The ranks' verdicts on a call, ordered so that their all-reduce MAX is the agreement:
nothing owed; a rank still waits to hear its agent persist the last mark; the last mark was
lost on some rank (mark this call in its place); the cadence marks this call."""


class _Cadence:
    """Which calls are marked: the first and then every ``every_n``-th, or (``every_s``) one
    when at least that long passed since the last marked, by the ranks' OR (a rank whose clock
    says "due" decides for all: one all-reduce per call, so every rank must call it)."""

    def __init__(self, every_n: int | None, every_s: float | None) -> None:
        self.every_n, self.every_s = every_n, every_s
        self.calls = 0
        self.mark_t: float | None = None
        """When the last call was marked (time form)."""

    def due(self, ctx: RankContext) -> bool:
        return self.decide(ctx, None) == _DUE

    def decide(self, ctx: RankContext, code: Callable[[], int] | None) -> int:
        """The ranks' verdict on this call: ``_DUE`` when the cadence marks it, else the
        largest ``code()`` of the ranks (``_LOST``, ``_PENDING`` or ``_NONE``; ``_NONE`` when
        ``code`` is None). ``code`` is None or not on every rank alike: in the count form it
        decides whether the ranks talk (no collective without it), the time form always does
        (one all-reduce carries both words). A ``_LOST`` verdict restarts the clock too: the
        call it marks is the one storage gets."""
        self.calls += 1
        if self.every_n is not None:
            if (self.calls - 1) % self.every_n == 0:
                return _DUE
            return _NONE if code is None else ctx.all_max(code())
        assert self.every_s is not None
        now = time.monotonic()
        mine = self.mark_t is None or now - self.mark_t >= self.every_s
        verdict = ctx.all_max(_DUE if mine else _NONE if code is None else code())
        if verdict >= _LOST:
            self.mark_t = now
        return verdict
