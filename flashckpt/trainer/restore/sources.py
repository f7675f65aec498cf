"""The restore sources: where a rank can read a step from, each implementing
:class:`~flashckpt.trainer.restore.saved.RestoreSource` and returning a
:class:`~flashckpt.trainer.restore.saved.SavedStep`.

- :class:`MemorySource`: this rank's own snapshots in its shared-memory slots;
- :class:`MemoryReshardSource`: a sharded state rebuilt from the snapshots this world's ranks hold
  in memory (this machine's slots read in place, other machines' pieces sent over gloo), and,
  where the world size changed, from the replicas their node agents hold of lost machines'
  snapshots (``restored_from`` ``peer-reshard``);
- :class:`DataParallelSource`: a replicated state from a surviving replica's memory;
- :class:`ReplicaPullSource`: this rank's snapshot from another machine's memory, where the node
  agents replicate snapshots between machines (this rank's own machine was lost): this rank's
  agent pulls the replica into one of its slots, the rank reads it there as memory;
- :class:`StorageSource`: the committed steps in storage.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashckpt.errors import AgentError
from flashckpt.format.layout import Layout, tensor_views
from flashckpt.format.manifest import Manifest
from flashckpt.format.shm import MAGIC, slot_prefix
from flashckpt.format.snapmeta import SnapshotMeta
from flashckpt.format.storage import CorruptCheckpointError, Storage
from flashckpt.names import SLOT_SUFFIX_RE, slot_path
from flashckpt.offline.reading import read_rank, read_shard
from flashckpt.state.codec import piece_nodes, unflatten_state
from flashckpt.state.rng import capture_rng
from flashckpt.state.sharded import ShardedPiece
from flashckpt.trainer.restore.pieces import (
    HeldSnapshot,
    MemoryPiecesPlan,
    Placeholders,
    exchange,
    gather_json,
    plan_needs,
    views_of,
)
from flashckpt.trainer.restore.reshard import listed_steps
from flashckpt.trainer.restore.saved import SavedStep
from flashckpt.trainer.snapshot import BadMemory, SlotMap, TornSnapshot

if TYPE_CHECKING:
    from flashckpt.trainer.restore.saved import RestoreEnv, RestorePlan

__all__ = [
    "DataParallelSource",
    "K",
    "MemoryReshardSource",
    "MemorySource",
    "ReplicaPullSource",
    "StorageSource",
    "discarded_name",
    "world_conflict",
]

log = logging.getLogger("flashckpt")

K = 16
"""The newest steps of each source that planning considers."""


def _checked_meta(raw: Any, where: str) -> SnapshotMeta | None:
    """A snapshot description read from shared memory, validated (nothing read from shared
    memory is trusted); None, logged, where it fails its checks."""
    try:
        return SnapshotMeta.from_json(raw, where)
    except CorruptCheckpointError as e:
        log.warning("flashckpt: ignoring the snapshot in %s: %s", where, e)
        return None


def _bad_header(raw: bytes) -> str | None:
    """Why a slot whose header (its first bytes ``raw``) did not read is damaged, or None for
    a slot never written (its header all zero bytes) or one that is gone (no bytes)."""
    if not any(raw):
        return None
    if raw[: len(MAGIC)] != MAGIC:
        return f"its header is damaged (magic {raw[: len(MAGIC)]!r}, not {MAGIC!r})"
    return "its header is damaged (its CRC does not match)"


def discarded_name(path: str, step: int | None) -> str:
    """``the snapshot of step N in <path>`` (the step left out where the header is damaged)."""
    return f"the snapshot in {path}" if step is None else f"the snapshot of step {step} in {path}"


class MemorySource:
    """This rank's own snapshots in its shared-memory slots (checked against their data hash
    before use)."""

    name = "memory"
    whole_world = False

    def __init__(self, env: RestoreEnv) -> None:
        self.env = env
        self.discarded: list[tuple[str, str, int | None]] = []
        """(slot path, why, its step where the header still names it) of the snapshots in this
        rank's slots found damaged and not used: every part of a slot (header, description,
        data) is checked, and the restore names each again with the step and source it used
        instead (issue 41: a damaged description fell back to storage silently)."""
        env.mem = self._scan()

    def _scan(self) -> dict[int, tuple[SlotMap, dict[str, Any]]]:
        env, ctx = self.env, self.env.ctx
        out: dict[int, tuple[SlotMap, dict[str, Any]]] = {}
        for i, sm in enumerate(env.snap.slots):
            if sm is None:
                # The agent serves no slot whose header fails its check: the file it left in
                # its place (replaced at the first save) says why this position has none.
                self._discard(self._unserved_header(i))
                continue
            info = sm.slot.header()
            if info is None:
                self._discard((sm.slot.path, bytes(sm.slot.buf[:64])))
                continue
            if not info.complete:
                continue
            meta = sm.slot.read_meta(info)
            if meta is None:
                self._discard_damaged(sm.slot.path, info.step, sm.slot.meta_problem(info))
                continue
            try:
                m = SnapshotMeta.from_json(meta, sm.slot.path)
            except CorruptCheckpointError as e:
                self._discard_damaged(sm.slot.path, info.step, f"its description is invalid: {e}")
                continue
            if m.layout.nbytes > info.data_len:
                self._discard_damaged(
                    sm.slot.path,
                    info.step,
                    f"its sizes do not match: its description lists {m.layout.nbytes} B of "
                    f"tensors, its header {info.data_len} B of data",
                )
                continue
            own = m.rank == ctx.rank
            replicated = env.config.replicated and m.num_shards == 1
            if m.world_size != ctx.world:
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
                if not replicated:
                    continue
                if not self._interchangeable(info.step, m.private.get("buffers_xxh")):
                    continue
            out[info.step] = (sm, meta)
        return out

    def _unserved_header(self, index: int) -> tuple[str, bytes] | None:
        """(path, first bytes) of this rank's slot file ``index`` the agent did not serve, or
        None when there is none."""
        ctx, shm_dir = self.env.ctx, self.env.snap.shm_dir
        if not shm_dir:
            return None
        path = slot_path(shm_dir, ctx.job, ctx.node, ctx.local_rank, index)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            return path, os.pread(fd, 64, 0)
        except OSError:
            return None
        finally:
            os.close(fd)

    def _discard(self, found: tuple[str, bytes] | None) -> None:
        """Warns of a snapshot in this rank's slot not used for a damaged header."""
        why = _bad_header(found[1]) if found is not None else None
        if found is None or why is None:
            return
        self._discard_damaged(found[0], None, why)

    def _discard_damaged(self, path: str, step: int | None, why: str | None) -> None:
        """Warns of a snapshot in this rank's slot ``path`` not used because ``why`` (None: it
        was being rewritten, a torn read and no damage: nothing to say). The restore names it
        again with the step and the source it used instead, see
        :class:`~flashckpt.trainer.restore.pipeline.Restorer`."""
        if why is None:
            return
        self.discarded.append((path, why, step))
        log.warning(
            "flashckpt: rank %d: %s is not used: %s; the restore takes the newest step from "
            "the other sources (storage, mirror, peers)",
            self.env.ctx.rank,
            discarded_name(path, step),
            why,
        )

    def _interchangeable(self, step: int, buffers_xxh: int | None) -> bool:
        """Whether a replica's snapshot of ``step`` with this buffers hash can stand for this
        rank's own (whose RNG/extras and buffers hash are in storage)."""
        env = self.env
        if env.storage is None:
            return False
        private = env.storage.read_private(step, env.ctx.rank, env.ctx.world)
        if private is None:
            return False
        return not env.buffers_matter() or (
            buffers_xxh is not None and private.get("buffers_xxh") == buffers_xxh
        )

    def offer(self, excluded: set[int], wanted: Callable[[int], bool]) -> list[int]:
        return sorted(set(self.env.mem) - excluded, reverse=True)

    def prepare(self, plan: RestorePlan) -> None:
        pass

    def read(self, plan: RestorePlan) -> SavedStep:
        env, step = self.env, plan.step
        sm, meta = env.mem[step]
        info = sm.slot.header()
        if info is None or info.step != step or not info.complete:
            raise TornSnapshot(f"slot {sm.slot.path} changed")
        try:
            env.snap.verify(sm, info, step)
        except BadMemory as e:
            # Named again with the step restored instead once there is one.
            self._discard_damaged(sm.slot.path, step, e.why or str(e))
            raise
        layout = Layout.from_json(meta["entries"])
        off = sm.slot.data_off
        views = tensor_views(layout, sm.data[off : off + layout.nbytes])
        state = unflatten_state(meta["skeleton"], views)
        private = meta["private"]
        if int(meta.get("rank", env.ctx.rank)) != env.ctx.rank and env.storage is not None:
            private = env.storage.read_private(step, env.ctx.rank, env.ctx.world)
        return SavedStep(step, self.name, state, private, shared=True)

    def drop(self, step: int) -> None:
        self.env.mem.pop(step, None)


