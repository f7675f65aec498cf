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

import collections
import contextlib
import copy
import difflib
import hashlib
import json
import logging
import operator
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import xxhash

from flashckpt import envnames
from flashckpt.errors import PersistError, StorageUnavailableError
from flashckpt.interval import AutoInterval
from flashckpt.jsonstate import decode_state, encode_state
from flashckpt.layout import (
    FlatState,
    Layout,
    flatten_state,
    piece_nodes,
    tensor_views,
    unflatten_state,
)
from flashckpt.names import SLOT_SUFFIX_RE, agent_log_path
from flashckpt.peers import (
    HeldSnapshot,
    PeerPlan,
    Placeholders,
    exchange,
    gather_json,
    plan_needs,
    views_of,
)
from flashckpt.protocol import (
    AgentClient,
    AgentError,
    default_node_id,
    default_run_dir,
    socket_path,
)
from flashckpt.reading import read_rank, read_resharded, read_shard
from flashckpt.ring import StepRecorder, open_recorder
from flashckpt.rng import capture_rng, restore_rng
from flashckpt.sharded import (
    ShardedPiece,
    assemble,
    is_dtensor,
    is_sharded_dtensor,
    mesh_layout,
    placement_objects,
    replace_at,
    target_box,
    to_dtensor,
    walk_pieces,
)
from flashckpt.shm import (
    HEADER_SIZE,
    Prefaulter,
    ShmSpaceError,
    Slot,
    check_name,
    ensure_private_dir,
    file_problem,
    prefault,
    slot_prefix,
)
from flashckpt.storage import CorruptCheckpointError, Storage

__all__ = ["CheckpointConfig", "Checkpointer", "SnapshotHandle", "checkpointing"]

log = logging.getLogger("flashckpt")

_MIN_META_CAP = 1 << 20


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """How a rank checkpoints."""

    storage: str | None = None
    """Checkpoint root URL (any fsspec URL); None keeps snapshots in memory only."""
    every: int | Literal["auto"] = "auto"
    """When ``ckpt.step()`` snapshots. ``"auto"`` (the default): at the interval that minimises
    lost time, from the measured snapshot stall, step time and failure rate, chosen again after
    every snapshot (:mod:`flashckpt.interval`; ``status()["every"]`` shows it); the first one
    after 10 steps. An int N: whenever the number of steps done is a multiple of N. 0: manual,
    snapshots only on ``save()`` (and the one on exit)."""
    mtbf_s: float | None = None
    """With ``every="auto"``: the prior job MTBF in seconds (default: 50,000 GPU-hours per
    failure divided by the world size); failures seen during the run update it."""
    job: str | None = None
    """Job id (names segments and the agent). Default: $FLASHCKPT_JOB, then
    $TORCHELASTIC_RUN_ID, then a hash of the storage URL."""
    node: str | None = None
    """Node id. Default: $FLASHCKPT_NODE, then the host name."""
    mode: Literal["overlap", "sync"] = "overlap"
    """overlap: ``save()`` returns after the cheap part; parameters and optimizer state are copied
    in the background and ``optimizer.step()`` waits for the copy. sync: the copy is done before
    ``save()`` returns."""
    when_busy: Literal["wait", "skip"] = "wait"
    """When no slot is free (the previous copy still runs and the agent persists the other slot):
    wait for one, or skip this snapshot (counted in ``stats`` and returned by ``save``)."""
    keep: int = 3
    """Committed steps kept in storage."""
    shm_dir: str | None = None
    """The tmpfs for the slots of an agent started by this rank (a local-disk directory works
    too, more slowly). Default: $FLASHCKPT_SHM_DIR, then /dev/shm."""
    run_dir: str | None = None
    """Directory of the agent's socket and logs. Default: $FLASHCKPT_RUN_DIR, then
    /tmp/flashckpt-<uid>."""
    agent: Literal["auto", "connect"] = "auto"
    """auto: start a node agent if none runs; connect: require a running one."""
    restore: bool = True
    """Restore the newest state found on entry. False starts from step 0 (the snapshots in
    memory are dropped); over a storage root that holds committed steps it needs
    ``overwrite=True``."""
    overwrite: bool = False
    """Whether a run that starts from step 0 (``restore=False``, or nothing any rank can restore)
    may take over a storage root that holds committed steps: they are deleted on entry, and this
    run's steps replace them. Without it entry refuses with an error: the older run's steps would
    otherwise be taken for this run's (and resumed from next time)."""
    allow_unsaved_scheduler: bool = False
    """Whether an optimizer driven by an LR scheduler (its param groups carry ``initial_lr``) may
    go without the scheduler in ``scheduler=`` or ``stateful=``. By default entry refuses: a
    resume would silently restart the schedule (warm-up included)."""
    on_persist_failure: Literal["raise", "warn"] = "raise"
    """What leaving the ``with`` block does when the final snapshot is not committed to storage
    (storage failed mid-run; training went on from memory): raise :class:`PersistError` (the
    job exits non-zero), or only log and warn."""
    replicated: bool | None = None
    """Whether all ranks hold the same model/optimizer state. None (the default): detected on
    entry. A model state dict or optimizer holding a DTensor with a ``Shard`` (or strided)
    placement (FSDP2, tensor parallel, HSDP) is sharded, anything else replicated. True: data
    parallel, one replica persists the state (a sharded DTensor is then refused on entry).
    False: every rank holds a piece of its own; with DTensors on a mesh with replicate dims
    (HSDP) only the ranks of replica 0 (coordinate 0 on those dims) write the pieces.
    ``ckpt.config.replicated`` holds the resolved value after entry."""
    flush_timeout: float = 600.0
    """Seconds to wait on exit for the last snapshot to be committed to storage."""
    agent_timeout: float = 60.0
    """Seconds to wait for the agent to start or answer."""
    agent_idle_timeout: float = 600.0
    """An auto-started agent persists and exits when no trainer has been back this long."""

    def __post_init__(self) -> None:
        if isinstance(self.every, str):
            if self.every != "auto":
                raise ValueError(
                    f"every={self.every!r}: use a step interval (int), 0 for manual, or 'auto'"
                )
        elif isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ValueError(
                f"every={self.every!r}: use a positive step interval, 0 for manual, or 'auto'"
            )
        if self.mtbf_s is not None and not self.mtbf_s > 0:
            raise ValueError(f"mtbf_s={self.mtbf_s!r}: the job MTBF must be > 0 seconds")
        if self.mode not in ("overlap", "sync"):
            raise ValueError(f"mode={self.mode!r}: use 'overlap' or 'sync'")
        if self.when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy={self.when_busy!r}: use 'wait' or 'skip'")
        if self.keep < 1:
            raise ValueError(f"keep={self.keep}: keep at least 1 committed step")
        if self.agent not in ("auto", "connect"):
            raise ValueError(f"agent={self.agent!r}: use 'auto' or 'connect'")
        for name in ("restore", "overwrite", "allow_unsaved_scheduler"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: use True or False")
        if self.on_persist_failure not in ("raise", "warn"):
            raise ValueError(
                f"on_persist_failure={self.on_persist_failure!r}: use 'raise' or 'warn'"
            )
        if self.storage is not None:
            Storage(self.storage)  # validates the URL early


@dataclass(slots=True)
class Stats:
    """Counters of a checkpointer (all times in seconds)."""

    saves: int = 0
    skips: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    last_snapshot_step: int | None = None
    last_committed_step: int | None = None
    persist_errors: list[dict[str, Any]] = field(default_factory=list)
    stall_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    first_save_s: float | None = None


class SnapshotHandle:
    """What ``save()`` returns: whether the snapshot was taken, and a way to wait for its copy."""

    def __init__(self, step: int, future: Future[None] | None, skipped: str | None = None) -> None:
        self.step = step
        self.skipped = skipped
        self._future = future

    @property
    def taken(self) -> bool:
        return self.skipped is None

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self) -> None:
        """Waits until the snapshot is complete in memory; re-raises a background failure."""
        if self._future is not None:
            self._future.result()

    def __repr__(self) -> str:
        state = (
            f"skipped: {self.skipped}" if self.skipped else ("done" if self.done() else "copying")
        )
        return f"SnapshotHandle(step={self.step}, {state})"


@dataclass(slots=True)
class _SlotMap:
    slot: Slot
    data: torch.Tensor  # uint8 view of the whole mapped file
    step: int | None = None
    writing: bool = False
    views: dict[str, torch.Tensor] | None = None
    views_sig: str | None = None
    registered_cuda: bool = False
    ino: int = 0


def _env(name: str) -> str | None:
    v = os.environ.get(name)
    return v if v else None


_HASH_MASK = (1 << 62) - 1


