"""The trainer's configuration (:class:`CheckpointConfig`), its counters (:class:`Stats`) and the
checks of what a user passes to :func:`flashckpt.checkpointing`."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from flashckpt.format.storage import (
    Storage,
    check_storage_options,
    is_local_url,
    use_storage_options,
)

__all__ = [
    "COPY_MODES",
    "PREFAULT_MODES",
    "CheckpointConfig",
    "Stats",
    "check_scheduler_given",
    "parse_mirror_every",
    "resolve_copy_mode",
    "resolve_prefault",
    "unknown_options",
]

COPY_MODES = ("auto", "overlap", "sync")
"""The values ``mode`` takes (in the config and in ``save(mode=...)``)."""

PREFAULT_MODES = ("auto", "entry", "background")
"""The values ``prefault`` takes."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """How a rank checkpoints."""

    storage: str | None = None
    """Checkpoint root URL (any fsspec URL); None keeps snapshots in memory only."""
    every: int | Literal["auto"] = "auto"
    """When ``ckpt.step()`` snapshots: ``"auto"`` (the default: the interval that minimises lost
    time, chosen after every snapshot), an int N (whenever the steps done are a multiple of N), or 0
    (only on ``save()`` and exit). docs/performance.md."""
    persist_every: int | str = "5m"
    """Which snapshots go to storage too (memory keeps every one): a duration ``"90s"``, ``"10m"``,
    ``"2h"`` (the first, then one when that long passed since the last one marked) or an int N (the
    first and every Nth). Why ``"5m"``: docs/persistence.md."""
    storage_options: dict[str, Any] | None = field(default=None, repr=False)
    """fsspec options of the object-store roots (``storage`` and ``mirror`` where not a local
    path): for ``s3://``, ``key``, ``secret``, ``token``, ``client_kwargs={"endpoint_url": ...,
    "region_name": ...}``, ``config_kwargs={"read_timeout": ...}`` (JSON values). They reach the
    node agent through a 0600 file, never a command line or a log; None: the backend's standard
    places (the environment, ``~/.aws``). docs/persistence.md."""
    mirror: str | None = None
    """A second, remote checkpoint root (any fsspec URL, e.g. ``s3://bucket/run1``):
    ``mirror_every`` of the persisted steps are copied there from ``storage`` (then node-local disk)
    and committed. Needs ``storage``; None: no remote tier. docs/persistence.md."""
    mirror_every: int | str = 10
    """Which persisted snapshots go to ``mirror`` too: an int N (the first and every Nth; 10, the
    default) or a duration ``"30m"`` (the ranks agree). The exit's final snapshot is mirrored
    too."""
    mtbf_s: float | None = None
    """With ``every="auto"``: the prior job MTBF in seconds (default: 50,000 GPU-hours per
    failure divided by the world size); failures seen during the run update it."""
    job: str | None = None
    """Job id (names segments and the agent). Default: $FLASHCKPT_JOB, then
    $TORCHELASTIC_RUN_ID (unless it is torchrun --standalone's random one and storage is
    given), then a hash of the storage URL."""
    node: str | None = None
    """Node id. Default: $FLASHCKPT_NODE, then the host name."""
    mode: Literal["auto", "overlap", "sync"] = "auto"
    """How a snapshot's bulk is copied into shared memory: ``"overlap"`` (in the background;
    ``optimizer.step()`` waits for it), ``"sync"`` (before ``save()`` returns) or ``"auto"`` (the
    default: picked at the first save, ``stats.copy_mode``). docs/performance.md."""
    prefault: Literal["auto", "entry", "background"] = "auto"
    """When the pages of fresh slots are populated: ``"entry"`` (before ``__enter__`` returns),
    ``"background"`` (in a thread beside training) or ``"auto"`` (the default: picked on entry,
    ``stats.prefault`` says what and why). docs/performance.md."""
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
    """Whether a run that starts from step 0 may take over a storage root that holds committed steps
    (they are deleted on entry); without it entry refuses. docs/training-loop.md."""
    takeover: bool = False
    """Whether this job may resume from a storage root (or mirror) whose newest committed step
    another job wrote (its manifest names the job); without it entry refuses.
    docs/training-loop.md."""
    allow_unsaved_scheduler: bool = False
    """Whether an optimizer driven by an LR scheduler (its param groups carry ``initial_lr``) may
    go without the scheduler in ``scheduler=`` or ``stateful=``. By default entry refuses: a
    resume would silently restart the schedule (warm-up included)."""
    on_persist_failure: Literal["raise", "warn"] = "raise"
    """What leaving the ``with`` block does when the final snapshot is not committed to storage
    (storage failed mid-run; training went on from memory): raise :class:`PersistError` (the
    job exits non-zero), or only log and warn."""
    replicated: bool | None = None
    """Whether all ranks hold the same model/optimizer state. None (the default): detected on entry
    (a DTensor with a ``Shard`` placement means sharded); ``ckpt.config.replicated`` holds the
    resolved value. docs/sharded.md."""
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
        parse_persist_every(self.persist_every)
        if self.mtbf_s is not None and not self.mtbf_s > 0:
            raise ValueError(f"mtbf_s={self.mtbf_s!r}: the job MTBF must be > 0 seconds")
        if self.mode not in COPY_MODES:
            raise ValueError(f"mode={self.mode!r}: use 'auto', 'overlap' or 'sync'")
        if self.prefault not in PREFAULT_MODES:
            raise ValueError(f"prefault={self.prefault!r}: use 'auto', 'entry' or 'background'")
        if self.when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy={self.when_busy!r}: use 'wait' or 'skip'")
        if self.keep < 1:
            raise ValueError(f"keep={self.keep}: keep at least 1 committed step")
        if self.agent not in ("auto", "connect"):
            raise ValueError(f"agent={self.agent!r}: use 'auto' or 'connect'")
        for name in ("restore", "overwrite", "takeover", "allow_unsaved_scheduler"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: use True or False")
        if self.on_persist_failure not in ("raise", "warn"):
            raise ValueError(
                f"on_persist_failure={self.on_persist_failure!r}: use 'raise' or 'warn'"
            )
        if self.storage_options is not None:
            opts = check_storage_options(self.storage_options)
            for url in (self.storage, self.mirror):
                if isinstance(url, str) and url and not is_local_url(url):
                    use_storage_options(url, opts)
        if self.storage is not None:
            Storage(self.storage)  # validates the URL early
        parse_mirror_every(self.mirror_every)
        if self.mirror is not None:
            if not isinstance(self.mirror, str) or not self.mirror:
                raise ValueError(f"mirror={self.mirror!r}: give a non-empty fsspec URL or None")
            if self.storage is None:
                raise ValueError(
                    f"mirror={self.mirror!r} without storage: the mirror copies steps persisted "
                    "to storage; pass storage= (node-local disk) too, or use the remote URL as "
                    "storage="
                )
            try:
                mirror = Storage(self.mirror)  # validates the URL early
            except ValueError as e:
                raise ValueError(f"mirror={self.mirror!r}: {e}") from None
            primary = Storage(self.storage)
            if type(mirror.fs) is type(primary.fs) and mirror.root == primary.root:
                raise ValueError(
                    f"mirror={self.mirror!r} is the storage root itself: give the mirror a "
                    "root of its own (a second file system or bucket), or drop mirror="
                )


def _off_cpu(device_types: set[str]) -> str:
    """The device types other than the CPU, comma-separated ("" when all is in host memory)."""
    return ", ".join(sorted(device_types - {"cpu"}))


def resolve_prefault(prefault: str, device_types: set[str], restored: bool) -> tuple[str, str]:
    """When the slots' pages are populated, and why: ``prefault`` itself unless it is ``"auto"``,
    which becomes ``"background"`` on a resume (``restored``: the first step after a failure
    comes first) or when any tensor lives off the CPU (``device_types``: the cores are mostly
    free while a GPU trains), and ``"entry"`` on a fresh start with the whole state in host
    memory (a background thread would compete with the cores that train).
    """
    if prefault not in PREFAULT_MODES:
        raise ValueError(f"prefault={prefault!r}: use 'auto', 'entry' or 'background'")
    if prefault != "auto":
        return prefault, f"prefault={prefault!r} configured"
    if restored:
        return "background", "prefault='auto': a resume (the first step comes first)"
    if gpu := _off_cpu(device_types):
        return "background", f"prefault='auto': the state has tensors on {gpu}"
    return "entry", "prefault='auto': a fresh start with the whole state in host memory"


def resolve_copy_mode(mode: str, device_types: set[str]) -> tuple[str, str]:
    """The copy mode a snapshot uses, and why: ``mode`` itself unless it is ``"auto"``, which
    becomes ``"overlap"`` when any of the state's tensors lives off the CPU (``device_types``
    holds their ``device.type``: a GPU copies by DMA on a side stream, the training cores stay
    free) and ``"sync"`` when all live in host memory (a background copy would run on the cores
    that train and only slow them down).

    Raises:
        ValueError: ``mode`` is none of :data:`COPY_MODES`.
    """
    if mode not in COPY_MODES:
        raise ValueError(f"mode={mode!r}: use 'auto', 'overlap' or 'sync'")
    if mode != "auto":
        return mode, f"mode={mode!r} configured"
    if gpu := _off_cpu(device_types):
        return "overlap", f"mode='auto': the state has tensors on {gpu}"
    return "sync", "mode='auto': the whole state lives in host memory"


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_persist_every(value: object) -> tuple[int | None, float | None]:
    """``persist_every`` as (every N snapshots, None) or (None, every T seconds).

    Raises:
        ValueError: neither a positive int nor a positive duration with a unit.
    """
    fix = "use a positive number of snapshots (int) or a duration such as '90s', '10m', '2h'"
    if isinstance(value, bool):
        raise ValueError(f"persist_every={value!r}: {fix}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"persist_every={value!r}: {fix}")
        return value, None
    if isinstance(value, str):
        text = value.strip().lower()
        unit = _UNITS.get(text[-1:]) if text else None
        try:
            seconds = float(text[:-1]) * unit if unit is not None else None
        except ValueError:
            seconds = None
        if seconds is not None and 0 < seconds < float("inf"):
            return None, seconds
    raise ValueError(f"persist_every={value!r}: {fix}")


def parse_mirror_every(value: object) -> tuple[int | None, float | None]:
    """``mirror_every`` as (every N persisted snapshots, None) or (None, every T seconds).

    Raises:
        ValueError: neither a positive int nor a positive duration with a unit.
    """
    try:
        return parse_persist_every(value)
    except ValueError:
        raise ValueError(
            f"mirror_every={value!r}: use a positive number of persisted snapshots (int) or a "
            "duration such as '90s', '30m', '2h'"
        ) from None


@dataclass(slots=True)
class Stats:
    """Counters of a checkpointer (all times in seconds)."""

    saves: int = 0
    persist_marked: int = 0
    """Snapshots marked for storage (``persist_every``); the others stay in memory only unless
    a flush, the exit or a trainer's death has them persisted."""
    persist_carried: int = 0
    """Of ``persist_marked``, the snapshots marked because the previous mark was lost: replaced
    in memory (or skipped) on some rank before its node agent began persisting it. The mark
    carries forward to the next snapshot, on every rank, until a node agent persisted one."""
    mirror_marked: int = 0
    """Snapshots marked for the remote tier (``mirror_every``, and the exit's final one)."""
    skips: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    last_snapshot_step: int | None = None
    last_committed_step: int | None = None
    last_persisted_step: int | None = None
    """The newest step this rank's node agent wrote its part of to storage (its commit follows
    once every machine's part is in)."""
    persisting_step: int | None = None
    """The step this rank's node agent is writing to storage now (its ``persisting`` event;
    None once it reported the step persisted or abandoned): a mark for storage whose snapshot
    left its slot while the agent writes it (from a copy, on slow storage) is pending, not lost."""
    persist_errors: list[dict[str, Any]] = field(default_factory=list)
    stall_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    first_save_s: float | None = None
    copy_mode: str | None = None
    """The copy mode snapshots use, ``"sync"`` or ``"overlap"``: the configured one, or what
    ``mode="auto"`` resolved to at the first save (None before it). ``save(mode=...)`` may
    override it for one snapshot."""
    copy_mode_reason: str | None = None
    """Why ``copy_mode`` is what it is (the devices ``mode="auto"`` found, or the config)."""
    prefault: str | None = None
    """How the slots' pages were populated, ``"entry"`` or ``"background"`` (the configured
    ``prefault``, or what ``"auto"`` resolved to on entry)."""
    prefault_reason: str | None = None
    """Why ``prefault`` is what it is."""
    prefault_wait_s: float = 0.0
    """Seconds ``__enter__`` waited for the slots' pages (``prefault="entry"``)."""
    entry_phases_s: dict[str, float] = field(default_factory=dict)
    """Where ``__enter__``'s time went, in order: ``join`` (the process group, the storage
    probes), ``hello`` (the node agent: found or started, told this rank, its slots mapped),
    ``restore`` (the restore pipeline, or looking for something to restore), ``timeline``,
    ``preallocate`` (both slots reserved), ``prefault`` (its wait at entry, or starting its
    thread); on a resume ``prefault`` comes before ``preallocate``, which then only checks
    the room of the slots a thread allocates. ``status()["entry"]``."""


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


def unknown_options(unknown: list[str]) -> str:
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


def check_scheduler_given(optimizer: torch.optim.Optimizer, stateful: Mapping[str, Any]) -> None:
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