class StorageSource:
    """The committed steps in storage (every file checked against the manifest), over both
    tiers where ``mirror=`` names a remote one: the storage root (node-local disk, typically)
    and the mirror root. A step either holds is offered; it is read from the storage root where
    that holds it (nearer), else from the mirror, and a step that fails its checks in one tier
    is read from the other (with a warning) before an older step is tried. ``restored_from``
    says which: ``storage`` or ``mirror``."""

    name = "storage"
    whole_world = False

    def __init__(self, env: RestoreEnv) -> None:
        self.env = env
        self.tiers: list[tuple[str, Storage]] = []
        """(name, root) of each tier, the storage root first."""
        if env.storage is not None:
            self.tiers.append(("storage", env.storage))
            mirror = getattr(env.config, "mirror", None)
            if mirror is not None:
                self.tiers.append(("mirror", Storage(mirror)))
        self.held = {name: set(listed_steps(st)) for name, st in self.tiers}
        """The committed steps of each tier."""
        env.stored = set().union(*self.held.values())

    def offer(self, excluded: set[int], wanted: Callable[[int], bool]) -> list[int]:
        return sorted(self.env.stored - excluded, reverse=True)

    def prepare(self, plan: RestorePlan) -> None:
        pass

    def read(self, plan: RestorePlan) -> SavedStep:
        step = plan.step
        tiers = [(n, st) for n, st in self.tiers if step in self.held[n]]
        if not tiers:
            raise FileNotFoundError(f"step {step} is committed in no storage tier")
        for i, (name, storage) in enumerate(tiers):
            try:
                return self._read(step, name, storage)
            except (CorruptCheckpointError, FileNotFoundError) as e:
                if i + 1 == len(tiers):
                    raise
                other = tiers[i + 1]
                warnings.warn(
                    f"flashckpt: cannot restore step {step} from {name} {storage.url}: {e}; "
                    f"reading it from {other[0]} {other[1].url}",
                    stacklevel=2,
                )
        raise AssertionError("unreachable")

    def _read(self, step: int, tier: str, storage: Storage) -> SavedStep:
        env, rank = self.env, self.env.ctx.rank
        manifest = storage.manifest(step)
        # A step of another world size is resharded from the pieces of the tier it is read
        # from (the fit stage that follows this read reads them).
        env.resharder.storage = storage
        # A sharded step saved by another world size: any shard gives the unsharded part (the
        # same on every rank); the DTensor pieces are then resharded from all shards.
        shard = env.resharder.storage_shard(manifest)
        state = read_shard(storage, step, shard, manifest)
        if manifest.world_size == env.ctx.world:
            private = read_rank(storage, step, rank, manifest)
        else:
            private = self._private_from_other_world(storage, step, manifest)
        if private is None:
            log.warning("flashckpt: no saved RNG/extras for rank %d at step %d", rank, step)
        return SavedStep(step, tier, state, private, manifest=manifest)

    def _private_from_other_world(
        self, storage: Storage, step: int, manifest: Manifest
    ) -> dict[str, Any] | None:
        """Extras of a step saved by another world size: rank 0's. The RNG states stay as they
        are (the saved ones belong to other ranks)."""
        rank0 = read_rank(storage, step, 0, manifest)
        if rank0 is None:
            return None
        log.info(
            "flashckpt: step %d was saved by %s ranks: extras from rank 0, RNG not restored",
            step,
            manifest.world_size,
        )
        return {
            "rng": capture_rng(),
            "extras": rank0.get("extras") or {},
            "other_world": manifest.world_size,
        }

    def drop(self, step: int) -> None:
        pass