def _world_id(world: int, group: Any = None) -> str:
    """Names the world (rendezvous round) this rank belongs to, the same on every rank of it.

    ``FLASHCKPT_WORLD_ID`` when set; else, under torch.distributed launchers, the rendezvous
    master's address and port (a new round gets a new port) and the world size.
    """
    wid = envnames.world_id()
    if wid:
        return wid
    addr, port = _env("MASTER_ADDR"), _env("MASTER_PORT")
    if world > 1 and addr and port:
        return f"{addr}:{port}/{world}"
    if world > 1 and torch.distributed.is_initialized():
        # Another init method (file://, tcp:// URL): rank 0 draws a name for this world. A
        # shared empty name would let the node agent mix a dead world's ranks into this one's.
        token = torch.tensor([int.from_bytes(os.urandom(6), "little")], dtype=torch.int64)
        torch.distributed.broadcast(token, group_src=0, group=group)  # None: the default group
        return f"w{int(token.item()):012x}/{world}"
    return ""


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
            raise TypeError(
                f"extras must be a dict of JSON-serialisable values, got {type(extras)}"
            )
        if scheduler is not None and not hasattr(scheduler, "state_dict"):
            raise TypeError("scheduler has no state_dict()/load_state_dict()")
        if optimizer is not None and scheduler is None and not config.allow_unsaved_scheduler:
            _check_scheduler_given(optimizer, {**(stateful or {}), **(per_rank or {})})
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
        """Where the restored state came from: ``memory``, ``storage``, ``replica`` (a peer's
        memory) or ``memory-reshard`` (a sharded state rebuilt from the pieces this world's ranks
        hold in memory); None when nothing was restored."""
        self._pg = process_group
        self._coord_pg: Any = None
        self._storage = Storage(config.storage) if config.storage else None
        self._rank, self._world = 0, 1
        self._local_world = 1
        self._local_rank = 0
        self._world_id = ""
        self._client: AgentClient | None = None
        self._agent_proc: subprocess.Popen[bytes] | None = None
        # What reconnecting to a (restarted) node agent needs: the socket and the hello fields.
        self._agent_path: str | None = None
        self._hello_fields: dict[str, Any] = {}
        self._next_reconnect = 0.0
        self._agent_auto = False  # the agent was started by a trainer (not by its launcher)
        self.agent_restarts = 0
        """Times this rank lost its node agent and found (or started) another one."""
        self._slots: list[_SlotMap | None] = [None, None]
        self._orphans: list[_SlotMap] = []  # other local ranks' slots, during a restore
        # Index in the held snapshots -> (slot, header) this rank verifies before resharding.
        self._held_verify: dict[int, tuple[_SlotMap, Any]] = {}
        self._restore_info: dict[str, Any] = {}
        self._slot_lock = threading.Lock()
        self._pending: Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._hooks: list[Any] = []
        self._layout: Layout | None = None
        self._layout_specs: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None
        self._count = 0  # steps completed (the library's step count)
        self._last_saved_step: int | None = None
        self._cuda_stream: Any = None
        self._entered = False
        self._mon: StepRecorder | None = None
        self._auto: AutoInterval | None = None
        self._agent_shm_dir: str | None = None
        self._run_dir: str | None = None
        self._opt_names: tuple[tuple[int, ...], list[str | None]] | None = None
        self._restore_s: float | None = None
        self._timeline_start = -1  # the step this run resumed at; -1: started from scratch
        self._shard = 0
        self.job = ""
        self.node = ""

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        enter_wall = time.time()
        self._setup()
        if self._agent_shm_dir and self._run_dir:
            self._mon = open_recorder(
                shm_dir=self._agent_shm_dir,
                run_dir=self._run_dir,
                job=self.job,
                node=self.node,
                rank=self._rank,
                world=self._world,
                enter_wall=enter_wall,
            )
        try:
            if self.config.restore:
                self._restore()
            else:
                # A past timeline's snapshots must never be resumed from after this run's start.
                self._invalidate_after(-1)
            if self.restored_from is None:
                self._start_fresh()
            self._count = self.start_step
            self._timeline_start = self.start_step if self.restored_from else -1
            if self._client is not None:
                # Tells the node agent where this run's timeline starts (-1: from scratch): a
                # committed step after it is not this run's, so it is neither taken as already
                # persisted nor reported by flush(). An agent that dies meanwhile is told again
                # by the next one's link (_relink), so its loss costs no entry.
                with contextlib.suppress(AgentError):
                    self._client.request("restored", step=self._timeline_start, timeout=10)
            if self._mon is not None:  # before the optimizer hook below: it times its wait
                self._hooks.extend(self._mon.attach(self.model, self.optimizer))
            self._hook_optimizer()
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-copy")
            self._preallocate()
            self._prefault_all()
        except BaseException:
            self._teardown()
            raise
        self._entered = True
        if self._mon is not None:
            self._mon.ready(self.start_step, self.restored_from)
        self._log_entry()
        return self

    def _log_entry(self) -> None:
        if self.restored_from is not None:
            log.info(
                "flashckpt: rank %d restored step %d from %s in %.2f s",
                self._rank,
                self.start_step,
                self.restored_from,
                self._restore_s or 0.0,
            )
        else:
            log.info(
                "flashckpt: rank %d starts at step 0: %s",
                self._rank,
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
                count = self._count
                if count > self.start_step and (
                    self._last_saved_step is None or self._last_saved_step < count
                ):
                    self.save(mode="sync", when_busy="wait")
                lost = self._lost_work(self.flush())
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

    def _lost_work(self, committed: int | None) -> PersistError | None:
        """The error to raise on exit when the newest snapshot is not committed, else None."""
        step = self.stats.last_snapshot_step
        if self._storage is None or step is None or (committed is not None and committed >= step):
            return None
        errors = list(self.stats.persist_errors)
        why = f": {errors[-1]['error']}" if errors else ""
        durable = self.stats.last_committed_step
        return PersistError(
            f"step {step} (the final snapshot) was not committed to storage "
            f"{self._storage.url}{why}. It is in this machine's shared memory only (the node "
            f"agent keeps retrying while it runs); the newest committed step is "
            f"{'none' if durable is None else durable}. Fix the storage and run again to resume, "
            "or pass on_persist_failure='warn' to exit normally anyway",
            step=step,
            errors=errors,
        )

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

    def _auto_step(self, done: int) -> SnapshotHandle | None:
        auto = self._auto
        if auto is None:
            auto = self._auto = AutoInterval(
                world=self._world, mtbf_s=self.config.mtbf_s, start_step=self.start_step
            )
        auto.tick()
        if not auto.due(done):
            return None
        handle = self.save()
        # Every rank reaches this step: they agree on the next interval (the smallest).
        auto.decide(done, self.stats.stall_s, self.stats.wait_s, lambda n: -self._all_max(-n))
        return handle

    def save(
        self,
        step: int | None = None,
        *,
        mode: Literal["overlap", "sync"] | None = None,
        when_busy: Literal["wait", "skip"] | None = None,
    ) -> SnapshotHandle:
        """Snapshots the state into shared memory now, labelled with the steps done.

        Returns at once in overlap mode (the bulk copy runs in the background and the optimizer's
        next ``step()`` waits for it). Never mutates the caller's state and never pickles.

        Args:
            step: optional, the label; it must equal the steps done (``steps_done``): a
                snapshot's label is what a resume starts at, so it is never set apart from the
                count.
            mode: overrides the configured ``mode`` for this snapshot.
            when_busy: overrides the configured ``when_busy`` for this snapshot.

        Raises:
            ValueError: ``step`` differs from the steps done.
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
        step = self._count
        mode = mode or self.config.mode
        when_busy = when_busy or self.config.when_busy
        t0 = time.perf_counter()
        flat, async_ptrs, model_sd = self._collect()
        meta_extra = {
            "step": step,
            "private": {
                "rng": capture_rng(),
                "extras": _json_copy(self.extras, "extras"),
                "buffers_xxh": self._buffers_hash(model_sd),
                **self._per_rank_state(),
            },
        }
        if not self._agent_alive():
            self._relink()  # the agent died: find (or start) another; never waits
        skipped = "both slots busy"
        try:
            slot = self._acquire_slot(flat, when_busy)
        except AgentError as err:
            if self._agent_alive():
                raise
            # New slots (the state outgrew them) need an agent: this snapshot is lost, training
            # goes on, and the next one is taken once an agent is back.
            slot, skipped = None, f"no node agent to allocate slots ({err})"
        if slot is None:
            self.stats.skips += 1
            self.stats.skipped_steps.append(step)
            warnings.warn(
                f"flashckpt: snapshot of step {step} skipped: {skipped}"
                + (" (when_busy='skip')" if skipped == "both slots busy" else ""),
                stacklevel=2,
            )
            return SnapshotHandle(step, None, skipped=skipped)
        assert self._layout is not None
        layout = self._layout
        meta = self._meta_bytes(flat, layout, meta_extra)
        views = self._views(slot, layout)
        by_name = dict(zip(flat.names, flat.tensors, strict=True))
        now, later = [], []
        for e in layout.entries:
            src = by_name[e.name]
            pair = (views[e.name], src)
            if mode == "overlap" and src.data_ptr() in async_ptrs and src.numel():
                later.append(pair)
            else:
                now.append(pair)
        seq = slot.slot.begin_write()
        slot.slot.write_meta(meta)
        slot.step = None

        def finish() -> None:
            try:
                self._copy(slot, later)
                slot.slot.end_write(seq, step, meta, layout.nbytes)
                slot.step = step
                self.stats.last_snapshot_step = step
                if self._client is not None:
                    self._client.notify(
                        "snap", rank=self._rank, local_rank=self._local_rank, step=step
                    )
            finally:
                slot.writing = False

        try:
            self._copy(slot, now)
        except BaseException:
            slot.writing = False
            raise
        if later:
            self._pending = self._executor.submit(finish) if self._executor else None
            handle = SnapshotHandle(step, self._pending)
        else:
            finish()
            handle = SnapshotHandle(step, None)
        self._last_saved_step = step
        dt = time.perf_counter() - t0
        self.stats.saves += 1
        self.stats.stall_s.append(dt)
        if self.stats.first_save_s is None:
            self.stats.first_save_s = dt
        if self._mon is not None:
            self._mon.ckpt_stall(dt, snapshot=True)
        return handle

    def wait(self) -> None:
        """Waits for the background copy of the last snapshot (and re-raises its failure)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            t0 = time.perf_counter()
            pending.result()
            self.stats.wait_s.append(time.perf_counter() - t0)

    def flush(self, timeout: float | None = None) -> int | None:
        """Waits until the newest snapshot is committed to storage; returns the committed step.

        A storage failure does not raise here (training goes on from memory): it is logged and
        kept in ``stats.persist_errors``; the return value is then None. Leaving the ``with``
        block raises :class:`PersistError` when the final snapshot is not committed.
        """
        self.wait()
        step = self.stats.last_snapshot_step
        if step is None or self._storage is None or self._agent_path is None:
            return None
        if not self._agent_alive() and not self._relink(wait=True):
            log.error("flashckpt: step %d not persisted: no node agent", step)
            self.stats.persist_errors.append({"step": step, "error": "no node agent"})
            return None
        assert self._client is not None
        if self._mon is not None:
            self._mon.pause()  # waiting for storage is no hang
        try:
            for attempt in range(3):
                try:
                    reply = self._client.request(
                        "flush",
                        step=step,
                        timeout_s=timeout or self.config.flush_timeout,
                        timeout=(timeout or self.config.flush_timeout) + 5,
                    )
                    break
                except AgentError as e:
                    # The agent died while persisting: its successor adopts the slots and
                    # persists the step; ask it.
                    if attempt < 2 and not self._agent_alive() and self._relink(wait=True):
                        assert self._client is not None
                        continue
                    log.error("flashckpt: step %d not persisted: %s", step, e)
                    self.stats.persist_errors.append({"step": step, "error": str(e)})
                    return None
        finally:
            if self._mon is not None:
                self._mon.resume()
        self.stats.last_committed_step = int(reply["committed"])
        return self.stats.last_committed_step

    def status(self) -> dict[str, Any]:
        """The checkpointer's state: snapshots, commits, skips, errors, stalls, agent."""
        s = self.stats
        agent: dict[str, Any] = {"connected": bool(self._client and self._client.connected)}
        if self._client is not None and self._client.connected:
            with contextlib.suppress(AgentError):
                reply = self._client.request("status", timeout=5)
                agent.update({k: v for k, v in reply.items() if k not in ("id", "ok")})
        return {
            "rank": self._rank,
            "world_size": self._world,
            "job": self.job,
            "node": self.node,
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
        cfg = self.config
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            self._rank = dist.get_rank(self._pg)
            self._world = dist.get_world_size(self._pg)
            backend = dist.get_backend(self._pg)
            self._coord_pg = self._pg if backend == "gloo" else dist.new_group(backend="gloo")
        lws = _env("LOCAL_WORLD_SIZE")
        self._local_world = int(lws) if lws else self._world
        lr = _env("LOCAL_RANK")
        # The agent keys slots by local rank: after a membership change a surviving trainer may
        # get another global rank, and still finds its snapshots.
        self._local_rank = int(lr) if lr else self._rank % max(self._local_world, 1)
        self._world_id = _world_id(self._world, self._coord_pg)
        if self._storage is not None:
            self._probe_storage(self._storage)
        job = cfg.job or envnames.job()
        if job is None:
            run_id = _env("TORCHELASTIC_RUN_ID")
            if run_id and run_id != "none":
                job = run_id
        if job is None:
            if cfg.storage is None:
                raise ValueError("pass job= (or storage=) so the snapshots have a name")
            job = "j" + hashlib.sha1(cfg.storage.encode()).hexdigest()[:12]
        self.job = check_name("job", job)
        self.node = check_name("node", cfg.node or envnames.node() or default_node_id())
        run_dir = cfg.run_dir or envnames.run_dir() or default_run_dir()
        path = socket_path(run_dir, self.job, self.node)
        self._run_dir = run_dir
        if len(path.encode()) > 100:
            raise ValueError(f"agent socket path {path!r} is too long: use a shorter run_dir/job")
        shard, num_shards, replica = self._shard_layout()
        self._shard = shard
        hello = self._hello(
            path,
            run_dir,
            rank=self._rank,
            local_rank=self._local_rank,
            world_id=self._world_id,
            world_size=self._world,
            local_world_size=self._local_world,
            shard=shard,
            num_shards=num_shards,
            replica=replica,
            storage=cfg.storage,
            pid=os.getpid(),
        )
        self._agent_shm_dir = hello.get("shm_dir")
        self._agent_auto = bool(hello.get("auto_started"))
        self._meta_static = {
            "job": self.job,
            "rank": self._rank,
            "world_id": self._world_id,
            "world_size": self._world,
            "local_world_size": self._local_world,
            "shard": shard,
            "num_shards": num_shards,
            "replica": replica,
        }
        for i, p in enumerate(hello["slots"]):
            if p is not None:
                try:
                    self._slots[i] = self._map(p)
                except (OSError, ValueError) as e:
                    log.warning("flashckpt: ignoring slot %s: %s", p, e)

    def _probe_storage(self, st: Storage) -> None:
        """Writes, reads back and deletes a small file under the storage root (every rank, then
        all agree), so storage that cannot keep the work fails here, not silently at the end.

        Raises:
            StorageUnavailableError: this rank's probe failed (with the URL and the OS error), or
                another rank's did.
        """
        name = f".flashckpt-probe-{self._rank}-{os.getpid()}-{os.urandom(4).hex()}"
        path = st.path(name)
        payload = b"flashckpt storage probe " + os.urandom(16)
        error = None
        try:
            if st.local:  # a local root is created here, as the node agent would
                st.fs.makedirs(st.root, exist_ok=True)
            st.fs.pipe_file(path, payload)
            got = st.fs.cat_file(path)
            st.fs.rm(path)
            if got != payload:
                error = f"the file read back differs ({len(got)} bytes, {len(payload)} written)"
        except Exception as e:  # any backend's failure (OSError, botocore, ...), reported as is
            error = f"{type(e).__name__}: {e}"
            with contextlib.suppress(Exception):
                st.fs.rm(path)
        others = self._all_max(1 if error else 0)
        if error is not None:
            raise StorageUnavailableError(
                f"storage {st.url} cannot keep checkpoints: writing, reading back and deleting "
                f"{path} failed: {error}. Fix the URL, its permissions or its free space, or "
                "pass storage=None to keep snapshots in memory only"
            )
        if others:
            raise StorageUnavailableError(
                f"storage {st.url} cannot keep checkpoints: another rank could not write, read "
                "back and delete a file there (its error names the cause)"
            )

    def _start_fresh(self) -> None:
        """A run that starts from step 0 over a storage root holding committed steps: refused,
        unless ``overwrite=True``, which deletes them (every rank agrees first).

        Raises:
            ValueError: the root holds committed steps and ``overwrite`` is False.
        """
        if self._storage is None:
            return
        st = self._storage
        stored = self._storage_steps()
        if not self._all_max(1 if stored else 0):
            return
        why = (
            "restore=False"
            if not self.config.restore
            else "none of them could be restored by every rank (see the warnings above)"
        )
        if not self.config.overwrite:
            held = f"committed steps {stored}" if stored else "committed steps (seen by a rank)"
            raise ValueError(
                f"storage {st.url} holds {held} of an earlier run, and this run starts from "
                f"step 0 ({why}): its steps would be mixed with those, and the older run's taken "
                "for this one's. Pass overwrite=True to delete them and start over, use a new "
                "storage root"
                + (", or drop restore=False to resume" if not self.config.restore else "")
            )
        if self._rank == 0:
            doomed = st.all_step_dirs()
            for s in sorted(doomed, reverse=True):
                st.uncommit(s)  # the commit marker first: never a half-deleted committed step
                with contextlib.suppress(FileNotFoundError):
                    st.fs.rm(st.step_path(s), recursive=True)
            with contextlib.suppress(FileNotFoundError):
                st.fs.rm(st.path("latest"))
            log.warning(
                "flashckpt: overwrite=True: deleted steps %s of an earlier run from %s (%s)",
                doomed,
                st.url,
                why,
            )
        self._all_max(0)  # nobody writes before the old steps are gone

    def _connect(self, path: str, run_dir: str, *, again: bool = False) -> AgentClient:
        """Connects to the node agent, starting one if needed (agent='auto').

        An agent that is just shutting down (the previous run finished) refuses new work by
        closing; then a fresh one is started, until ``agent_timeout`` runs out.

        Args:
            again: the agent was lost. Wait up to ``agent_timeout`` for it to be back (also with
                agent='connect': its owner restarts it), and start one only if this rank had
                started the lost one (an agent a launcher supervises is restarted by it).
        """
        deadline = time.monotonic() + self.config.agent_timeout
        while True:
            try:
                return AgentClient(path, on_event=self._on_event, timeout=0.2)
            except AgentError:
                if self.config.agent == "connect" and not again:
                    raise AgentError(
                        f"no flashckpt node agent at {path}: start one (`flashckpt agent --job "
                        f"{self.job} --node {self.node}`) or pass agent='auto'"
                    ) from None
            if time.monotonic() > deadline:
                raise AgentError(
                    f"the node agent did not start within {self.config.agent_timeout:.0f} s; "
                    f"see {agent_log_path(run_dir, self.job, self.node)}"
                )
            if again and not self._may_restart_agent():
                continue
            if self._agent_proc is None or self._agent_proc.poll() is not None:
                self._spawn_agent(run_dir)

    def _hello(self, path: str, run_dir: str, **fields: Any) -> dict[str, Any]:
        self._agent_path, self._hello_fields = path, dict(fields)
        for attempt in range(3):
            self._client = self._connect(path, run_dir)
            try:
                return self._client.request("hello", timeout=self.config.agent_timeout, **fields)
            except AgentError as e:
                if self._client.connected or attempt == 2:
                    raise
                log.info("flashckpt: node agent went away during hello (%s); retrying", e)
                self._client.close()
        raise AssertionError("unreachable")

    def _spawn_agent(self, run_dir: str) -> None:
        cfg = self.config
        # The log is appended to and the socket connected to there: a directory another user
        # can write into is refused, never used.
        ensure_private_dir(run_dir, "agent run dir")
        cmd = [
            sys.executable,
            "-m",
            "flashckpt",
            "agent",
            "--job",
            self.job,
            "--node",
            self.node,
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
        log_path = agent_log_path(run_dir, self.job, self.node)
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        logf = os.fdopen(fd, "ab")
        try:
            # A new session: the agent must outlive this trainer (that is its whole point).
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True
            )
        finally:
            logf.close()
        self._agent_proc = proc
        threading.Thread(target=proc.wait, name="flashckpt-agent-reaper", daemon=True).start()

    def _on_event(self, msg: dict[str, Any]) -> None:
        ev = msg.get("event")
        if ev == "committed":
            step = int(msg["step"])
            if self.stats.last_committed_step is None or step > self.stats.last_committed_step:
                self.stats.last_committed_step = step
        elif ev == "persist_error":
            self.stats.persist_errors.append({"step": msg.get("step"), "error": msg.get("error")})
            log.warning("flashckpt: persisting step %s failed: %s", msg.get("step"), msg["error"])

    def _agent_alive(self) -> bool:
        return self._client is not None and self._client.connected

    def _relink(self, wait: bool = False) -> bool:
        """Finds a node agent again after losing it (it died or was restarted); True if linked.

        Training does not depend on the agent: snapshots go on into the slots (files the new
        agent adopts), only their persistence waits. Without ``wait`` one quick attempt is made
        (at most one per second; with agent='auto', a rank that had started the lost agent
        starts the next); with ``wait`` (on exit, to persist the last snapshot) up to
        ``agent_timeout``.
        """
        if self._agent_alive():
            return True
        path, run_dir = self._agent_path, self._run_dir
        if path is None or run_dir is None:
            return False
        now = time.monotonic()
        if not wait and now < self._next_reconnect:
            return False
        self._next_reconnect = now + 1.0
        if self._client is not None:
            self._client.close()
            self._client = None
        try:
            if wait:
                client = self._connect(path, run_dir, again=True)
            else:
                try:
                    client = AgentClient(path, on_event=self._on_event, timeout=0.0)
                except AgentError:
                    # An agent of a launcher (or started by hand) is its owner's to restart:
                    # one of ours would race it for the job's lock.
                    if self._may_restart_agent():
                        self._spawn_agent(run_dir)  # connected to at the next attempt
                    return False
            reply = client.request("hello", timeout=self.config.agent_timeout, **self._hello_fields)
        except AgentError as e:
            log.warning(
                "flashckpt: rank %d: no node agent yet (%s); training goes on", self._rank, e
            )
            return False
        self._client = client
        self._agent_auto = bool(reply.get("auto_started"))
        self.agent_restarts += 1
        self._adopt_hello_slots(reply.get("slots") or [])
        if self._timeline_start >= 0:
            # The new agent learns where this resumed timeline began (steps after it in storage
            # that this run did not commit belong to an abandoned one and are rewritten). A run
            # that started from scratch tells nothing: entry refused a root holding another
            # run's steps (or deleted them, overwrite=True), so every committed step is its own,
            # even one this rank has not heard of yet.
            last = self.stats.last_committed_step
            since = max(self._timeline_start, last if last is not None else -1)
            with contextlib.suppress(AgentError):
                client.request("restored", step=since, timeout=10)
        log.warning(
            "flashckpt: rank %d lost its node agent and is linked to agent pid %s now",
            self._rank,
            reply.get("pid"),
        )
        return True

    def _may_restart_agent(self) -> bool:
        """Whether this rank starts the next agent after losing one: with agent='auto', when
        the lost one was started by a trainer (this rank's own, or another's) and none of this
        rank's is still starting. An agent of a launcher or an operator is theirs to restart."""
        if self.config.agent != "auto":
            return False
        if self._agent_proc is not None:
            return self._agent_proc.poll() is not None
        return self._agent_auto

    def _adopt_hello_slots(self, paths: list[str | None]) -> None:
        """Keeps the mapped slots the new agent serves (same files); drops the others."""
        with self._slot_lock:
            same = all(
                (sm is None and p is None)
                or (sm is not None and p == sm.slot.path and _same_file(p, sm.ino))
                for sm, p in zip(self._slots, [*paths, None, None][:2], strict=True)
            )
        if same:
            return
        self.wait()  # no copy runs into a slot that is dropped here
        with self._slot_lock:
            for i, p in enumerate([*paths, None, None][:2]):
                sm = self._slots[i]
                if sm is not None and not (p == sm.slot.path and _same_file(p, sm.ino)):
                    self._slots[i] = None  # the agent discarded it: the next save allocates

    def _hook_optimizer(self) -> None:
        if self.optimizer is None:
            return

        def pre_step(opt: Any, args: Any, kwargs: Any) -> None:
            t0 = time.perf_counter()
            self.wait()
            if self._mon is not None:
                self._mon.ckpt_stall(time.perf_counter() - t0)

        self._hooks.append(self.optimizer.register_step_pre_hook(pre_step))

    def _teardown(self, done: bool = False) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._mon is not None:  # before "done": the agent may exit right after it
            self._mon.close(0 if done else 1)
            self._mon = None
        if self._client is not None:
            if done:
                with contextlib.suppress(AgentError):
                    self._client.request(
                        "done", rank=self._rank, local_rank=self._local_rank, timeout=10
                    )
            self._client.close()
            self._client = None
        with self._slot_lock:
            self._slots = [None, None]
        self._entered = False

    # -- slots -------------------------------------------------------------------------------
    def _map(self, path: str) -> _SlotMap:
        problem = file_problem(path)
        if problem is not None:
            # Another user's file (or one others may read or write) holds no state of ours.
            raise ValueError(f"slot file {path} is not trusted: {problem}")
        size = os.path.getsize(path)
        data = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        slot = Slot(path, buf=data.numpy())
        info = slot.header()
        sm = _SlotMap(slot, data, ino=os.stat(path).st_ino)
        if info is not None and info.complete:
            sm.step = info.step
        return sm

    def _collect(self) -> tuple[FlatState, set[int], dict[str, Any]]:
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if self.config.replicated:  # sharded since entry (checked there): refused, not half-saved
            key = next((k for k, v in state["model"].items() if is_sharded_dtensor(v)), None)
            if key is not None:
                raise self._replicated_error(f"model state key {key!r}")
        async_ptrs = {_local_ptr(p) for p in self.model.parameters()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            for st in self.optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        async_ptrs.add(_local_ptr(v))
            # What export needs to key optimizer state by parameter name (as DCP does).
            state["optimizer_param_names"] = self._optimizer_param_names()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.stateful:
            state["stateful"] = {k: v.state_dict() for k, v in self.stateful.items()}
        flat = flatten_state(state)
        specs = flat.specs()
        if specs != self._layout_specs:
            self._layout = Layout.build(specs)
            self._layout_specs = specs
        async_ptrs.discard(0)
        return flat, async_ptrs, state["model"]

    def _optimizer_param_names(self) -> list[str | None]:
        """The model's name of each optimizer parameter, in ``optimizer.state_dict()`` id order;
        kept while the optimizer holds the same parameters (it is recorded at every save)."""
        assert self.optimizer is not None
        ids = tuple(id(p) for g in self.optimizer.param_groups for p in g["params"])
        if self._opt_names is None or self._opt_names[0] != ids:
            names = {id(p): n for n, p in self.model.named_parameters()}
            params = (p for g in self.optimizer.param_groups for p in g["params"])
            self._opt_names = (ids, [names.get(id(p)) for p in params])
        return self._opt_names[1]

    def _buffers_hash(self, model_sd: Mapping[str, Any]) -> int:
        """A hash of the model's buffers (the state that is not parameters, e.g. BatchNorm
        statistics): the part of a data-parallel replica's state that may differ by rank.
        Two ranks' snapshots of one step with equal hashes are interchangeable."""
        params = {_local_ptr(p) for p in self.model.parameters()}
        h = xxhash.xxh3_64()
        for name, t in model_sd.items():  # the state dict this snapshot copies (not a 2nd one)
            if not isinstance(t, torch.Tensor) or is_dtensor(t) or _local_ptr(t) in params:
                continue
            t = t.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            h.update(name.encode())
            if t.numel():
                h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.intdigest() & _HASH_MASK

    def _meta_bytes(self, flat: FlatState, layout: Layout, extra: dict[str, Any]) -> bytes:
        meta = {
            **self._meta_static,
            **extra,
            "layout_sig": layout.signature,
            "entries": layout.to_json(),
            "skeleton": flat.skeleton,
        }
        try:
            return json.dumps(meta, separators=(",", ":"), allow_nan=True).encode()
        except TypeError as e:
            raise TypeError(f"snapshot description is not JSON-serialisable: {e}") from None

    def _estimate_bytes(self) -> int:
        tensors = [t for t in self.model.state_dict().values() if isinstance(t, torch.Tensor)]
        model_bytes = sum(_local_nbytes(t) for t in tensors)
        opt = self.optimizer
        if opt is None:
            return model_bytes
        if opt.state:
            return model_bytes + sum(
                _local_nbytes(v)
                for st in opt.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor)
            )
        dry = _dry_run_state_bytes(opt)
        if dry is not None:
            return model_bytes + dry
        # The optimizer cannot step on stand-in parameters (a closure, sharded or fused ones):
        # a guess by name, counting AMSGrad's third buffer.
        param_bytes = sum(_local_nbytes(p) for p in self.model.parameters())
        name = type(opt).__name__.lower()
        factor = 2 if "adam" in name or "lamb" in name else 1
        if any(g.get("amsgrad") for g in opt.param_groups):
            factor += 1
        return model_bytes + factor * param_bytes + 64 * len(opt.state_dict()["state"] or [1])

    def _preallocate(self) -> None:
        """Reserves both slots at entry, sized from the state (or an estimate before the first
        optimizer step), so a too-small /dev/shm fails here, before training, not mid-run."""
        need = self._estimate_bytes()
        self._ensure_slots(_MIN_META_CAP, need, fault=False)

    def _prefault_all(self) -> None:
        """Maps every slot page in a background thread (returns at once): a copy into fresh
        slot pages costs 2.5x one into mapped pages (tmpfs zeroes each page on first touch).

        The slot the first snapshot goes to comes first, mapped from its end: a save never waits
        for it; if it comes before the slot is done, its copy faults the start of the slot while
        the thread maps the rest. The other slot follows, paused while a copy runs.
        """
        with self._slot_lock:
            slots = [s for s in self._slots if s is not None]
        if not slots:
            return
        target = self._target_slot()
        slots.sort(key=lambda s: s is not target)
        ranges = [(s.data.data_ptr() + HEADER_SIZE, s.data.numel() - HEADER_SIZE, s) for s in slots]

        def alive(i: int) -> bool:  # the slot is still mapped here (not torn down, not replaced)
            return any(s is slots[i] for s in self._slots)

        def busy(i: int) -> bool:  # a copy runs into the other slot
            return any(s is not None and s is not slots[i] and s.writing for s in self._slots)

        Prefaulter(ranges, alive=alive, busy=busy).start()  # stops once its slots go

    def _ensure_slots(self, meta_need: int, data_need: int, fault: bool = True) -> None:
        """Makes the slots hold at least the given sizes; existing slots that do are kept
        (after a restart they hold the snapshots just restored from). New ones get headroom.

        The slot holding the newest complete snapshot is never replaced, even when too small
        (the state's layout changed: another world size, a resharded state): replacing it would
        lose the one step to resume from until the next snapshot completes. It is replaced once
        the other slot holds a newer one and it becomes the target.
        """
        target = self._target_slot() if any(self._slots) else None
        with self._slot_lock:
            keep = [
                i
                for i, s in enumerate(self._slots)
                if s is not None and s is not target and s.step is not None
            ]
            ok = all(
                i in keep
                or (s is not None and s.slot.meta_cap >= meta_need and s.slot.data_cap >= data_need)
                for i, s in enumerate(self._slots)
            )
            if ok:
                return
            meta_cap = max(4 * _MIN_META_CAP, 2 * meta_need)
            data_cap = data_need + data_need // 16 + (1 << 20)
            if self._client is None:
                raise AgentError("no node agent: lost, and none found again yet")
            try:
                reply = self._client.request(
                    "alloc",
                    timeout=self.config.agent_timeout,
                    rank=self._rank,
                    local_rank=self._local_rank,
                    meta_cap=meta_cap,
                    data_cap=data_cap,
                    keep=keep,
                )
            except AgentError as e:
                if e.kind == "ShmSpaceError":
                    raise ShmSpaceError(str(e)) from None
                raise
            new: list[_SlotMap | None] = []
            for i, p in enumerate(reply["slots"]):
                old = self._slots[i]
                if old is not None and old.slot.path == p and old.ino == os.stat(p).st_ino:
                    new.append(old)
                    continue
                sm = self._map(p)
                if fault:
                    prefault(sm.data.data_ptr() + HEADER_SIZE, sm.data.numel() - HEADER_SIZE)
                new.append(sm)
            self._slots = new

    def _acquire_slot(self, flat: FlatState, when_busy: str) -> _SlotMap | None:
        assert self._layout is not None
        need_meta = max(_MIN_META_CAP, 2 * len(json.dumps(flat.skeleton)) + 256 * len(flat.names))
        need_data = self._layout.nbytes
        target = self._target_slot() if all(self._slots) else None
        if target is None or target.slot.meta_cap < need_meta or target.slot.data_cap < need_data:
            # First save without pre-allocation, or the state outgrew the slot: reallocate it
            # (the other one, holding the newest snapshot, stays as it is).
            self.wait()
            self._ensure_slots(need_meta, need_data)
        deadline = time.monotonic() + self.config.agent_timeout
        while True:
            target = self._target_slot()
            # A pin is the agent's (it reads the slot): one left by an agent that died means
            # nothing (its successor clears it on adoption), so it is not waited for.
            if not target.writing and (not target.slot.pinned() or not self._agent_alive()):
                break
            if when_busy == "skip":
                return None
            if target.writing:  # the previous overlapped copy is still running
                self.wait()
                continue
            # The agent persists this (older) snapshot: ask it to yield, and wait.
            target.slot.want(True)
            if time.monotonic() > deadline and self._agent_alive():
                target.slot.want(False)
                raise TimeoutError(
                    f"no snapshot slot became free within {self.config.agent_timeout:.0f} s"
                )
            time.sleep(0.001)
        target.slot.want(False)
        target.writing = True
        return target

    def _target_slot(self) -> _SlotMap:
        """The slot the next snapshot goes to: the older one. The newest complete snapshot is
        never overwritten, so a crash during a copy always leaves it to resume from."""
        with self._slot_lock:
            slots = [s for s in self._slots if s is not None]
        return min(slots, key=lambda s: -1 if s.step is None else s.step)

    def _views(self, sm: _SlotMap, layout: Layout) -> dict[str, torch.Tensor]:
        if sm.views is None or sm.views_sig != layout.signature:
            off = sm.slot.data_off
            sm.views = tensor_views(layout, sm.data[off : off + layout.nbytes])
            sm.views_sig = layout.signature
        return sm.views

    def _copy(self, sm: _SlotMap, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cuda_pairs = [(d, s) for d, s in pairs if s.is_cuda]
        for d, s in pairs:
            if not s.is_cuda:
                d.copy_(s)
        if cuda_pairs:
            self._copy_cuda(sm, cuda_pairs)

    def _copy_cuda(self, sm: _SlotMap, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Device -> pinned shared memory on a side stream (GPU only)."""
        if not sm.registered_cuda:
            # Pin the shared mapping so copies are real async DMA.
            torch.cuda.cudart().cudaHostRegister(sm.data.data_ptr(), sm.data.numel(), 0)
            sm.registered_cuda = True
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream()
        stream = self._cuda_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
        stream.synchronize()

    # -- restore -----------------------------------------------------------------------------
    def _memory_steps(self) -> dict[int, tuple[_SlotMap, dict[str, Any]]]:
        out: dict[int, tuple[_SlotMap, dict[str, Any]]] = {}
        for sm in self._slots:
            if sm is None:
                continue
            info = sm.slot.header()
            if info is None or not info.complete:
                continue
            meta = sm.slot.read_meta(info)
            if meta is None:
                continue
            own = int(meta.get("rank", self._rank)) == self._rank
            replicated = self.config.replicated and int(meta.get("num_shards", 1)) == 1
            if meta.get("world_size") != self._world:
                # The job shrank or grew (elastic MIN:MAX with no standby left, or a late
                # machine): a replicated state still serves the rank that took it, with its
                # own RNG and extras. A sharded one is resharded from storage instead.
                if not (own and replicated):
                    continue
            elif not own:
                # This position's snapshot was taken by another rank of an earlier world (the
                # ranks were renumbered after a membership change). A replicated state serves
                # this rank if its buffers equal this rank's own at that step (the hash in the
                # small per-rank file the agent wrote through, which also has its RNG/extras).
                if not (self.config.replicated and int(meta.get("num_shards", 1)) == 1):
                    continue
                if not self._interchangeable(info.step, meta["private"].get("buffers_xxh")):
                    continue
            out[info.step] = (sm, meta)
        return out

    def _verify_memory(self, sm: _SlotMap, info: Any, step: int) -> None:
        """Checks a snapshot in shared memory against the data hash the agent recorded when it
        was complete.

        Raises:
            _BadMemory: the data changed since (scribbled), or no hash can be had.
        """
        ok = sm.slot.verify_data(info)
        if ok is None and self._agent_alive():
            assert self._client is not None
            # The agent hashes in the background; have it hash this position's slots now.
            with contextlib.suppress(AgentError):
                self._client.request(
                    "hash", rank=self._rank, local_rank=self._local_rank, timeout=60
                )
            ok = sm.slot.verify_data(info)
        if ok is not True:
            why = (
                "fails its data hash: the shared memory was overwritten since the snapshot"
                if ok is False
                else "has no data hash to check it against"
            )
            raise _BadMemory(
                f"rank {self._rank}: the snapshot of step {step} in memory ({sm.slot.path}) "
                f"{why}; not restored from it"
            )

    def _interchangeable(self, step: int, buffers_xxh: int | None) -> bool:
        """Whether a replica's snapshot of ``step`` with this buffers hash can stand for this
        rank's own (whose RNG/extras and buffers hash are in storage)."""
        if self._storage is None:
            return False
        private = self._storage.read_private(step, self._rank, self._world)
        if private is None:
            return False
        return not self._buffers_matter() or (
            buffers_xxh is not None and private.get("buffers_xxh") == buffers_xxh
        )

    def _buffers_matter(self) -> bool:
        """False where this rank's own buffers are overwritten before use: DDP with
        ``broadcast_buffers`` (the default) sends rank 0's to every rank at each forward."""
        ddp = torch.nn.parallel.DistributedDataParallel
        return not (
            isinstance(self.model, ddp) and self.model.broadcast_buffers and self._rank != 0
        )

    def _storage_steps(self) -> list[int]:
        if self._storage is None:
            return []
        try:
            return self._storage.committed_steps()
        except OSError as e:
            log.warning("flashckpt: cannot list storage %s: %s", self._storage.url, e)
            return []

    def _restore(self) -> None:
        t0 = time.perf_counter()
        mem = self._memory_steps()
        held = None if self.config.replicated else self._held_snapshots()
        stored = set(self._storage_steps())
        excluded: set[int] = set()
        while True:
            plan = self._plan_restore(mem, stored, excluded)
            peer = None if held is None else self._plan_peers(held, plan, excluded)
            if peer is not None:
                plan = (peer.step, {r: ("memory-reshard", -1) for r in range(self._world)})
            if plan is None:
                if mem or stored - excluded:
                    warnings.warn(
                        f"flashckpt: rank {self._rank} holds steps {sorted(mem)} in memory and "
                        f"{sorted(stored)} in storage, but no step can be obtained by every rank; "
                        "nothing restored",
                        stacklevel=3,
                    )
                self._invalidate_after(-1)
                self._restore_s = time.perf_counter() - t0
                return
            step, sources = plan
            self._restore_info = {}
            code, loaded = 0, None
            memory_only = False
            err: Exception | None = None
            try:
                if peer is not None:
                    assert held is not None
                    loaded = self._load_peers(peer, held)
                else:
                    received = self._exchange_replicas(step, sources, mem)
                    loaded = self._load_step(step, sources[self._rank], mem.get(step), received)
            except _BadMemory as e:
                # Only this copy is bad: the step may still come from storage (or a replica).
                code, err = 1, e
                mem.pop(step, None)
                memory_only = True
                warnings.warn(f"flashckpt: {e}; trying another source", stacklevel=3)
            except (CorruptCheckpointError, FileNotFoundError, _TornSnapshot) as e:
                code, err = 1, e
                warnings.warn(
                    f"flashckpt: cannot restore step {step}: {e}; trying an older step",
                    stacklevel=3,
                )
            except (ValueError, TypeError, KeyError, RuntimeError) as e:
                code, err = 2, e
            worst = self._all_max(code)
            if worst == 0:
                assert loaded is not None
                self._apply(*loaded)
                self.start_step = step
                self._last_saved_step = step
                self.restored_from = sources[self._rank][0]
                self._restore_s = time.perf_counter() - t0
                self._restore_info.update(
                    step=step, source=self.restored_from, seconds=self._restore_s
                )
                self._invalidate_after(step)
                return
            if worst == 2:
                if err is not None:
                    raise err
                raise RuntimeError(f"another rank failed to restore step {step}; see its log")
            # Every rank takes part: the step is excluded unless each failure was a bad copy in
            # memory (those ranks dropped it from their memory steps and plan again).
            if self._all_max(0 if code == 0 or memory_only else 1):
                excluded.add(step)

    def _plan_restore(
        self, mem: dict[int, Any], stored: set[int], excluded: set[int]
    ) -> tuple[int, dict[int, tuple[str, int]]] | None:
        """Agrees (collectively) on the newest step every rank can obtain, and from where.

        A rank obtains a step from its own memory, from committed storage or, for a replicated
        state, from a surviving replica's memory over torch.distributed (its RNG states and extras
        then come from the small per-rank file the agent writes through at each snapshot).

        Returns:
            The step and, per rank, ``(source, src_rank)`` with source ``memory``, ``storage`` or
            ``replica``; None if no step works for every rank.
        """
        k = 16
        my_mem = sorted(set(mem) - excluded, reverse=True)[:k]
        my_st = sorted(stored - excluded, reverse=True)[:k]
        if self._world == 1:
            cands = sorted({*my_mem, *my_st}, reverse=True)
            if not cands:
                return None
            return cands[0], {0: ("memory" if cands[0] in mem else "storage", 0)}
        mems, sts = self._gather_sets([my_mem, my_st], k)
        # Each rank's buffers hash of each step it holds: step -> hash, per rank.
        rows = self._gather_rows(
            [x for s in my_mem for x in (s, int(mem[s][1]["private"].get("buffers_xxh", -1)))],
            2 * k,
        )
        mem_hashes = [dict(zip(row[::2], row[1::2], strict=True)) for row in rows]
        union_mem = set().union(*mems)
        # Per rank: step -> the peer whose memory it can take that step from.
        privs: list[dict[int, int]] = [{} for _ in range(self._world)]
        if self.config.replicated and self._storage is not None:
            # Steps a replica holds in memory that this rank could take from it (a peer's
            # memory is preferred over storage, the slow path): the peer's snapshot must have
            # this rank's buffers (hash in the file written through, with its RNG/extras).
            have = []
            for s in sorted(union_mem - set(my_mem), reverse=True)[:k]:
                private = self._storage.read_private(s, self._rank, self._world)
                if private is None:
                    continue
                want = private.get("buffers_xxh") if self._buffers_matter() else None
                for q in sorted(range(self._world), key=lambda q: (q - self._rank) % self._world):
                    if s in mem_hashes[q] and want in (None, mem_hashes[q][s]):
                        have.append(s << 16 | q)
                        break
            (got,) = self._gather_sets([have], k)
            privs = [{v >> 16: v & 0xFFFF for v in g} for g in got]
        for s in sorted(union_mem.union(*sts), reverse=True):
            if all(s in mems[r] or s in sts[r] or s in privs[r] for r in range(self._world)):
                sources = {}
                for r in range(self._world):
                    if s in mems[r]:
                        sources[r] = ("memory", r)
                    elif s in privs[r]:
                        sources[r] = ("replica", privs[r][s])
                    else:
                        sources[r] = ("storage", r)
                return s, sources
        return None

    # -- resharding from memory -------------------------------------------------------------
    def _held_snapshots(self) -> list[HeldSnapshot]:
        """Complete snapshots of a sharded state this rank can read: those in every slot of this
        machine's node agent (its own, the other trainers' of this machine, and those of local
        ranks no trainer of this world uses when the machine runs fewer trainers than before).
        Shared memory is shared: a piece on this machine is never sent over the network.
        """
        self._orphans = []
        others = []
        for path, lr in self._machine_slot_paths():
            try:
                sm = self._map(path)
            except (OSError, ValueError) as e:
                log.debug("flashckpt: cannot map slot %s: %s", path, e)
                continue
            others.append(sm)
            if lr >= self._local_world and lr % self._local_world == self._local_rank:
                self._orphans.append(sm)  # no trainer owns it: this rank cleans it up
        maps = [sm for sm in self._slots if sm is not None] + others
        # Each slot of the machine is verified (data hash) by one rank: its own trainer's, or,
        # for a position no trainer uses now, the rank that cleans it up.
        mine = {id(sm) for sm in self._slots if sm is not None} | {id(sm) for sm in self._orphans}
        self._held_verify = {}
        out: list[HeldSnapshot] = []
        for sm in maps:
            info = sm.slot.header()
            meta = sm.slot.read_meta(info) if info is not None and info.complete else None
            if info is None or meta is None or "entries" not in meta:
                continue
            if int(meta.get("num_shards", 1)) <= 1 and not any(
                True for _ in piece_nodes(meta.get("skeleton"))
            ):
                continue  # not a sharded state
            layout_bytes = Layout.from_json(meta["entries"]).nbytes
            off = sm.slot.data_off

            def check(sm: _SlotMap = sm, step: int = info.step) -> bool:
                now = sm.slot.header()
                return now is not None and now.complete and now.step == step

            if id(sm) in mine:
                self._held_verify[len(out)] = (sm, info)
            out.append(
                HeldSnapshot(
                    step=info.step,
                    world_id=str(meta.get("world_id", "")),
                    world_size=int(meta.get("world_size", 1)),
                    rank=int(meta.get("rank", 0)),
                    meta=meta,
                    data=sm.data[off : off + layout_bytes],
                    check=check,
                )
            )
        return out

    def _machine_slot_paths(self) -> list[tuple[str, int]]:
        """(path, local rank) of the slots of the other local ranks of this job on this node."""
        shm_dir = self._agent_shm_dir
        if not shm_dir:
            return []
        prefix = slot_prefix(self.job, self.node)
        try:
            names = os.listdir(shm_dir)
        except OSError:
            return []
        out = []
        for name in sorted(names):
            m = _SLOT_RE.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
            if m is not None and int(m.group(1)) != self._local_rank:
                out.append((os.path.join(shm_dir, name), int(m.group(1))))
        return out

    def _plan_peers(
        self,
        held: list[HeldSnapshot],
        plan: tuple[int, dict[int, tuple[str, int]]] | None,
        excluded: set[int],
    ) -> PeerPlan | None:
        """Agrees (collectively) on a sharded step newer than ``plan``'s (or as new, where
        ``plan`` is not all from memory) that this world can rebuild from the snapshots its ranks
        hold in memory, and on who sends what. None if there is none."""
        base_step = plan[0] if plan is not None else None
        all_mem = plan is not None and all(k == "memory" for k, _ in plan[1].values())
        rows = gather_json(
            [[h.step, h.world_id, h.world_size, h.rank] for h in held], self._world, self._coord_pg
        )
        groups: dict[tuple[int, str, int], dict[int, int]] = {}
        for r, entries in enumerate(rows):
            for s, wid, w, o in entries:
                groups.setdefault((int(s), str(wid), int(w)), {}).setdefault(int(o), r)
        tries = 0
        for key in sorted(groups, key=lambda g: (-g[0], g[1], g[2])):
            step, wid, w = key
            if step in excluded:
                continue
            if base_step is not None and (step < base_step or (step == base_step and all_mem)):
                break
            tries += 1
            if tries > 3:
                break
            mine = {h.rank: h for h in held if h.key == key}
            # One description per old rank travels: the designated holder's (the lowest rank
            # that holds it, the same choice on every rank).
            send = {str(o): h.meta for o, h in mine.items() if groups[key][o] == self._rank}
            metas: dict[int, dict[str, Any]] = {}
            for got in gather_json(send, self._world, self._coord_pg):
                for o, m in got.items():
                    metas.setdefault(int(o), m)
            code, base, requests = 0, -1, {}
            try:
                if mine:
                    base = min(mine)
                else:
                    base = self._rank if w == self._world and self._rank in metas else min(metas)
                state = unflatten_state(metas[base]["skeleton"], Placeholders())
                boxes = [(t.piece.name, t.box) for t in self._piece_boxes(state)]
                requests = plan_needs(self._rank, self._world, metas, set(mine), boxes, base)
            except Exception as e:  # any: the other ranks wait in the all-reduce below
                code = 1
                log.info("flashckpt: step %d cannot be resharded from memory: %s", step, e)
            if self._all_max(code) == 0:
                return PeerPlan(step, wid, w, metas, groups[key], base, requests)
        return None

    def _load_peers(
        self, plan: PeerPlan, held: list[HeldSnapshot]
    ) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        """Rebuilds this rank's state of a step from the snapshots held in this world's memory
        (collective: every rank calls it with the same plan)."""
        key = (plan.step, plan.world_id, plan.world_size)
        mine = {h.rank: h for h in held if h.key == key}
        # Checked before the exchange, reported after it (every rank takes part in it).
        bad: str | None = None
        for i, h in enumerate(held):
            entry = self._held_verify.get(i)
            if entry is not None and h.key == key:
                try:
                    self._verify_memory(entry[0], entry[1], plan.step)
                except _BadMemory as e:
                    bad = bad or str(e)
        received, error = exchange(plan, self._rank, self._world, self._coord_pg, mine)
        if bad is not None:
            raise _TornSnapshot(bad)
        if error is not None:
            raise _TornSnapshot(error)
        views: dict[int, Mapping[str, torch.Tensor]] = {o: views_of(h) for o, h in mine.items()}
        views.update(received)
        pieces: dict[str, list[ShardedPiece]] = {}
        for o, v in views.items():
            for name, pm in piece_nodes(plan.metas[o]["skeleton"]):
                if name in v:
                    pieces.setdefault(name, []).append(ShardedPiece(v[name], pm, name))
        skeleton = plan.metas[plan.base]["skeleton"]
        state = unflatten_state(skeleton, Placeholders(views.get(plan.base, {})))
        state = self._resolve_sharded(plan.step, state, pieces=pieces)
        self._check_model(state)
        if not all(h.check() for h in mine.values()):
            raise _TornSnapshot(f"a snapshot of step {plan.step} changed while read")
        if plan.world_size == self._world and self._rank in plan.metas:
            private = plan.metas[self._rank].get("private")
        else:
            # Another world size: the extras are rank 0's; the RNG states stay as they are.
            old0 = plan.metas.get(0, {}).get("private") or {}
            private = {
                "rng": capture_rng(),
                "extras": old0.get("extras") or {},
                "other_world": plan.world_size,
            }
        self._restore_info = {
            "saved_world_size": plan.world_size,
            "received_from_old_ranks": sorted(received),
            "received_bytes": sum(t.nbytes for got in received.values() for t in got.values()),
        }
        log.info(
            "flashckpt: rank %d rebuilt step %d (saved by %d ranks) from memory; received from "
            "old ranks %s",
            self._rank,
            plan.step,
            plan.world_size,
            sorted(received),
        )
        return state, private, True

    def _gather_rows(self, row: list[int], k: int) -> list[list[int]]:
        """All-gathers one short int list from every rank, order kept: result[rank]."""
        t = torch.zeros(k + 1, dtype=torch.int64)
        t[0] = len(row[:k])
        if row:
            t[1 : 1 + len(row[:k])] = torch.tensor(row[:k])
        out = [torch.empty_like(t) for _ in range(self._world)]
        torch.distributed.all_gather(out, t, group=self._coord_pg)
        return [o[1 : 1 + int(o[0])].tolist() for o in out]

    def _gather_sets(self, lists: list[list[int]], k: int) -> list[list[set[int]]]:
        """All-gathers a few short int lists from every rank: result[i][rank] is a set."""
        t = torch.full((len(lists), k), -1, dtype=torch.int64)
        for i, xs in enumerate(lists):
            if xs:
                t[i, : len(xs)] = torch.tensor(xs[:k])
        out = [torch.empty_like(t) for _ in range(self._world)]
        torch.distributed.all_gather(out, t, group=self._coord_pg)
        return [[set(o[i].tolist()) - {-1} for o in out] for i in range(len(lists))]

    def _exchange_replicas(
        self, step: int, sources: dict[int, tuple[str, int]], mem: dict[int, Any]
    ) -> tuple[dict[str, Any], torch.Tensor] | None:
        """Sends this rank's snapshot of ``step`` to the ranks that restore from it; receives
        one if this rank needs it. Every rank walks the same plan, so sends and receives pair."""
        dist = torch.distributed
        received = None
        failure: Exception | None = None
        for r in sorted(sources):
            kind, src = sources[r]
            if kind != "replica":
                continue
            if self._rank == src:
                # Whatever goes wrong here, the peer gets a header: it must not wait in recv
                # until the gloo timeout.
                try:
                    sm, meta = mem[step]
                    info = sm.slot.header()
                    ok = info is not None and info.complete and info.step == step
                    if ok:
                        self._verify_memory(sm, info, step)  # never sends scribbled bytes
                    meta_b = json.dumps(meta).encode() if ok else b""
                    entries = meta.get("entries") if ok else None
                    n = Layout.from_json(entries).nbytes if entries else 0
                except Exception as e:  # reported after the exchange
                    ok, meta_b, n = False, b"", 0
                    failure = failure or e
                head = torch.tensor([len(meta_b) if ok else -1, n or 0], dtype=torch.int64)
                dist.send(head, r, group=self._coord_pg)
                if ok:
                    dist.send(
                        torch.frombuffer(bytearray(meta_b), dtype=torch.uint8),
                        r,
                        group=self._coord_pg,
                    )
                    off = sm.slot.data_off
                    if n:
                        dist.send(sm.data[off : off + n], r, group=self._coord_pg)
            elif self._rank == r:
                head = torch.empty(2, dtype=torch.int64)
                dist.recv(head, src, group=self._coord_pg)
                meta_len, n = (int(x) for x in head.tolist())
                if meta_len < 0:
                    raise _TornSnapshot(f"rank {src}'s snapshot of step {step} changed")
                meta_t = torch.empty(meta_len, dtype=torch.uint8)
                dist.recv(meta_t, src, group=self._coord_pg)
                data = torch.empty(n, dtype=torch.uint8)
                if n:
                    dist.recv(data, src, group=self._coord_pg)
                received = (json.loads(meta_t.numpy().tobytes()), data)
        if failure is not None:
            raise _TornSnapshot(f"this rank's snapshot of step {step} cannot be sent: {failure}")
        return received

    def _all_max(self, code: int) -> int:
        if self._world == 1:
            return code
        t = torch.tensor([code], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self._coord_pg)
        return int(t.item())

    def _load_step(
        self,
        step: int,
        source: tuple[str, int],
        mem: tuple[_SlotMap, dict[str, Any]] | None,
        received: tuple[dict[str, Any], torch.Tensor] | None,
    ) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        """Reads one step into (state tree, private state, tensors-view-shared-memory)."""
        kind = source[0]
        if kind == "memory":
            assert mem is not None
            sm, meta = mem
            info = sm.slot.header()
            if info is None or info.step != step or not info.complete:
                raise _TornSnapshot(f"slot {sm.slot.path} changed")
            self._verify_memory(sm, info, step)
            layout = Layout.from_json(meta["entries"])
            off = sm.slot.data_off
            views = tensor_views(layout, sm.data[off : off + layout.nbytes])
            state = unflatten_state(meta["skeleton"], views)
            state = self._resolve_sharded(step, state)
            self._check_model(state)
            private = meta["private"]
            if int(meta.get("rank", self._rank)) != self._rank and self._storage is not None:
                private = self._storage.read_private(step, self._rank, self._world)
            return state, private, True
        assert self._storage is not None
        if kind == "replica":
            assert received is not None
            meta, data = received
            layout = Layout.from_json(meta["entries"])
            state = unflatten_state(meta["skeleton"], tensor_views(layout, data))
            state = self._resolve_sharded(step, state)
            self._check_model(state)
            if int(meta.get("rank", -1)) == self._rank:  # the peer holds this rank's own snapshot
                private = meta["private"]
            else:
                private = self._storage.read_private(step, self._rank, self._world)
            return state, private, False
        manifest = self._storage.read_manifest(step)
        # A sharded step saved by another world size: any shard gives the unsharded part (the
        # same on every rank); the DTensor pieces are then resharded from all shards.
        shard = self._storage_shard(manifest)
        state = read_shard(self._storage, step, shard, manifest)
        state = self._resolve_sharded(step, state, manifest)
        self._check_model(state)
        private = None
        if int(manifest["world_size"]) == self._world:
            private = read_rank(self._storage, step, self._rank, manifest)
        else:
            private = self._private_from_other_world(step, manifest)
        if private is None:
            log.warning("flashckpt: no saved RNG/extras for rank %d at step %d", self._rank, step)
        return state, private, False

    def _private_from_other_world(
        self, step: int, manifest: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Extras of a step saved by another world size: rank 0's. The RNG states stay as they
        are (the saved ones belong to other ranks)."""
        rank0 = read_rank(self._storage, step, 0, manifest) if self._storage else None
        if rank0 is None:
            return None
        log.info(
            "flashckpt: step %d was saved by %s ranks: extras from rank 0, RNG not restored",
            step,
            manifest["world_size"],
        )
        return {
            "rng": capture_rng(),
            "extras": rank0.get("extras") or {},
            "other_world": int(manifest["world_size"]),
        }

    _opt_wrap: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...], tuple[int, ...]]] | None = None

    def _sharded_targets(self) -> dict[tuple[Any, ...], Any]:
        """Key path -> the DTensor a restored value must fit (its mesh, placements, shape)."""
        out: dict[tuple[Any, ...], Any] = {}
        for k, v in self.model.state_dict().items():
            if is_dtensor(v):
                out[("model", k)] = v
        if self.optimizer is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                if is_dtensor(p):
                    out[("optimizer", "state", i)] = p
        return out

    def _piece_boxes(self, state: dict[str, Any]) -> list[_PieceTarget]:
        """Per saved DTensor piece of a state: where it goes (this world's mesh, placements)
        and the box of the global tensor this rank needs.

        Raises:
            ValueError: a saved tensor does not fit its target.
        """
        found = list(walk_pieces(state))
        if not found:
            return []
        if self._opt_wrap:
            self._opt_wrap.clear()  # left by an attempt at another step that failed
        targets = self._sharded_targets()
        default = next(iter(targets.values()), None)
        out = []
        for path, piece in found:
            shape = tuple(int(x) for x in piece.meta["shape"])
            where = "/".join(map(str, path))
            target = targets.get(path[:3]) if path[:2] == ("optimizer", "state") else None
            target = targets.get(path, target)
            if target is not None:
                if tuple(target.shape) != shape:
                    raise ValueError(
                        f"checkpoint tensor {where} has shape {list(shape)}, but the model's is "
                        f"{list(target.shape)}: restore into the same architecture, or pass "
                        "restore=False"
                    )
                mesh, placements = target.device_mesh, tuple(target.placements)
            elif default is not None and default.device_mesh.ndim == len(piece.meta["mesh"]):
                mesh, placements = default.device_mesh, tuple(placement_objects(piece.meta))
            else:
                raise ValueError(
                    f"checkpoint tensor {where} is sharded (a DTensor), but no DTensor of this "
                    "model/optimizer tells on which device mesh to restore it"
                )
            try:
                box = target_box(shape, mesh, placements)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {where}: {e}") from None
            out.append(_PieceTarget(path, piece, mesh, placements, shape, box))
        return out

    def _resolve_sharded(
        self,
        step: int,
        state: dict[str, Any],
        manifest: dict[str, Any] | None = None,
        pieces: Mapping[str, list[ShardedPiece]] | None = None,
    ) -> dict[str, Any]:
        """Turns the saved DTensor pieces of a state into DTensors of this world's meshes.

        A piece whose box is the one this rank needs is used as is; the others (another world
        size or mesh) are rebuilt from the overlapping ``pieces`` (pieces held in memory by this
        world's ranks) or else from the pieces of the shards in storage.

        Raises:
            FileNotFoundError: resharding is needed but the step is not committed to storage
                (the caller then tries an older step).
            ValueError: a saved tensor does not fit its target, or ``pieces`` do not cover it.
        """
        wants: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        todo = []
        for t in self._piece_boxes(state):
            name, box, piece = t.piece.name, t.box, t.piece
            if pieces is not None:
                piece = next((p for p in pieces.get(name, []) if p.box == box), piece)
            if box == piece.box and tuple(piece.tensor.shape) == box[1]:
                local = piece.tensor
            elif pieces is not None:
                local = assemble(name, pieces.get(name, []), *box, piece.tensor.dtype)
            else:
                wants[name] = box
                todo.append((t.path, name, t.mesh, t.placements, t.shape))
                continue
            state = self._put_sharded(state, t.path, local, t.mesh, t.placements, t.shape)
        if todo:
            if self._storage is None or step not in set(self._storage_steps()):
                raise FileNotFoundError(
                    f"step {step} must be resharded for this world, but it is not committed to "
                    "storage"
                )
            got = read_resharded(self._storage, step, wants, manifest)
            for path, name, mesh, placements, shape in todo:
                state = self._put_sharded(state, path, got[name], mesh, placements, shape)
            log.info(
                "flashckpt: rank %d resharded %d tensors of step %d", self._rank, len(todo), step
            )
        return state

    def _put_sharded(
        self,
        state: dict[str, Any],
        path: tuple[Any, ...],
        local: torch.Tensor,
        mesh: Any,
        placements: tuple[Any, ...],
        shape: tuple[int, ...],
    ) -> dict[str, Any]:
        """Puts this rank's piece at ``path`` as a DTensor. Optimizer state stays a plain local
        tensor until ``optimizer.load_state_dict`` (a pre-hook wraps it): the copy that
        ``_apply`` makes of optimizer state is made for plain tensors."""
        if path[0] != "optimizer" or self.optimizer is None:
            return replace_at(state, path, to_dtensor(local, mesh, placements, shape))
        if self._opt_wrap is None:
            self._opt_wrap = {}
            self._hooks.append(
                self.optimizer.register_load_state_dict_pre_hook(self._wrap_optimizer_pieces)
            )
        self._opt_wrap[path[1:]] = (mesh, placements, shape)
        return replace_at(state, path, local)

    def _wrap_optimizer_pieces(self, optimizer: Any, state_dict: dict[str, Any]) -> Any:
        wrap, self._opt_wrap = self._opt_wrap, None
        if not wrap:
            return None
        for path, (mesh, placements, shape) in wrap.items():
            local: Any = state_dict
            for k in path:
                local = local[k]
            state_dict = replace_at(state_dict, path, to_dtensor(local, mesh, placements, shape))
        return state_dict

    def _check_model(self, state: dict[str, Any]) -> None:
        saved = state.get("model", {})
        current = self.model.state_dict()
        missing = sorted(set(current) - set(saved))
        unexpected = sorted(set(saved) - set(current))
        shapes = [
            f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(current[k].shape)}"
            for k in sorted(set(saved) & set(current))
            if isinstance(saved[k], torch.Tensor)
            and tuple(saved[k].shape) != tuple(current[k].shape)
        ]
        if missing or unexpected or shapes:
            lines = ["checkpoint does not fit the model:"]
            if missing:
                lines.append(f"  missing keys (in model, not in checkpoint): {missing}")
            if unexpected:
                lines.append(f"  unexpected keys (in checkpoint, not in model): {unexpected}")
            if shapes:
                lines.append("  shape mismatches: " + "; ".join(shapes))
            lines.append("  restore into the same architecture, or pass restore=False.")
            raise ValueError("\n".join(lines))
        for name, key in (("optimizer", self.optimizer), ("scheduler", self.scheduler)):
            if key is not None and name not in state:
                raise ValueError(f"checkpoint has no {name} state, but a {name} was given")

    def _apply(self, state: dict[str, Any], private: dict[str, Any] | None, from_mem: bool) -> None:
        # The tensors of `state` view the slot (from_mem: the next snapshot overwrites it) or the
        # one buffer a storage or replica restore read the whole shard into (model bytes
        # included). The model copies into its parameters; whatever else keeps tensors gets
        # copies of its own, so neither the slot nor that buffer stays pinned.
        with torch.no_grad():
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            opt, saved = self.optimizer, state["optimizer"]
            # Where to copy each saved tensor. Optimizer.load_state_dict (torch 2.x) keeps a value
            # whose dtype and device already are what it wants (Tensor.to returns it as is) and
            # casts the others into new memory: those need no copy from us. The others go into
            # the optimizer's current state when it has a tensor of the same shape (a restore
            # in a process that already trained: no new memory, no page faults), else into new
            # memory.
            targets: dict[Any, dict[str, torch.Tensor]] = {}
            saved_state = saved.get("state", {}) if isinstance(saved, dict) else {}
            saved_groups = saved.get("param_groups", []) if isinstance(saved, dict) else []
            # In place only when the groups match, so a state that load_state_dict rejects
            # leaves the optimizer untouched.
            fits = len(saved_groups) == len(opt.param_groups) and all(
                len(sg.get("params", [])) == len(g["params"])
                for sg, g in zip(saved_groups, opt.param_groups, strict=True)
            )
            for sg, g in zip(saved_groups, opt.param_groups, strict=False) if fits else ():
                low_step = bool(sg.get("fused") or sg.get("capturable"))
                for pid, param in zip(sg.get("params", []), g["params"], strict=True):
                    src, cur = saved_state.get(pid), opt.state.get(param) or {}
                    if not isinstance(src, dict):
                        continue
                    dst = targets[pid] = {}
                    for key, t in src.items():
                        if not isinstance(t, torch.Tensor):
                            continue
                        if key == "step" and not low_step:
                            cast = False  # kept as is, on its device
                        else:
                            want = param.dtype if param.is_floating_point() else t.dtype
                            want = torch.float32 if key == "step" else want
                            cast = want != t.dtype or param.device != t.device
                        if cast:
                            dst[key] = t  # load_state_dict's cast is the one copy
                        elif isinstance(cur.get(key), torch.Tensor):
                            dst[key] = cur[key]
            opt.load_state_dict(_clone_tensors(saved, into={"state": targets}))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(_clone_tensors(state["scheduler"]))
        for name, obj in self.stateful.items():
            sub = state.get("stateful", {}).get(name)
            if sub is None:
                raise ValueError(f"checkpoint has no state for stateful[{name!r}]")
            obj.load_state_dict(_clone_tensors(sub))
        if private is not None:
            restore_rng(private["rng"])
            self.extras.clear()
            self.extras.update(private.get("extras") or {})
        self._apply_per_rank(private)

    def _per_rank_state(self) -> dict[str, Any]:
        """The ``per_rank`` objects' states, for this rank's own JSON part of a snapshot."""
        if not self.per_rank:
            return {}
        return {
            "per_rank": {
                k: encode_state(v.state_dict(), f"per_rank/{k}") for k, v in self.per_rank.items()
            }
        }

    def _apply_per_rank(self, private: dict[str, Any] | None) -> None:
        if not self.per_rank:
            return
        if private is not None and private.get("other_world"):
            # Their states belong to the ranks of another world size: none is this rank's.
            warnings.warn(
                f"flashckpt: per_rank {sorted(self.per_rank)} not restored: the step was saved "
                f"by {private['other_world']} ranks, this world has {self._world}",
                stacklevel=4,
            )
            return
        saved = (private or {}).get("per_rank")
        for name, obj in self.per_rank.items():
            sub = saved.get(name) if isinstance(saved, dict) else None
            if sub is None:
                raise ValueError(
                    f"checkpoint has no state of rank {self._rank} for per_rank[{name!r}]"
                )
            obj.load_state_dict(decode_state(sub, f"per_rank/{name}"))

    def _invalidate_after(self, step: int) -> None:
        """Drops in-memory snapshots newer than the resume point: they belong to a past timeline.
        So do those of the local ranks no trainer uses any more (mapped for the restore only)."""
        orphans, self._orphans = self._orphans, []
        for sm in [*self._slots, *orphans]:
            if sm is None:
                continue
            info = sm.slot.header()
            if info is not None and info.step > step:
                sm.slot.invalidate()
                sm.step = None
            elif info is None or not info.complete:
                sm.step = None

    # -- sharding ----------------------------------------------------------------------------
    def _shard_layout(self) -> tuple[int, int, int]:
        """Resolves ``replicated`` (None: detected) and gives this rank's (shard, num_shards,
        replica) for the agent and the manifest.

        Replicated: one shard, written by replica 0 (rank 0). Sharded DTensors on one mesh of this
        world: the ranks at coordinate 0 of the replicate dims (HSDP) write one shard per
        coordinate on the shard dims; the other replicas write only their per-rank file. Any
        other sharded state: every rank writes a shard of its own.

        Raises:
            ValueError: ``replicated=True`` but the state holds a sharded DTensor.
        """
        cfg = self.config
        found = self._sharded_tensors()
        if cfg.replicated is None:
            cfg.replicated = not found
        elif cfg.replicated and found:
            raise self._replicated_error(found[0][0])
        if cfg.replicated:
            return 0, 1, self._rank
        dist = torch.distributed
        ranks = (
            dist.get_process_group_ranks(self._pg) if self._pg is not None else range(self._world)
        )
        layout = mesh_layout((t for _, t in found), ranks)
        return layout if layout is not None else (self._rank, self._world, 0)

    def _sharded_tensors(self) -> list[tuple[str, Any]]:
        """(where, tensor) of the model state's and optimizer parameters' sharded DTensors."""
        found = [
            (f"model state key {k!r}", v)
            for k, v in self.model.state_dict().items()
            if is_sharded_dtensor(v)
        ]
        if self.optimizer is not None:
            names = {id(p): n for n, p in self.model.named_parameters()}
            seen = {id(v) for _, v in found}
            for g in self.optimizer.param_groups:
                for p in g["params"]:
                    if id(p) not in seen and is_sharded_dtensor(p):
                        found.append((f"optimizer parameter {names.get(id(p), '?')!r}", p))
        return found

    def _replicated_error(self, where: str) -> ValueError:
        return ValueError(
            f"{where} is a DTensor sharded over ranks (FSDP2 / tensor parallel / HSDP): every rank "
            "holds a different piece, but replicated=True persists one rank's state only; drop "
            "replicated=True (sharding is then detected) or pass replicated=False"
        )

    def _storage_shard(self, manifest: dict[str, Any]) -> int:
        """The shard of a committed step this rank reads: its own when the step was saved in this
        layout; else any (the unsharded part is the same in every shard, and DTensor pieces whose
        boxes differ are then resharded from all shards)."""
        if self.config.replicated:
            return 0
        return self._shard % int(manifest["num_shards"])


_SLOT_RE = SLOT_SUFFIX_RE


def _same_file(path: str | None, ino: int) -> bool:
    try:
        return path is not None and os.stat(path).st_ino == ino
    except OSError:
        return False


class _BadMemory(Exception):
    """This rank's snapshot in shared memory fails its data hash: the step may still come from
    storage or a replica."""


class _TornSnapshot(Exception):
    pass


@dataclass(slots=True)
class _PieceTarget:
    """A saved DTensor piece and the DTensor this rank restores it as."""

    path: tuple[Any, ...]
    piece: ShardedPiece
    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    box: tuple[tuple[int, ...], tuple[int, ...]]


def _dry_run_state_bytes(opt: torch.optim.Optimizer) -> int | None:
    """Bytes of the state ``opt`` will hold after its first step, found by stepping a copy of it
    on meta-device stand-ins of its parameters (no memory, no effect on the real one): any
    optimizer, any number of state tensors per parameter. None where that copy cannot step."""
    try:
        groups = []
        for g in opt.param_groups:
            params = []
            for p in g["params"]:
                if is_dtensor(p) or not isinstance(p, torch.Tensor):
                    return None
                m = torch.empty_like(p, device="meta").requires_grad_(True)
                m.grad = torch.empty_like(m)
                params.append(m)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
        # A shallow copy through the optimizer's own __getstate__/__setstate__: no hooks (the
        # monitor's and ours stay on the real one), then fresh groups and state of its own.
        clone = copy.copy(opt)
        clone.param_groups = groups
        clone.state = collections.defaultdict(dict)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            clone.step()
        return sum(
            v.numel() * v.element_size()
            for st in clone.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
    except Exception as e:  # the estimate falls back to a guess by optimizer name
        log.debug("flashckpt: cannot dry-run %s on meta tensors: %s", type(opt).__name__, e)
        return None


def _local_nbytes(t: torch.Tensor) -> int:
    """Bytes of this rank's piece: a DTensor (FSDP2, tensor parallel) holds only its shard."""
    if is_dtensor(t):
        t = t.to_local()  # type: ignore[attr-defined]
    return t.numel() * t.element_size()


def _local_ptr(t: torch.Tensor) -> int:
    return t.to_local().data_ptr() if is_dtensor(t) else t.data_ptr()  # type: ignore[attr-defined]


def _clone_tensors(obj: Any, into: Any = None) -> Any:
    """Copies a state tree; every tensor in it gets memory of its own.

    New CPU tensors are carved out of one anonymous buffer whose pages are all mapped in one
    call (MADV_POPULATE_WRITE) instead of one page fault per 4 KiB during the copy. Copying into
    existing tensors (``into``) is cheaper still: no new memory at all.

    Args:
        obj: dicts, lists, tuples, tensors; other values are copied shallowly.
        into: an optional tree parallel to ``obj`` (branches may be missing) of destinations: a
            tensor of the same shape, dtype and device there receives the copy in place (no new
            memory); ``obj``'s own tensor there means "keep it" (the caller copies it anyway).
    """
    from flashckpt.shm import anonymous_buffer

    dests: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # id(src): (src, dst)
    # A DTensor (a stateful object's sharded state) is copied as its local piece and wrapped
    # again: id(DTensor) -> (DTensor, its local piece, kept alive so its id stays unique).
    dtensors: dict[int, tuple[Any, torch.Tensor]] = {}

    def scan(o: Any, dst: Any) -> None:
        if isinstance(o, torch.Tensor):
            if is_dtensor(o):
                if id(o) not in dtensors:
                    with torch.no_grad():
                        dtensors[id(o)] = (o, o.to_local())  # type: ignore[attr-defined]
                o, dst = dtensors[id(o)][1], None
            # Same class too: a DTensor (its state is wrapped after this copy) is no target.
            fits = isinstance(dst, torch.Tensor) and (
                dst is o
                or (
                    type(dst) is type(o)
                    and dst.shape == o.shape
                    and dst.dtype == o.dtype
                    and dst.device == o.device
                )
            )
            dests.setdefault(id(o), (o, dst if fits else None))
        elif isinstance(o, dict):
            for k, v in o.items():
                scan(v, dst.get(k) if isinstance(dst, dict) else None)
        elif isinstance(o, list | tuple):
            same = isinstance(dst, list | tuple) and len(dst) == len(o)
            for i, v in enumerate(o):
                scan(v, dst[i] if same else None)

    scan(obj, into)
    align = 64
    cpu = [t for t, d in dests.values() if d is None and t.device.type == "cpu"]
    total = sum(-(-t.nbytes // align) * align for t in cpu)
    if total >= 1 << 20:
        mm, skip = anonymous_buffer(total)
        # frombuffer keeps `mm` mapped for as long as any view of it lives.
        block = torch.frombuffer(mm, dtype=torch.uint8)[skip : skip + total]
    else:
        block = torch.empty(total, dtype=torch.uint8)
    off = 0
    for t in cpu:
        dests[id(t)] = (t, block[off : off + t.nbytes].view(t.dtype).view(t.shape))
        off += -(-t.nbytes // align) * align
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for key, (t, d) in dests.items():
            if d is None:
                out[key] = t.clone()
            elif d is t:
                out[key] = t
            else:
                out[key] = d.copy_(t)

    def build(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            if id(o) in dtensors:
                from torch.distributed.tensor import DTensor

                local = out[id(dtensors[id(o)][1])]
                return DTensor.from_local(
                    local,
                    o.device_mesh,  # type: ignore[attr-defined]
                    o.placements,  # type: ignore[attr-defined]
                    run_check=False,
                    shape=o.shape,
                    stride=o.stride(),
                )
            return out[id(o)]
        if isinstance(o, dict):
            return {k: build(v) for k, v in o.items()}
        if isinstance(o, list):
            return [build(v) for v in o]
        if isinstance(o, tuple):
            return tuple(build(v) for v in o)
        return copy.copy(o)

    return build(obj)


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


_ARGUMENTS = (
    "model",
    "optimizer",
    "scheduler",
    "stateful",
    "per_rank",
    "extras",
    "process_group",
)
# Names other libraries use for these (difflib does not find them all).
_ALIASES = {
    "lr_scheduler": "scheduler",
    "sched": "scheduler",
    "optim": "optimizer",
    "interval": "every",
    "save_every": "every",
    "save_interval": "every",
    "checkpoint_every": "every",
    "path": "storage",
    "dir": "storage",
    "url": "storage",
    "root": "storage",
    "checkpoint_dir": "storage",
    "output_dir": "storage",
    "resume": "restore",
    "load": "restore",
    "keep_last": "keep",
    "save_total_limit": "keep",
    "group": "process_group",
    "pg": "process_group",
    "state": "stateful",
}


def _unknown_options(unknown: list[str]) -> str:
    """The message for unknown keywords: a suggestion per keyword, then every keyword taken."""
    valid = [*_ARGUMENTS, *CheckpointConfig.__dataclass_fields__]
    hints = []
    for name in unknown:
        close = _ALIASES.get(name) or next(
            iter(difflib.get_close_matches(name, valid, n=1, cutoff=0.6)), None
        )
        hints.append(f"{name!r} (did you mean {close!r}?)" if close else repr(name))
    return (
        f"checkpointing() got unknown keyword(s) {', '.join(hints)}. It takes: {', '.join(valid)}"
    )


def _check_scheduler_given(optimizer: torch.optim.Optimizer, stateful: Mapping[str, Any]) -> None:
    """Refuses an optimizer an LR scheduler drives (a scheduler writes ``initial_lr`` into its
    param groups) when no scheduler is checkpointed: a resume would restart the schedule."""
    if not any("initial_lr" in g for g in optimizer.param_groups):
        return
    for obj in stateful.values():
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
            getattr(obj, "optimizer", None) is optimizer and hasattr(obj, "get_last_lr")
        ):
            return
    raise ValueError(
        "the optimizer's param groups carry 'initial_lr': an LR scheduler drives it, but no "
        "scheduler is checkpointed, so a resume would silently restart the schedule (warm-up "
        "included) and train with other learning rates than an uninterrupted run. Pass "
        "scheduler=<your scheduler> (or put it in stateful=), or allow_unsaved_scheduler=True "
        "if the schedule is rebuilt on purpose"
    )


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
        raise TypeError(_unknown_options(unknown))
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
