"""Resharding: a saved state fitted to this run's layout.

A saved DTensor piece whose box is the one this rank needs is used as is; the others (another
world size or mesh) are rebuilt from overlapping pieces: those this world's ranks still hold in
shared memory (exchanged over torch.distributed, :mod:`flashckpt.peers`) or those of the shards in
storage (:func:`flashckpt.reading.read_resharded`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashckpt.layout import Layout, piece_nodes, unflatten_state
from flashckpt.names import SLOT_SUFFIX_RE
from flashckpt.peers import (
    HeldSnapshot,
    PeerPlan,
    Placeholders,
    exchange,
    gather_json,
    plan_needs,
    views_of,
)
from flashckpt.reading import read_resharded
from flashckpt.rng import capture_rng
from flashckpt.sharded import (
    ShardedPiece,
    assemble,
    is_dtensor,
    placement_objects,
    replace_at,
    target_box,
    to_dtensor,
    walk_pieces,
)
from flashckpt.shm import slot_prefix
from flashckpt.snapshot import BadMemory, TornSnapshot

if TYPE_CHECKING:
    from flashckpt.config import CheckpointConfig
    from flashckpt.rankctx import RankContext
    from flashckpt.snapshot import SlotMap, Snapshotter
    from flashckpt.storage import Storage

__all__ = ["PieceTarget", "Resharder", "listed_steps"]

log = logging.getLogger("flashckpt")


def listed_steps(storage: Storage | None) -> list[int]:
    """The committed steps of a storage root; none (with a warning) where it cannot be listed."""
    if storage is None:
        return []
    try:
        return storage.committed_steps()
    except OSError as e:
        log.warning("flashckpt: cannot list storage %s: %s", storage.url, e)
        return []


@dataclass(slots=True)
class PieceTarget:
    """A saved DTensor piece and the DTensor this rank restores it as."""

    path: tuple[Any, ...]
    piece: ShardedPiece
    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    box: tuple[tuple[int, ...], tuple[int, ...]]


class Resharder:
    """Fits saved DTensor pieces to this world's meshes, and plans rebuilding a sharded step
    from the snapshots this world holds in memory."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        config: CheckpointConfig,
        ctx: RankContext,
        storage: Storage | None,
        snap: Snapshotter,
        hooks: list[Any],
        check_model: Callable[[dict[str, Any]], None],
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.ctx = ctx
        self.storage = storage
        self.snap = snap
        self._hooks = hooks  # removed by the checkpointer's teardown
        self.check_model = check_model
        self.restore_info: dict[str, Any] = {}
        """What a rebuild from memory tells ``status()`` (the old world, what was received)."""
        self.shm_dir: str | None = None
        # Index in the held snapshots -> (slot, header) this rank verifies before resharding.
        self.held_verify: dict[int, tuple[SlotMap, Any]] = {}
        self._opt_wrap: (
            dict[tuple[Any, ...], tuple[Any, tuple[Any, ...], tuple[int, ...]]] | None
        ) = None

    # -- snapshots this world holds in memory --------------------------------------------------
    def held_snapshots(self) -> list[HeldSnapshot]:
        """Complete snapshots of a sharded state this rank can read: those in every slot of this
        machine's node agent (its own, the other trainers' of this machine, and those of local
        ranks no trainer of this world uses when the machine runs fewer trainers than before).
        Shared memory is shared: a piece on this machine is never sent over the network.
        """
        self.snap.orphans = []
        others = []
        for path, lr in self.machine_slot_paths():
            try:
                sm = self.snap.map(path)
            except (OSError, ValueError) as e:
                log.debug("flashckpt: cannot map slot %s: %s", path, e)
                continue
            others.append(sm)
            if lr >= self.ctx.local_world and lr % self.ctx.local_world == self.ctx.local_rank:
                self.snap.orphans.append(sm)  # no trainer owns it: this rank cleans it up
        maps = [sm for sm in self.snap.slots if sm is not None] + others
        # Each slot of the machine is verified (data hash) by one rank: its own trainer's, or,
        # for a position no trainer uses now, the rank that cleans it up.
        mine = {id(sm) for sm in self.snap.slots if sm is not None} | {
            id(sm) for sm in self.snap.orphans
        }
        self.held_verify = {}
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

            def check(sm: SlotMap = sm, step: int = info.step) -> bool:
                now = sm.slot.header()
                return now is not None and now.complete and now.step == step

            if id(sm) in mine:
                self.held_verify[len(out)] = (sm, info)
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

    def machine_slot_paths(self) -> list[tuple[str, int]]:
        """(path, local rank) of the slots of the other local ranks of this job on this node."""
        shm_dir = self.shm_dir
        if not shm_dir:
            return []
        prefix = slot_prefix(self.ctx.job, self.ctx.node)
        try:
            names = os.listdir(shm_dir)
        except OSError:
            return []
        out = []
        for name in sorted(names):
            m = SLOT_SUFFIX_RE.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
            if m is not None and int(m.group(1)) != self.ctx.local_rank:
                out.append((os.path.join(shm_dir, name), int(m.group(1))))
        return out

    def plan_peers(
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
            [[h.step, h.world_id, h.world_size, h.rank] for h in held],
            self.ctx.world,
            self.ctx.coord_pg,
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
            send = {str(o): h.meta for o, h in mine.items() if groups[key][o] == self.ctx.rank}
            metas: dict[int, dict[str, Any]] = {}
            for got in gather_json(send, self.ctx.world, self.ctx.coord_pg):
                for o, m in got.items():
                    metas.setdefault(int(o), m)
            code, base, requests = 0, -1, {}
            try:
                if mine:
                    base = min(mine)
                else:
                    base = (
                        self.ctx.rank
                        if w == self.ctx.world and self.ctx.rank in metas
                        else min(metas)
                    )
                state = unflatten_state(metas[base]["skeleton"], Placeholders())
                boxes = [(t.piece.name, t.box) for t in self.piece_boxes(state)]
                requests = plan_needs(self.ctx.rank, self.ctx.world, metas, set(mine), boxes, base)
            except Exception as e:  # any: the other ranks wait in the all-reduce below
                code = 1
                log.info("flashckpt: step %d cannot be resharded from memory: %s", step, e)
            if self.ctx.all_max(code) == 0:
                return PeerPlan(step, wid, w, metas, groups[key], base, requests)
        return None

    def load_peers(
        self, plan: PeerPlan, held: list[HeldSnapshot]
    ) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        """Rebuilds this rank's state of a step from the snapshots held in this world's memory
        (collective: every rank calls it with the same plan)."""
        key = (plan.step, plan.world_id, plan.world_size)
        mine = {h.rank: h for h in held if h.key == key}
        # Checked before the exchange, reported after it (every rank takes part in it).
        bad: str | None = None
        for i, h in enumerate(held):
            entry = self.held_verify.get(i)
            if entry is not None and h.key == key:
                try:
                    self.snap.verify(entry[0], entry[1], plan.step)
                except BadMemory as e:
                    bad = bad or str(e)
        received, error = exchange(plan, self.ctx.rank, self.ctx.world, self.ctx.coord_pg, mine)
        if bad is not None:
            raise TornSnapshot(bad)
        if error is not None:
            raise TornSnapshot(error)
        views: dict[int, Mapping[str, torch.Tensor]] = {o: views_of(h) for o, h in mine.items()}
        views.update(received)
        pieces: dict[str, list[ShardedPiece]] = {}
        for o, v in views.items():
            for name, pm in piece_nodes(plan.metas[o]["skeleton"]):
                if name in v:
                    pieces.setdefault(name, []).append(ShardedPiece(v[name], pm, name))
        skeleton = plan.metas[plan.base]["skeleton"]
        state = unflatten_state(skeleton, Placeholders(views.get(plan.base, {})))
        state = self.resolve_sharded(plan.step, state, pieces=pieces)
        self.check_model(state)
        if not all(h.check() for h in mine.values()):
            raise TornSnapshot(f"a snapshot of step {plan.step} changed while read")
        if plan.world_size == self.ctx.world and self.ctx.rank in plan.metas:
            private = plan.metas[self.ctx.rank].get("private")
        else:
            # Another world size: the extras are rank 0's; the RNG states stay as they are.
            old0 = plan.metas.get(0, {}).get("private") or {}
            private = {
                "rng": capture_rng(),
                "extras": old0.get("extras") or {},
                "other_world": plan.world_size,
            }
        self.restore_info = {
            "saved_world_size": plan.world_size,
            "received_from_old_ranks": sorted(received),
            "received_bytes": sum(t.nbytes for got in received.values() for t in got.values()),
        }
        log.info(
            "flashckpt: rank %d rebuilt step %d (saved by %d ranks) from memory; received from "
            "old ranks %s",
            self.ctx.rank,
            plan.step,
            plan.world_size,
            sorted(received),
        )
        return state, private, True

    def exchange_replicas(
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
            if self.ctx.rank == src:
                # Whatever goes wrong here, the peer gets a header: it must not wait in recv
                # until the gloo timeout.
                try:
                    sm, meta = mem[step]
                    info = sm.slot.header()
                    ok = info is not None and info.complete and info.step == step
                    if ok:
                        self.snap.verify(sm, info, step)  # never sends scribbled bytes
                    meta_b = json.dumps(meta).encode() if ok else b""
                    entries = meta.get("entries") if ok else None
                    n = Layout.from_json(entries).nbytes if entries else 0
                except Exception as e:  # reported after the exchange
                    ok, meta_b, n = False, b"", 0
                    failure = failure or e
                head = torch.tensor([len(meta_b) if ok else -1, n or 0], dtype=torch.int64)
                dist.send(head, r, group=self.ctx.coord_pg)
                if ok:
                    dist.send(
                        torch.frombuffer(bytearray(meta_b), dtype=torch.uint8),
                        r,
                        group=self.ctx.coord_pg,
                    )
                    off = sm.slot.data_off
                    if n:
                        dist.send(sm.data[off : off + n], r, group=self.ctx.coord_pg)
            elif self.ctx.rank == r:
                head = torch.empty(2, dtype=torch.int64)
                dist.recv(head, src, group=self.ctx.coord_pg)
                meta_len, n = (int(x) for x in head.tolist())
                if meta_len < 0:
                    raise TornSnapshot(f"rank {src}'s snapshot of step {step} changed")
                meta_t = torch.empty(meta_len, dtype=torch.uint8)
                dist.recv(meta_t, src, group=self.ctx.coord_pg)
                data = torch.empty(n, dtype=torch.uint8)
                if n:
                    dist.recv(data, src, group=self.ctx.coord_pg)
                received = (json.loads(meta_t.numpy().tobytes()), data)
        if failure is not None:
            raise TornSnapshot(f"this rank's snapshot of step {step} cannot be sent: {failure}")
        return received

    # -- fitting pieces to this world ----------------------------------------------------------
    def sharded_targets(self) -> dict[tuple[Any, ...], Any]:
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

    def piece_boxes(self, state: dict[str, Any]) -> list[PieceTarget]:
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
        targets = self.sharded_targets()
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
            out.append(PieceTarget(path, piece, mesh, placements, shape, box))
        return out

    def resolve_sharded(
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
        for t in self.piece_boxes(state):
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
            state = self.put_sharded(state, t.path, local, t.mesh, t.placements, t.shape)
        if todo:
            if self.storage is None or step not in set(listed_steps(self.storage)):
                raise FileNotFoundError(
                    f"step {step} must be resharded for this world, but it is not committed to "
                    "storage"
                )
            got = read_resharded(self.storage, step, wants, manifest)
            for path, name, mesh, placements, shape in todo:
                state = self.put_sharded(state, path, got[name], mesh, placements, shape)
            log.info(
                "flashckpt: rank %d resharded %d tensors of step %d", self.ctx.rank, len(todo), step
            )
        return state

    def put_sharded(
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
                self.optimizer.register_load_state_dict_pre_hook(self.wrap_optimizer_pieces)
            )
        self._opt_wrap[path[1:]] = (mesh, placements, shape)
        return replace_at(state, path, local)

    def wrap_optimizer_pieces(self, optimizer: Any, state_dict: dict[str, Any]) -> Any:
        wrap, self._opt_wrap = self._opt_wrap, None
        if not wrap:
            return None
        for path, (mesh, placements, shape) in wrap.items():
            local: Any = state_dict
            for k in path:
                local = local[k]
            state_dict = replace_at(state_dict, path, to_dtensor(local, mesh, placements, shape))
        return state_dict

    def storage_shard(self, manifest: dict[str, Any]) -> int:
        """The shard of a committed step this rank reads: its own when the step was saved in this
        layout; else any (the unsharded part is the same in every shard, and DTensor pieces whose
        boxes differ are then resharded from all shards)."""
        if self.config.replicated:
            return 0
        return self.ctx.shard % int(manifest["num_shards"])