REPLICA_SUFFIX_RE = re.compile(r"rep\.([A-Za-z0-9_-]{1,64})\.r(\d{5})")
"""What follows :func:`~flashckpt.names.slot_prefix` (of the holding machine) in the name of a
replica file (:func:`~flashckpt.names.replica_path`): groups sender node, rank. A file still
being received (``.in``) does not match."""

REPLICA_RESHARD = "peer-reshard"
"""``restored_from`` of a step resharded from memory where some old rank's snapshot came from
the replica that a node agent holds of another (lost) machine's."""


@dataclass(frozen=True, slots=True)
class _HeldReplica:
    """Where a held snapshot is a replica of another machine's (not this machine's slot)."""

    sender: str
    """The machine whose snapshot it is."""
    path: str
    """The replica file in this machine's agent's tmpfs."""
    sm: SlotMap
    info: Any
    """Its header when read (the data hash is checked against it)."""
    verify: bool
    """Whether this rank checks its data hash (one local rank per replica does)."""


class MemoryReshardSource:
    """A sharded state rebuilt from the snapshots this world's ranks hold in memory (this
    machine's slots are read in place; pieces of other machines travel over torch.distributed):
    every rank reads it together, after the world agreed on who sends what.

    Where the world size changed, the replicas this machine's node agent holds of other
    machines' snapshots (:mod:`flashckpt.agent.replicas.holder`) count as held too: a job that lost
    a machine and goes on smaller rebuilds the lost ranks' pieces from them (``restored_from`` is
    then ``peer-reshard``). A replica is checked like a slot (its description against
    its file and the job, its data hash before use); one that fails its hash is a
    :class:`BadMemory` (the step may still come from storage) and no rank uses it again in this
    restore. At the same world size a replica is :class:`ReplicaPullSource`'s (pulled into the
    replacement's own slot)."""

    name = "memory-reshard"
    whole_world = True

    def __init__(self, env: RestoreEnv) -> None:
        self.env = env
        # Index in the held snapshots -> (slot, header) this rank verifies before resharding.
        self.verify_slots: dict[int, tuple[SlotMap, Any]] = {}
        self.replicas: dict[int, _HeldReplica] = {}
        """Index in the held snapshots -> the replica it is (absent: this machine's slot)."""
        self.refused: set[tuple[str, str, int, int, str]] = set()
        """Replicas failed by some rank's data hash check: (holder node, sender node, old rank,
        step, world id), never used again in this restore (by any rank)."""
        self._failed_replicas: set[tuple[str, str, int, int, str]] = set()
        self.held = None if env.config.replicated else self._held_snapshots()
        self.plan: MemoryPiecesPlan | None = None
        self.plan_replicas: dict[int, tuple[str, str]] = {}
        """Old rank -> (holder node, sender node) of the plan's old ranks that a replica serves."""
        self._received: dict[int, dict[str, torch.Tensor]] = {}

    def _held_snapshots(self) -> list[HeldSnapshot]:
        """Complete snapshots of a sharded state this rank can read: those in every slot of this
        machine's node agent (its own, the other trainers' of this machine, and those of local
        ranks no trainer of this world uses when the machine runs fewer trainers than before),
        then the replicas that agent holds of other machines' snapshots taken at another world
        size. Shared memory is shared: a piece on this machine is never sent over the network.
        """
        snap, ctx = self.env.snap, self.env.ctx
        snap.orphans = []
        others = []
        for path, lr in self._machine_slot_paths():
            try:
                sm = snap.map(path)
            except (OSError, ValueError) as e:
                log.debug("flashckpt: cannot map slot %s: %s", path, e)
                continue
            others.append(sm)
            if lr >= ctx.local_world and lr % ctx.local_world == ctx.local_rank:
                snap.orphans.append(sm)  # no trainer owns it: this rank cleans it up
        maps: list[tuple[SlotMap, tuple[str, int] | None]] = [
            (sm, None) for sm in snap.slots if sm is not None
        ]
        maps += [(sm, None) for sm in others]
        for path, sender, rank in self._replica_paths():
            try:
                maps.append((snap.map(path), (sender, rank)))
            except (OSError, ValueError) as e:
                log.debug("flashckpt: cannot map replica %s: %s", path, e)
        # Each slot of the machine is verified (data hash) by one rank: its own trainer's, or,
        # for a position no trainer uses now, the rank that cleans it up.
        mine = {id(sm) for sm in snap.slots if sm is not None} | {id(sm) for sm in snap.orphans}
        self.verify_slots, self.replicas = {}, {}
        out: list[HeldSnapshot] = []
        for sm, rep in maps:
            info = sm.slot.header()
            meta = sm.slot.read_meta(info) if info is not None and info.complete else None
            m = _checked_meta(meta, sm.slot.path) if meta is not None else None
            if info is None or meta is None or m is None:
                continue
            if m.num_shards <= 1 and not any(True for _ in piece_nodes(m.skeleton)):
                continue  # not a sharded state
            layout_bytes = m.layout.nbytes
            why = self._unusable(m, info, rep)
            if why is not None:
                log.warning("flashckpt: rank %d: not resharding from %s: %s", ctx.rank,
                            sm.slot.path, why)  # fmt: skip
                continue
            if rep is not None and m.world_size == ctx.world:
                continue  # the same world size: ReplicaPullSource pulls it for its own rank
            off = sm.slot.data_off

            def check(sm: SlotMap = sm, step: int = info.step) -> bool:
                now = sm.slot.header()
                return now is not None and now.complete and now.step == step

            if rep is not None:
                # One local rank checks each replica's data hash (the same choice on each).
                self.replicas[len(out)] = _HeldReplica(
                    rep[0], sm.slot.path, sm, info, m.rank % ctx.local_world == ctx.local_rank
                )
            elif id(sm) in mine:
                self.verify_slots[len(out)] = (sm, info)
            out.append(
                HeldSnapshot(
                    step=info.step,
                    world_id=m.world_id,
                    world_size=m.world_size,
                    rank=m.rank,
                    meta=meta,
                    data=sm.data[off : off + layout_bytes],
                    check=check,
                )
            )
        return out

    def _unusable(self, m: SnapshotMeta, info: Any, rep: tuple[str, int] | None) -> str | None:
        """Why a held snapshot's description does not fit its slot or this job (nothing read
        from shared memory is trusted), or None."""
        ctx = self.env.ctx
        if m.job != ctx.job:
            return f"it is a snapshot of job {m.job!r}, not {ctx.job!r}"
        if m.step != info.step:
            return f"its description is of step {m.step}, its header of step {info.step}"
        if m.layout.nbytes > info.data_len:
            return f"its layout needs {m.layout.nbytes} B of data, the slot holds {info.data_len}"
        if rep is not None and m.rank != rep[1]:
            return f"it is named the replica of rank {rep[1]} but describes rank {m.rank}'s state"
        return None

    def _node_files(self, suffix: re.Pattern[str]) -> list[tuple[str, re.Match[str]]]:
        """(path, match) of the files in this node's shm directory named with this job's and
        node's prefix and a suffix ``suffix`` matches whole, by name (confined to it)."""
        ctx, shm_dir = self.env.ctx, self.env.snap.shm_dir
        if not shm_dir:
            return []
        prefix = slot_prefix(ctx.job, ctx.node)
        try:
            names = os.listdir(shm_dir)
        except OSError:
            return []
        out = []
        for name in sorted(names):
            m = suffix.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
            if m is not None:
                out.append((os.path.join(shm_dir, name), m))
        return out

    def _machine_slot_paths(self) -> list[tuple[str, int]]:
        """(path, local rank) of the slots of the other local ranks of this job on this node."""
        me = self.env.ctx.local_rank
        return [
            (p, int(m.group(1)))
            for p, m in self._node_files(SLOT_SUFFIX_RE)
            if int(m.group(1)) != me
        ]

    def _replica_paths(self) -> list[tuple[str, str, int]]:
        """(path, sender node, global rank) of the replicas this machine's agent holds of other
        machines' snapshots of this job (files in its directory, by name: confined to it)."""
        node = self.env.ctx.node
        if not node:
            return []
        return [
            (p, m.group(1), int(m.group(2)))
            for p, m in self._node_files(REPLICA_SUFFIX_RE)
            if m.group(1) != node
        ]

    def _ident(self, i: int, h: HeldSnapshot) -> tuple[str, str, int, int, str] | None:
        rep = self.replicas.get(i)
        if rep is None:
            return None
        return self.env.ctx.node, rep.sender, h.rank, h.step, h.world_id

    def _usable(self) -> list[tuple[int, HeldSnapshot]]:
        """(index, snapshot) of the held snapshots not refused, this machine's slots first."""
        held = self.held or []
        usable = [
            (i, h)
            for i, h in enumerate(held)
            if (ident := self._ident(i, h)) is None or ident not in self.refused
        ]
        return sorted(usable, key=lambda ih: (ih[0] in self.replicas, ih[0]))

    def offer(self, excluded: set[int], wanted: Callable[[int], bool]) -> list[int]:
        """Agrees (collectively) on a sharded step this world can rebuild from the snapshots its
        ranks hold in memory, newer than the plan so far (``wanted``), and on who sends what."""
        self.plan, self.plan_replicas = None, {}
        held, ctx = self.held, self.env.ctx
        if held is None:  # a replicated state (the same on every rank)
            return []
        rows = gather_json(
            {
                "node": ctx.node,
                "held": [
                    [h.step, h.world_id, h.world_size, h.rank, self._sender(i)]
                    for i, h in enumerate(held)
                ],
                "refused": [list(x) for x in sorted(self._failed_replicas)],
            },
            ctx.world,
            ctx.coord_pg,
        )
        # A replica that failed its data hash on one rank is used by no rank (another local
        # rank of that machine maps the same file).
        for row in rows:
            self.refused |= {
                (str(a), str(b), int(c), int(d), str(e)) for a, b, c, d, e in row["refused"]
            }
        # Old rank -> (new rank, holder node, sender node or "") that sends its snapshot: the
        # lowest rank that holds it in a slot of its machine, else the lowest holding a replica.
        groups: dict[tuple[int, str, int], dict[int, int]] = {}
        via: dict[tuple[int, str, int], dict[int, tuple[str, str]]] = {}
        for replicas in (False, True):
            for r, row in enumerate(rows):
                node = str(row["node"])
                for s, wid, w, o, sender in row["held"]:
                    if bool(sender) != replicas:
                        continue
                    key, o = (int(s), str(wid), int(w)), int(o)
                    if sender and (node, str(sender), o, key[0], key[1]) in self.refused:
                        continue
                    if o not in groups.setdefault(key, {}):
                        groups[key][o] = r
                        if sender:
                            via.setdefault(key, {})[o] = (node, str(sender))
        tries = 0
        for key in sorted(groups, key=lambda g: (-g[0], g[1], g[2])):
            step, wid, w = key
            if step in excluded:
                continue
            if not wanted(step):
                break
            tries += 1
            if tries > 3:
                break
            mine = self._mine_of(key)
            # One description per old rank travels: the designated holder's (the lowest rank
            # that holds it, the same choice on every rank).
            send = {str(o): h.meta for o, h in mine.items() if groups[key][o] == ctx.rank}
            metas: dict[int, dict[str, Any]] = {}
            for got in gather_json(send, ctx.world, ctx.coord_pg):
                for o, m in got.items():
                    metas.setdefault(int(o), m)
            code, base, requests = 0, -1, {}
            try:
                for o, m in metas.items():  # as sent by a peer: checked like a slot's
                    sm = SnapshotMeta.from_json(m, f"old rank {o}'s snapshot of step {step}")
                    if (sm.rank, sm.step, sm.world_id, sm.world_size) != (o, step, wid, w):
                        raise CorruptCheckpointError(
                            f"old rank {o}'s snapshot of step {step}",
                            f"describes rank {sm.rank}'s step {sm.step} of world {sm.world_id!r} "
                            f"({sm.world_size} ranks), not of world {wid!r} ({w} ranks)",
                        )
                if mine:
                    base = min(mine)
                else:
                    base = ctx.rank if w == ctx.world and ctx.rank in metas else min(metas)
                state = unflatten_state(metas[base]["skeleton"], Placeholders())
                boxes = [(t.piece.name, t.box) for t in self.env.resharder.piece_boxes(state)]
                requests = plan_needs(ctx.rank, ctx.world, metas, set(mine), boxes, base)
            except Exception as e:  # any: the other ranks wait in the all-reduce below
                code = 1
                log.info("flashckpt: step %d cannot be resharded from memory: %s", step, e)
            if ctx.all_max(code) == 0:
                self.plan = MemoryPiecesPlan(step, wid, w, metas, groups[key], base, requests)
                self.plan_replicas = dict(via.get(key, {}))
                return [step]
        return []

    def _sender(self, i: int) -> str:
        rep = self.replicas.get(i)
        return rep.sender if rep is not None else ""

    def _mine_of(self, key: tuple[int, str, int]) -> dict[int, HeldSnapshot]:
        """Old rank -> the snapshot of ``key`` this rank reads it from: a slot of this machine
        where it holds one, else a replica (none that failed a data hash check)."""
        out: dict[int, HeldSnapshot] = {}
        for _, h in self._usable():
            if h.key == key:
                out.setdefault(h.rank, h)
        return out

    def _mine(self, plan: MemoryPiecesPlan) -> dict[int, HeldSnapshot]:
        return self._mine_of((plan.step, plan.world_id, plan.world_size))

    def _mine_replicas(self, plan: MemoryPiecesPlan) -> dict[int, tuple[int, _HeldReplica]]:
        """Old rank -> (index, replica) of the plan's snapshots this rank reads from a replica."""
        mine = self._mine(plan)
        out = {}
        for i, h in enumerate(self.held or []):
            rep = self.replicas.get(i)
            if rep is not None and mine.get(h.rank) is h:
                out[h.rank] = (i, rep)
        return out

    def prepare(self, plan: RestorePlan) -> None:
        """Verifies this rank's held snapshots of the step, then exchanges the pieces (every
        rank, when the plan is this source's).

        Raises:
            BadMemory: a replica this rank checks fails its data hash (after the exchange).
            TornSnapshot: a slot of this machine fails its data hash, or a snapshot changed.
        """
        peer, ctx = self.plan, self.env.ctx
        self._received = {}
        if plan.sources.get(ctx.rank) != self.name or peer is None:
            return
        key = (peer.step, peer.world_id, peer.world_size)
        # Checked before the exchange, reported after it (every rank takes part in it).
        bad: str | None = None
        for i, h in enumerate(self.held or []):
            entry = self.verify_slots.get(i)
            if entry is not None and h.key == key:
                try:
                    self.env.snap.verify(entry[0], entry[1], peer.step)
                except BadMemory as e:
                    bad = bad or str(e)
        bad_replica: str | None = None
        for o, (i, rep) in self._mine_replicas(peer).items():
            if not rep.verify:
                continue
            why = self._replica_problem(rep, peer.step)
            if why is not None:
                ident = self._ident(i, self.held[i]) if self.held else None
                if ident is not None:
                    self._failed_replicas.add(ident)
                bad_replica = bad_replica or (
                    f"rank {ctx.rank}: the replica of old rank {o}'s snapshot of step "
                    f"{peer.step} (of {peer.world_size} ranks, machine {rep.sender!r}'s) held "
                    f"by this machine's agent ({rep.path}) {why}; not resharded from it"
                )
        received, error = exchange(peer, ctx.rank, ctx.world, ctx.coord_pg, self._mine(peer))
        self._received = received
        if bad is not None:
            raise TornSnapshot(bad)
        if bad_replica is not None:
            raise BadMemory(bad_replica)
        if error is not None:
            raise TornSnapshot(error)

    def _replica_problem(self, rep: _HeldReplica, step: int) -> str | None:
        """Why a held replica must not be used (its data no longer hashes to the value its
        agent recorded as it arrived), or None."""
        now = rep.sm.slot.header()
        if now is None or now != rep.info or not now.complete or now.step != step:
            return "changed since it was listed"
        ok = rep.sm.slot.verify_data(rep.info)
        if ok is None:
            return "has no data hash to check it against"
        if not ok:
            return "fails its data hash: the shared memory was overwritten since it arrived"
        return None

    def read(self, plan: RestorePlan) -> SavedStep:
        """This rank's state of the step, its tensors viewing this machine's slots or what was
        received; its DTensor pieces are rebuilt from ``pieces`` when fitted."""
        peer, ctx = self.plan, self.env.ctx
        assert peer is not None and peer.step == plan.step
        mine, received = self._mine(peer), self._received
        views: dict[int, Mapping[str, torch.Tensor]] = {o: views_of(h) for o, h in mine.items()}
        views.update(received)
        pieces: dict[str, list[ShardedPiece]] = {}
        for o, v in views.items():
            for name, pm in piece_nodes(peer.metas[o]["skeleton"]):
                if name in v:
                    pieces.setdefault(name, []).append(ShardedPiece(v[name], pm, name))
        skeleton = peer.metas[peer.base]["skeleton"]
        state = unflatten_state(skeleton, Placeholders(views.get(peer.base, {})))
        if peer.world_size == ctx.world and ctx.rank in peer.metas:
            private = peer.metas[ctx.rank].get("private")
        else:
            # Another world size: the extras are rank 0's; the RNG states stay as they are.
            old0 = peer.metas.get(0, {}).get("private") or {}
            private = {
                "rng": capture_rng(),
                "extras": old0.get("extras") or {},
                "other_world": peer.world_size,
            }

        def check() -> str | None:
            if all(h.check() for h in mine.values()):
                return None
            return f"a snapshot of step {peer.step} changed while read"

        # Old ranks whose snapshot came from a replica: the plan's (sent by their holder) and
        # any this rank read from a replica of its own machine's agent.
        replicas = dict(self.plan_replicas)
        for o, (_, rep) in self._mine_replicas(peer).items():
            replicas.setdefault(o, (ctx.node, rep.sender))
        info: dict[str, Any] = {
            "saved_world_size": peer.world_size,
            "received_from_old_ranks": sorted(received),
            "received_bytes": sum(t.nbytes for got in received.values() for t in got.values()),
        }
        note = (
            f"flashckpt: rank {ctx.rank} rebuilt step {peer.step} (saved by "
            f"{peer.world_size} ranks) from memory; received from old ranks {sorted(received)}"
        )
        if replicas:
            info["replica_of_old_ranks"] = sorted(replicas)
            info["replica_senders"] = sorted({s for _, s in replicas.values()})
            info["replica_holders"] = sorted({h for h, _ in replicas.values()})
            note += (
                f"; old ranks {sorted(replicas)} from the replicas of machines "
                f"{info['replica_senders']} held by the agents of {info['replica_holders']}"
            )
        return SavedStep(
            peer.step,
            REPLICA_RESHARD if replicas else self.name,
            state,
            private,
            pieces=pieces,
            shared=True,
            check=check,
            info=info,
            note=note,
        )

    def drop(self, step: int) -> None:
        # A replica that failed its data hash check here is refused from the next offer on
        # (by every rank: the offer gathers it).
        pass


