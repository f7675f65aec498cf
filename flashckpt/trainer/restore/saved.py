"""The hand-offs of the restore pipeline: the plan every rank agrees on, the saved step a source
reads, and the interface every source implements (:mod:`flashckpt.trainer.restore.pipeline` runs
them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from flashckpt.format.manifest import Manifest
    from flashckpt.format.storage import Storage
    from flashckpt.state.sharded import ShardedPiece
    from flashckpt.trainer.config import CheckpointConfig
    from flashckpt.trainer.rankctx import RankContext
    from flashckpt.trainer.restore.reshard import Resharder
    from flashckpt.trainer.snapshot import SlotMap, Snapshotter

__all__ = ["RestoreEnv", "RestorePlan", "RestoreSource", "SavedStep"]


@dataclass(slots=True)
class SavedStep:
    """One rank's state of a step as a source read it; every source returns one of these."""

    step: int
    """The step (steps completed when it was saved)."""
    source: str
    """The name of the source that read it, what ``restored_from`` reports."""
    state: dict[str, Any]
    """The state tree (the skeleton with its tensors). DTensor pieces are still as saved: the
    pipeline fits them to this world's layout next."""
    private: dict[str, Any] | None
    """This rank's private state (RNG states, extras, per_rank); None where none was saved."""
    pieces: Mapping[str, list[ShardedPiece]] | None = None
    """DTensor pieces this world's ranks hold in memory, by tensor name, to rebuild this rank's
    pieces from; None: a piece that does not fit is rebuilt from storage."""
    manifest: Manifest | None = None
    """The manifest of the committed step read (storage), which resharding reads pieces from."""
    shared: bool = False
    """The tensors view shared memory (a slot the next snapshot overwrites): apply copies every
    one it keeps."""
    check: Callable[[], str | None] | None = None
    """After fitting: why the bytes read are no longer the step's (a slot changed meanwhile), or
    None while they are."""
    info: dict[str, Any] = field(default_factory=dict)
    """What ``status()["restore"]`` shows of this read."""
    note: str | None = None
    """A line logged once the step is fitted and checked."""

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"a saved step is >= 0, got {self.step}")
        if not self.source:
            raise ValueError("a saved step names the source that read it")


@dataclass(slots=True)
class RestorePlan:
    """The step every rank restores, and the source each rank reads it from."""

    step: int
    """The agreed step."""
    sources: dict[int, str]
    """Rank -> the name of the source it reads from (every rank of the world)."""
    tier: int
    """Its preference: the position in ``SOURCES`` of the least preferred source it uses (a
    lower tier wins at the same step)."""

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"a planned step is >= 0, got {self.step}")


@dataclass(slots=True)
class RestoreEnv:
    """What the sources of one restore share: the rank's collaborators and what it holds."""

    model: torch.nn.Module
    config: CheckpointConfig
    ctx: RankContext
    storage: Storage | None
    snap: Snapshotter
    resharder: Resharder
    mem: dict[int, tuple[SlotMap, dict[str, Any]]] = field(default_factory=dict)
    """The complete snapshots in this rank's own slots that can serve it, by step (found by the
    memory source; a replica is sent from them)."""
    stored: set[int] = field(default_factory=set)
    """The committed steps in storage (listed by the storage source)."""
    agent_root: tuple[str, list[int]] | None = None
    """A trainer without ``storage=``: its node agent's own root and the committed steps there
    at hello (where a fresh start needs ``overwrite=True`` too)."""

    def buffers_matter(self) -> bool:
        """False where this rank's own buffers are overwritten before use: DDP with
        ``broadcast_buffers`` (the default) sends rank 0's to every rank at each forward."""
        ddp = torch.nn.parallel.DistributedDataParallel
        return not (
            isinstance(self.model, ddp) and self.model.broadcast_buffers and self.ctx.rank != 0
        )


class RestoreSource(Protocol):
    """A place a rank can read a step from. One instance per restore, built from the
    :class:`RestoreEnv`; the pipeline calls the methods on every rank in the same order, so a
    source may run collectives in ``offer`` and ``prepare`` (never in ``read`` unless it is a
    ``whole_world`` source, which every rank reads together)."""

    name: str
    """What ``restored_from`` says of a step read from here."""
    whole_world: bool
    """Every rank reads a step from here or none does (the ranks rebuild it together); else
    each rank picks its own source for the agreed step."""

    def offer(self, excluded: set[int], wanted: Callable[[int], bool]) -> list[int]:
        """The steps this rank can read from here, not in ``excluded``. A whole-world source is
        asked after the per-rank sources, offers at most one step (the same on every rank), and
        only one for which ``wanted`` is true (better than the plan so far)."""
        ...

    def prepare(self, plan: RestorePlan) -> None:
        """Called on every rank once ``plan`` is agreed, before any read: a source that moves
        snapshots between ranks does it here, for the ranks that read from it.

        Raises:
            TornSnapshot: what this rank sent or received changed meanwhile (after the exchange
                is complete, so no peer waits).
        """
        ...

    def read(self, plan: RestorePlan) -> SavedStep:
        """This rank's state of ``plan.step``, for a rank whose plan names this source.

        Raises:
            BadMemory: a snapshot in memory fails its data hash (the step may still come from
                another source).
            TornSnapshot, CorruptCheckpointError, FileNotFoundError: this copy of the step cannot
                be read (an older step is tried).
            ValueError, TypeError, KeyError, RuntimeError: the step cannot be restored here at
                all (the restore fails).
        """
        ...

    def drop(self, step: int) -> None:
        """Forgets this rank's copy of ``step`` (it failed its data hash)."""
        ...
