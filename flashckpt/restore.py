"""Restore: the newest step every rank of this world can obtain, agreed on, read and applied."""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch

from flashckpt.layout import Layout, tensor_views, unflatten_state
from flashckpt.reading import read_rank, read_shard
from flashckpt.reshard import listed_steps
from flashckpt.rng import capture_rng
from flashckpt.snapshot import BadMemory, SlotMap, TornSnapshot
from flashckpt.storage import CorruptCheckpointError

if TYPE_CHECKING:
    from flashckpt.apply import Applier
    from flashckpt.config import CheckpointConfig
    from flashckpt.rankctx import RankContext
    from flashckpt.reshard import Resharder
    from flashckpt.snapshot import Snapshotter
    from flashckpt.storage import Storage

__all__ = ["Restorer"]

log = logging.getLogger("flashckpt")


class Restorer:
    """Restores a rank's state on entry (collective: every rank of the world runs it)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        config: CheckpointConfig,
        ctx: RankContext,
        storage: Storage | None,
        snap: Snapshotter,
        resharder: Resharder,
        applier: Applier,
    ) -> None:
        self.model = model
        self.config = config
        self.ctx = ctx
        self.storage = storage
        self.snap = snap
        self.resharder = resharder
        self.applier = applier
        self.step: int | None = None
        """The restored step (None: nothing restored)."""
        self.source: str | None = None
        """Where it came from (``restored_from``)."""
        self.seconds: float | None = None
        """How long the restore took (or looking for something to restore)."""
        self.info: dict[str, Any] = {}
        """Details of the restore for ``status()``."""

    def memory_steps(self) -> dict[int, tuple[SlotMap, dict[str, Any]]]:
        out: dict[int, tuple[SlotMap, dict[str, Any]]] = {}
        for sm in self.snap.slots:
            if sm is None:
                continue
            info = sm.slot.header()
            if info is None or not info.complete:
                continue
            meta = sm.slot.read_meta(info)
            if meta is None:
                continue
            own = int(meta.get("rank", self.ctx.rank)) == self.ctx.rank
            replicated = self.config.replicated and int(meta.get("num_shards", 1)) == 1
            if meta.get("world_size") != self.ctx.world:
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
                if not self.interchangeable(info.step, meta["private"].get("buffers_xxh")):
                    continue
            out[info.step] = (sm, meta)
        return out

    def interchangeable(self, step: int, buffers_xxh: int | None) -> bool:
        """Whether a replica's snapshot of ``step`` with this buffers hash can stand for this
        rank's own (whose RNG/extras and buffers hash are in storage)."""
        if self.storage is None:
            return False
        private = self.storage.read_private(step, self.ctx.rank, self.ctx.world)
        if private is None:
            return False
        return not self.buffers_matter() or (
            buffers_xxh is not None and private.get("buffers_xxh") == buffers_xxh
        )

    def buffers_matter(self) -> bool:
        """False where this rank's own buffers are overwritten before use: DDP with
        ``broadcast_buffers`` (the default) sends rank 0's to every rank at each forward."""
        ddp = torch.nn.parallel.DistributedDataParallel
        return not (
            isinstance(self.model, ddp) and self.model.broadcast_buffers and self.ctx.rank != 0
        )

    def run(self) -> None:
        t0 = time.perf_counter()
        mem = self.memory_steps()
        held = None if self.config.replicated else self.resharder.held_snapshots()
        stored = set(listed_steps(self.storage))
        excluded: set[int] = set()
        while True:
            plan = self.plan(mem, stored, excluded)
            peer = None if held is None else self.resharder.plan_peers(held, plan, excluded)
            if peer is not None:
                plan = (peer.step, {r: ("memory-reshard", -1) for r in range(self.ctx.world)})
            if plan is None:
                if mem or stored - excluded:
                    warnings.warn(
                        f"flashckpt: rank {self.ctx.rank} holds steps {sorted(mem)} in memory and "
                        f"{sorted(stored)} in storage, but no step can be obtained by every rank; "
                        "nothing restored",
                        stacklevel=3,
                    )
                self.applier.invalidate_after(self.snap, -1)
                self.seconds = time.perf_counter() - t0
                return
            step, sources = plan
            self.resharder.restore_info = {}
            code, loaded = 0, None
            memory_only = False
            err: Exception | None = None
            try:
                if peer is not None:
                    assert held is not None
                    loaded = self.resharder.load_peers(peer, held)
                else:
                    received = self.resharder.exchange_replicas(step, sources, mem)
                    loaded = self.load_step(step, sources[self.ctx.rank], mem.get(step), received)
            except BadMemory as e:
                # Only this copy is bad: the step may still come from storage (or a replica).
                code, err = 1, e
                mem.pop(step, None)
                memory_only = True
                warnings.warn(f"flashckpt: {e}; trying another source", stacklevel=3)
            except (CorruptCheckpointError, FileNotFoundError, TornSnapshot) as e:
                code, err = 1, e
                warnings.warn(
                    f"flashckpt: cannot restore step {step}: {e}; trying an older step",
                    stacklevel=3,
                )
            except (ValueError, TypeError, KeyError, RuntimeError) as e:
                code, err = 2, e
            self.info = self.resharder.restore_info
            worst = self.ctx.all_max(code)
            if worst == 0:
                assert loaded is not None
                self.applier.apply(*loaded)
                self.step = step
                self.source = sources[self.ctx.rank][0]
                self.seconds = time.perf_counter() - t0
                self.info.update(step=step, source=self.source, seconds=self.seconds)
                self.applier.invalidate_after(self.snap, step)
                return
            if worst == 2:
                if err is not None:
                    raise err
                raise RuntimeError(f"another rank failed to restore step {step}; see its log")
            # Every rank takes part: the step is excluded unless each failure was a bad copy in
            # memory (those ranks dropped it from their memory steps and plan again).
            if self.ctx.all_max(0 if code == 0 or memory_only else 1):
                excluded.add(step)

    def plan(
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
        if self.ctx.world == 1:
            cands = sorted({*my_mem, *my_st}, reverse=True)
            if not cands:
                return None
            return cands[0], {0: ("memory" if cands[0] in mem else "storage", 0)}
        mems, sts = self.ctx.gather_sets([my_mem, my_st], k)
        # Each rank's buffers hash of each step it holds: step -> hash, per rank.
        rows = self.ctx.gather_rows(
            [x for s in my_mem for x in (s, int(mem[s][1]["private"].get("buffers_xxh", -1)))],
            2 * k,
        )
        mem_hashes = [dict(zip(row[::2], row[1::2], strict=True)) for row in rows]
        union_mem = set().union(*mems)
        # Per rank: step -> the peer whose memory it can take that step from.
        privs: list[dict[int, int]] = [{} for _ in range(self.ctx.world)]
        if self.config.replicated and self.storage is not None:
            # Steps a replica holds in memory that this rank could take from it (a peer's
            # memory is preferred over storage, the slow path): the peer's snapshot must have
            # this rank's buffers (hash in the file written through, with its RNG/extras).
            have = []
            for s in sorted(union_mem - set(my_mem), reverse=True)[:k]:
                private = self.storage.read_private(s, self.ctx.rank, self.ctx.world)
                if private is None:
                    continue
                want = private.get("buffers_xxh") if self.buffers_matter() else None
                for q in sorted(
                    range(self.ctx.world), key=lambda q: (q - self.ctx.rank) % self.ctx.world
                ):
                    if s in mem_hashes[q] and want in (None, mem_hashes[q][s]):
                        have.append(s << 16 | q)
                        break
            (got,) = self.ctx.gather_sets([have], k)
            privs = [{v >> 16: v & 0xFFFF for v in g} for g in got]
        for s in sorted(union_mem.union(*sts), reverse=True):
            if all(s in mems[r] or s in sts[r] or s in privs[r] for r in range(self.ctx.world)):
                sources = {}
                for r in range(self.ctx.world):
                    if s in mems[r]:
                        sources[r] = ("memory", r)
                    elif s in privs[r]:
                        sources[r] = ("replica", privs[r][s])
                    else:
                        sources[r] = ("storage", r)
                return s, sources
        return None

    def load_step(
        self,
        step: int,
        source: tuple[str, int],
        mem: tuple[SlotMap, dict[str, Any]] | None,
        received: tuple[dict[str, Any], torch.Tensor] | None,
    ) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        """Reads one step into (state tree, private state, tensors-view-shared-memory)."""
        kind = source[0]
        if kind == "memory":
            assert mem is not None
            sm, meta = mem
            info = sm.slot.header()
            if info is None or info.step != step or not info.complete:
                raise TornSnapshot(f"slot {sm.slot.path} changed")
            self.snap.verify(sm, info, step)
            layout = Layout.from_json(meta["entries"])
            off = sm.slot.data_off
            views = tensor_views(layout, sm.data[off : off + layout.nbytes])
            state = unflatten_state(meta["skeleton"], views)
            state = self.resharder.resolve_sharded(step, state)
            self.applier.check_model(state)
            private = meta["private"]
            if int(meta.get("rank", self.ctx.rank)) != self.ctx.rank and self.storage is not None:
                private = self.storage.read_private(step, self.ctx.rank, self.ctx.world)
            return state, private, True
        assert self.storage is not None
        if kind == "replica":
            assert received is not None
            meta, data = received
            layout = Layout.from_json(meta["entries"])
            state = unflatten_state(meta["skeleton"], tensor_views(layout, data))
            state = self.resharder.resolve_sharded(step, state)
            self.applier.check_model(state)
            if (
                int(meta.get("rank", -1)) == self.ctx.rank
            ):  # the peer holds this rank's own snapshot
                private = meta["private"]
            else:
                private = self.storage.read_private(step, self.ctx.rank, self.ctx.world)
            return state, private, False
        manifest = self.storage.read_manifest(step)
        # A sharded step saved by another world size: any shard gives the unsharded part (the
        # same on every rank); the DTensor pieces are then resharded from all shards.
        shard = self.resharder.storage_shard(manifest)
        state = read_shard(self.storage, step, shard, manifest)
        state = self.resharder.resolve_sharded(step, state, manifest)
        self.applier.check_model(state)
        private = None
        if int(manifest["world_size"]) == self.ctx.world:
            private = read_rank(self.storage, step, self.ctx.rank, manifest)
        else:
            private = self.private_from_other_world(step, manifest)
        if private is None:
            log.warning(
                "flashckpt: no saved RNG/extras for rank %d at step %d", self.ctx.rank, step
            )
        return state, private, False

    def private_from_other_world(
        self, step: int, manifest: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Extras of a step saved by another world size: rank 0's. The RNG states stay as they
        are (the saved ones belong to other ranks)."""
        rank0 = read_rank(self.storage, step, 0, manifest) if self.storage else None
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