class DataParallelSource:
    """For a data-parallel state: a surviving data-parallel twin's snapshot in memory (another
    rank holding the same parameters), sent over torch.distributed; this rank's RNG states and
    extras then come from the small per-rank file the agent writes through at each snapshot
    (with its buffers hash, which the twin's must match). Not a *replica*: that word means a
    copy in another machine's node agent memory (:class:`ReplicaPullSource`).

    Its ``name`` ("replica") is what restore reports print and stays as it was."""

    name = "replica"
    whole_world = False

    def __init__(self, env: RestoreEnv) -> None:
        self.env = env
        self.peer_of: list[dict[int, int]] = []
        """Per rank: step -> the rank whose memory it takes that step from."""
        self._received: tuple[dict[str, Any], torch.Tensor] | None = None

    def offer(self, excluded: set[int], wanted: Callable[[int], bool]) -> list[int]:
        """Steps a replica holds in memory that this rank could take from it (a peer's memory
        is preferred over storage, the slow path): the peer's snapshot must have this rank's
        buffers (hash in the file written through, with its RNG/extras)."""
        env, ctx = self.env, self.env.ctx
        self.peer_of = [{} for _ in range(ctx.world)]
        if ctx.world == 1 or not env.config.replicated or env.storage is None:
            return []
        my_mem = sorted(set(env.mem) - excluded, reverse=True)[:K]
        (mems,) = ctx.gather_sets([my_mem], K)
        # Each rank's buffers hash of each step it holds: step -> hash, per rank.
        rows = ctx.gather_rows(
            [x for s in my_mem for x in (s, int(env.mem[s][1]["private"].get("buffers_xxh", -1)))],
            2 * K,
        )
        mem_hashes = [dict(zip(row[::2], row[1::2], strict=True)) for row in rows]
        union_mem: set[int] = set().union(*mems)
        have = []
        for s in sorted(union_mem - set(my_mem), reverse=True)[:K]:
            private = env.storage.read_private(s, ctx.rank, ctx.world)
            if private is None:
                continue
            want = private.get("buffers_xxh") if env.buffers_matter() else None
            for q in sorted(range(ctx.world), key=lambda q: (q - ctx.rank) % ctx.world):
                if s in mem_hashes[q] and want in (None, mem_hashes[q][s]):
                    have.append(s << 16 | q)
                    break
        (got,) = ctx.gather_sets([have], K)
        self.peer_of = [{v >> 16: v & 0xFFFF for v in g} for g in got]
        return sorted(self.peer_of[ctx.rank], reverse=True)

    def prepare(self, plan: RestorePlan) -> None:
        """Sends this rank's snapshot of the step to the ranks that restore from it; receives
        one if this rank needs it. Every rank walks the same plan, so sends and receives pair."""
        dist, ctx, step, mem = torch.distributed, self.env.ctx, plan.step, self.env.mem
        self._received = None
        received = None
        failure: Exception | None = None
        bad: CorruptCheckpointError | None = None
        for r in sorted(plan.sources):
            if plan.sources[r] != self.name:
                continue
            src = self.peer_of[r][step]
            if ctx.rank == src:
                # Whatever goes wrong here, the peer gets a header: it must not wait in recv
                # until the gloo timeout.
                try:
                    sm, meta = mem[step]
                    info = sm.slot.header()
                    ok = info is not None and info.complete and info.step == step
                    if ok:
                        self.env.snap.verify(sm, info, step)  # never sends scribbled bytes
                    meta_b = json.dumps(meta).encode() if ok else b""
                    entries = meta.get("entries") if ok else None
                    n = Layout.from_json(entries).nbytes if entries else 0
                except Exception as e:  # reported after the exchange
                    ok, meta_b, n = False, b"", 0
                    failure = failure or e
                head = torch.tensor([len(meta_b) if ok else -1, n or 0], dtype=torch.int64)
                dist.send(head, r, group=ctx.coord_pg)
                if ok:
                    dist.send(
                        torch.frombuffer(bytearray(meta_b), dtype=torch.uint8),
                        r,
                        group=ctx.coord_pg,
                    )
                    off = sm.slot.data_off
                    if n:
                        dist.send(sm.data[off : off + n], r, group=ctx.coord_pg)
            elif ctx.rank == r:
                head = torch.empty(2, dtype=torch.int64)
                dist.recv(head, src, group=ctx.coord_pg)
                meta_len, n = (int(x) for x in head.tolist())
                if meta_len < 0:
                    raise TornSnapshot(f"rank {src}'s snapshot of step {step} changed")
                meta_t = torch.empty(meta_len, dtype=torch.uint8)
                dist.recv(meta_t, src, group=ctx.coord_pg)
                data = torch.empty(n, dtype=torch.uint8)
                if n:
                    dist.recv(data, src, group=ctx.coord_pg)
                where = f"rank {src}'s snapshot of step {step}"
                try:  # as sent by a peer: checked like a slot's, and against the bytes sent
                    doc = json.loads(meta_t.numpy().tobytes())
                    if SnapshotMeta.from_json(doc, where).layout.nbytes != n:
                        raise CorruptCheckpointError(where, f"does not describe its {n} bytes")
                    received = (doc, data)
                except CorruptCheckpointError as e:
                    bad = e
                except ValueError as e:
                    bad = CorruptCheckpointError(where, f"is not JSON ({e})")
        self._received = received
        if bad is not None:
            raise bad
        if failure is not None:
            raise TornSnapshot(f"this rank's snapshot of step {step} cannot be sent: {failure}")

    def read(self, plan: RestorePlan) -> SavedStep:
        env, step, rank = self.env, plan.step, self.env.ctx.rank
        assert self._received is not None and env.storage is not None
        meta, data = self._received
        layout = Layout.from_json(meta["entries"])
        state = unflatten_state(meta["skeleton"], tensor_views(layout, data))
        if int(meta.get("rank", -1)) == rank:  # the peer holds this rank's own snapshot
            private = meta["private"]
        else:
            private = env.storage.read_private(step, rank, env.ctx.world)
        return SavedStep(step, self.name, state, private)

    def drop(self, step: int) -> None:
        pass


