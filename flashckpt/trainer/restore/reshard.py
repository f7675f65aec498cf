"""Resharding: a saved state fitted to this run's layout (the restore pipeline's fit stage).

A saved DTensor piece whose box is the one this rank needs is used as is; the others (another
world size or mesh) are rebuilt from overlapping pieces: those this world's ranks still hold in
shared memory, their own slots' or the replicas their node agents hold of lost machines'
(exchanged over torch.distributed, :mod:`flashckpt.trainer.restore.pieces`), or those of the shards
in storage (:func:`flashckpt.offline.reading.read_resharded`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashckpt.offline.reading import read_resharded
from flashckpt.state.sharded import (
    ShardedPiece,
    assemble,
    is_dtensor,
    placement_objects,
    replace_at,
    target_box,
    to_dtensor,
    walk_pieces,
)

if TYPE_CHECKING:
    from flashckpt.format.manifest import Manifest
    from flashckpt.format.storage import Storage
    from flashckpt.trainer.config import CheckpointConfig
    from flashckpt.trainer.rankctx import RankContext

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


def _flat_optimizer_fqn(path: tuple[Any, ...]) -> str | None:
    """The parameter a stateful object's flattened optimizer entry belongs to: torch's
    ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` (torchtitan's
    ``OptimizersContainer``) names a moment ``state.<parameter FQN>.<moment>``. A moment has its
    parameter's layout, so it is restored onto that parameter's mesh and placements (which a
    mesh of another shape, e.g. 2x2 -> 4x1, needs: the saved mesh does not say it)."""
    key = path[-1] if path and path[0] == "stateful" else None
    if not isinstance(key, str) or not key.startswith("state.") or key.count(".") < 2:
        return None
    return key[len("state.") :].rsplit(".", 1)[0]


class Resharder:
    """Fits saved DTensor pieces to this world's meshes (the pipeline's fit stage)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        config: CheckpointConfig,
        ctx: RankContext,
        storage: Storage | None,
        hooks: list[Any],
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.ctx = ctx
        self.storage = storage
        self._hooks = hooks  # removed by the checkpointer's teardown
        self._opt_wrap: (
            dict[tuple[Any, ...], tuple[Any, tuple[Any, ...], tuple[int, ...]]] | None
        ) = None

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
            fqn = _flat_optimizer_fqn(path) if target is None else None
            if fqn is not None and (
                default is None or default.device_mesh.ndim != len(piece.meta["mesh"])
            ):
                # only where the default mesh cannot take it (a mesh of another shape)
                # the model's key may carry a prefix (torchtitan's model parts: "0.<fqn>")
                hits = [
                    v
                    for k, v in targets.items()
                    if k[0] == "model" and (k[1] == fqn or str(k[1]).endswith("." + fqn))
                ]
                target = hits[0] if len(hits) == 1 else None
            if target is not None:
                if tuple(target.shape) != shape:
                    raise ValueError(
                        f"checkpoint tensor {where} has shape {list(shape)}, but the model's is "
                        f"{list(target.shape)}: restore into the same architecture, or start "
                        "from scratch (see below)"
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
        manifest: Manifest | None = None,
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

    def storage_shard(self, manifest: Manifest) -> int:
        """The shard of a committed step this rank reads: its own when the step was saved in this
        layout; else any (the unsharded part is the same in every shard, and DTensor pieces whose
        boxes differ are then resharded from all shards)."""
        if self.config.replicated:
            return 0
        return self.ctx.shard % manifest.num_shards