class ReplicaPullSource:
    """This rank's snapshot of a step from a peer machine's memory: the node agents replicate
    each machine's newest snapshot to another machine (:mod:`flashckpt.agent.replicas.holder`); a
    rank whose own memory lacks a step (its machine was lost, this one replaces it) has its own
    agent pull the replica into one of its slots (``pull_replica``, hash-verified as it arrives),
    then reads it there like its own memory, the data hash checked again before use.

    ``offer`` only asks what the peers hold (nothing moves); the replica is fetched in
    ``prepare``, once the ranks agreed on its step and this rank reads from here. A replica that
    fails its hash, is gone, or cannot be fetched is a :class:`BadMemory` (a warning naming
    rank, step and source; the step may still come from storage, else an older one is agreed).
    """

    name = "peer-memory"
    whole_world = False

    def __init__(self, env: RestoreEnv) -> None:
        self.env = env
        self.found: Any = None
        """What the last offer found (the agent's ``PullReplicaReply``), or None."""
        self.dropped: set[int] = set()
        """Steps whose replica failed (never offered again in this restore)."""
        self.pulled: tuple[SlotMap, Any, Any] | None = None
        """(slot, its header, the pull's reply) of the replica fetched for the plan."""
        self.phases_s: dict[str, float] = {}
        """Seconds of each phase of this rank's peer-memory restore: ``offer.ask`` (the agent
        asking its peers), ``offer.gather`` (the ranks comparing worlds), ``pull`` (the agent's
        fetch, as this rank waited for it), ``map``, ``verify``; the agent's own phases of the
        fetch as ``agent.<phase>``. In the restore's ``info`` (``pull_phases_s``)."""

    def _link(self) -> Any:
        link = getattr(self.env.snap, "link", None)
        return link if link is not None and link.alive() else None

    def offer(self, excluded: set[int], wanted: Callable[[int], bool]) -> list[int]:
        """The newest step a peer agent holds a replica of this rank's snapshot of, for a step
        this rank's own memory lacks (a question to the agent: nothing is fetched yet).

        Collective: the ranks then compare the worlds their snapshots of each step were taken
        in. A replica of a step that another rank holds from another world (an abandoned
        timeline's step of the same number) is not offered: mixing them would be a state no
        run ever had."""
        env, ctx = self.env, self.env.ctx
        self.found = None
        t = time.perf_counter()
        reply = self._query()
        self.phases_s["offer.ask"] = time.perf_counter() - t
        t = time.perf_counter()
        cand: list[Any] | None = None
        if reply is not None:
            step = int(reply.step)
            if step not in excluded and step not in self.dropped and step not in env.mem:
                cand = [step, str(reply.world_id)]
        mem = {str(s): str(m.get("world_id", "")) for s, (_, m) in env.mem.items()}
        rows = gather_json({"mem": mem, "peer": cand}, ctx.world, ctx.coord_pg)
        self.phases_s["offer.gather"] = time.perf_counter() - t
        if cand is None:
            return []
        why = world_conflict(cand[0], cand[1], rows) or self._storage_conflict(cand[0], cand[1])
        if why is not None:
            log.warning(
                "flashckpt: rank %d: the replica of step %d held by %r (%s) is not used: %s",
                ctx.rank,
                cand[0],
                reply.holder if reply is not None else "?",
                reply.source if reply is not None else "?",
                why,
            )
            return []
        self.found = reply
        return [cand[0]]

    def _storage_conflict(self, step: int, world: str) -> str | None:
        """Why a replica of ``step`` taken in ``world`` must not be used while storage holds a
        committed ``step`` of another world (another timeline's step of that number: the other
        ranks may read theirs from there), or None. A manifest that records no world counts
        as another world's (the replica is then not used; storage serves the step)."""
        env = self.env
        if env.storage is None or step not in env.stored:
            return None
        stored = env.storage.manifest_world(step)
        if stored == world:
            return None
        return (
            f"it was taken in world {world!r}, but storage's committed step {step} is of world "
            f"{stored!r} (another timeline's step {step})"
        )

    def _query(self) -> Any:
        """What this rank's agent says the peers hold of this rank (None: nothing)."""
        link = self._link()
        if link is None:
            return None
        try:
            reply = link.pull_replica(min_step=0, fetch=False)
        except AgentError as e:  # an agent without replicas, or one of an older version
            log.debug("flashckpt: rank %d: no peer replica: %s", self.env.ctx.rank, e)
            return None
        if not reply.found:
            log.debug("flashckpt: rank %d: no peer replica: %s", self.env.ctx.rank, reply.reason)
            return None
        return reply

    def _where(self, step: int) -> str:
        f = self.found
        who = f"{f.holder!r} ({f.source})" if f is not None else "a peer agent"
        return f"rank {self.env.ctx.rank}: the replica of step {step} held by {who}"

    def prepare(self, plan: RestorePlan) -> None:
        """Has this rank's agent fetch the replica of the agreed step into one of this rank's
        slots (only where the plan reads this rank from here); no collective.

        Raises:
            BadMemory: the replica failed its data hash, is gone, or could not be fetched.
        """
        env, ctx, step = self.env, self.env.ctx, plan.step
        self.pulled = None
        if plan.sources.get(ctx.rank) != self.name:
            return
        where = self._where(step)
        link = self._link()
        if link is None:
            raise BadMemory(f"{where} cannot be fetched: no node agent; not restored from it")
        f = self.found
        world_id = f.world_id if f is not None else None
        t = time.perf_counter()
        try:
            # From the holder the offer found (the agent asks every peer again only if that one
            # no longer has it).
            reply = link.pull_replica(
                min_step=step,
                world_id=world_id,
                fetch=True,
                holder=f.holder if f is not None and f.step == step else None,
                sender=f.sender if f is not None and f.step == step else None,
            )
        except AgentError as e:
            raise BadMemory(f"{where} cannot be used: {e}; not restored from it") from None
        self.phases_s["pull"] = time.perf_counter() - t
        self.phases_s.update({f"agent.{k}": v for k, v in reply.phases_s.items()})
        t = time.perf_counter()
        if not reply.found or reply.path is None:
            raise BadMemory(f"{where} is no longer held ({reply.reason}); not restored from it")
        if reply.step != step or not 0 <= reply.slot < len(env.snap.slots):
            raise BadMemory(
                f"{where}: the agent pulled step {reply.step} into slot {reply.slot} instead; "
                "not restored from it"
            )
        try:
            sm = env.snap.map(reply.path)
        except (OSError, ValueError) as e:
            raise BadMemory(f"{where}: cannot map {reply.path}: {e}") from None
        info = sm.slot.header()
        if info is None or not info.complete or info.step != step:
            raise BadMemory(f"{where}: {reply.path} does not hold step {step} complete")
        with env.snap.slot_lock:
            old = env.snap.slots[reply.slot]
            # The agent replaced that slot's file: the old mapping holds nothing of this rank's
            # any more (the next snapshot goes into the new one).
            env.snap.slots[reply.slot] = sm
        if old is not None:
            for s in [s for s, (m, _) in env.mem.items() if m is old]:
                del env.mem[s]
        self.pulled = (sm, info, reply)
        self.phases_s["map"] = time.perf_counter() - t

    def read(self, plan: RestorePlan) -> SavedStep:
        """This rank's state of the step from the pulled replica (its data hash re-checked)."""
        env, ctx, step = self.env, self.env.ctx, plan.step
        assert self.pulled is not None, "read before prepare"
        sm, info, reply = self.pulled
        where = (
            f"rank {ctx.rank}: the replica of step {step} from {reply.holder!r} ({reply.source})"
        )
        now = sm.slot.header()
        if now is None or now != info:
            raise TornSnapshot(f"{where}: {sm.slot.path} changed")
        t = time.perf_counter()
        try:
            env.snap.verify(sm, info, step)
        except BadMemory as e:
            raise BadMemory(f"{where} fails its data hash ({e})") from None
        self.phases_s["verify"] = time.perf_counter() - t
        meta = sm.slot.read_meta(info)
        m = _checked_meta(meta, sm.slot.path) if meta is not None else None
        if meta is None or m is None:
            raise BadMemory(f"{where}: its description in {sm.slot.path} is unreadable")
        if m.rank != ctx.rank or m.world_size != ctx.world or m.step != step:
            raise BadMemory(
                f"{where} is rank {m.rank}'s step {m.step} of {m.world_size} ranks, not rank "
                f"{ctx.rank}'s of {ctx.world}"
            )
        off = sm.slot.data_off
        views = tensor_views(m.layout, sm.data[off : off + m.layout.nbytes])
        state = unflatten_state(meta["skeleton"], views)

        def check() -> str | None:
            cur = sm.slot.header()
            return None if cur == info else f"{sm.slot.path} changed while read"

        return SavedStep(
            step,
            self.name,
            state,
            meta["private"],
            shared=True,
            check=check,
            info={
                "replica_holder": reply.holder,
                "replica_source": reply.source,
                "replica_of": reply.sender,
                "replica_bytes": reply.bytes,
                "pull_phases_s": {k: round(v, 6) for k, v in self.phases_s.items()},
            },
            note=(
                f"flashckpt: rank {ctx.rank} restored step {step} from the replica held by "
                f"{reply.holder!r} ({reply.source}; {reply.bytes / 2**20:.1f} MiB, machine "
                f"{reply.sender!r}'s snapshot)"
            ),
        )

    def drop(self, step: int) -> None:
        self.dropped.add(step)
        self.pulled = None


def world_conflict(step: int, world: str, rows: list[Any]) -> str | None:
    """Why a replica of ``step`` taken in ``world`` must not be combined with what the ranks
    hold (``rows[rank]``: ``{"mem": {step: world id}, "peer": [step, world id] | None}`` as
    gathered), or None: every snapshot of that step, in memory or a replica, is of ``world``.
    Malformed rows (from a peer rank) count as a conflict."""
    worlds: dict[str, list[int]] = {}
    try:
        for r, row in enumerate(rows):
            mem, peer = row["mem"], row["peer"]
            if str(step) in mem:
                worlds.setdefault(str(mem[str(step)]), []).append(r)
            if peer is not None and int(peer[0]) == step:
                worlds.setdefault(str(peer[1]), []).append(r)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        return f"the ranks' descriptions of their snapshots are malformed ({e})"
    other = {w: rs for w, rs in worlds.items() if w != world}
    if not other:
        return None
    desc = "; ".join(f"ranks {rs} hold it from world {w!r}" for w, rs in sorted(other.items()))
    return f"it was taken in world {world!r}, but {desc} (another timeline's step {step})"
