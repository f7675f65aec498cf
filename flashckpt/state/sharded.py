"""Sharded state (DTensor, as FSDP2 and tensor parallelism hold it): save local pieces, reshard on
restore.

A DTensor is saved as its *local piece* plus a JSON description (global shape, the box of the
global tensor this rank holds, mesh shape and coordinate, placements). Nothing is gathered on the
save path.
On restore each rank computes the box its new DTensor needs (from the placements on the new mesh)
and fills it from the saved pieces that overlap it; when the boxes are the same (same world, same
mesh) its own piece is used as is.

Supported placements: ``Shard(dim)``, ``Replicate()`` and strided sharding on meshes of any rank
(FSDP2, TP, HSDP, FSDP2 + TP). Strided sharding is what FSDP2 gives a parameter that tensor
parallelism already shards on the same dim: ``(_StridedShard(d, split_factor=k), Shard(d))`` on a
(dp, tp) mesh, saved as ``{"shard": d, "split_factor": k}``. Each rank then holds one block (its TP
chunk, then its FSDP chunk of that), so it is saved and resharded like any other piece. A strided
layout where torch's placement does not give each rank exactly the block FSDP2 holds (3 or more
FSDP ranks on a dim that TP splits unevenly) raises an error naming the key. ``Partial``
(unreduced values) raises a clear error.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ShardedPiece",
    "assemble",
    "describe",
    "is_dtensor",
    "is_sharded_dtensor",
    "mesh_layout",
    "overlap_volume",
    "overlaps",
    "placement_objects",
    "replace_at",
    "target_box",
    "to_dtensor",
    "walk_pieces",
]


def is_dtensor(obj: object) -> bool:
    """Whether ``obj`` is a DTensor. Never imports torch.distributed.tensor (seconds): a DTensor
    can only exist once its module is loaded."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(obj, mod.DTensor)


def _is_shard(p: Any) -> bool:
    """Whether a placement splits a tensor dim over a mesh dim (``Shard`` or ``_StridedShard``,
    which is not a ``Shard`` subclass in every torch version)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(p, Shard | _StridedShard)


def is_sharded_dtensor(obj: object) -> bool:
    """Whether ``obj`` is a DTensor with a ``Shard`` (or strided) placement: its ranks hold
    different pieces."""
    if not is_dtensor(obj):
        return False
    return any(_is_shard(p) for p in obj.placements)  # type: ignore[attr-defined]


def mesh_layout(tensors: Iterable[Any], ranks: Iterable[int]) -> tuple[int, int, int] | None:
    """This rank's ``(shard, num_shards, replica)`` for persisting sharded DTensors once.

    The mesh dims some tensor is sharded on are shard dims; the others (HSDP's replicate dim)
    replicate dims. The ranks with the same coordinate on the shard dims hold the same pieces: the
    shard is that coordinate (row-major), the replica the coordinate on the replicate dims. Each
    piece's box depends only on the shard dims, so the ranks of replica 0 hold every piece.

    Args:
        tensors: the sharded DTensors of the state (others are skipped).
        ranks: the global ranks of the checkpointing world.

    Returns:
        None when the tensors are not all on one mesh spanning exactly ``ranks`` (then every rank
        must persist a shard of its own).
    """
    mesh: Any = None
    shard_dims: set[int] = set()
    for t in tensors:
        if not is_sharded_dtensor(t):
            continue
        if mesh is None:
            mesh = t.device_mesh
        elif t.device_mesh != mesh:
            return None
        shard_dims.update(i for i, p in enumerate(t.placements) if _is_shard(p))
    if mesh is None or sorted(mesh.mesh.flatten().tolist()) != sorted(ranks):
        return None
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    shard, num_shards, replica = 0, 1, 0
    for dim, (c, n) in enumerate(zip(coord, mesh.shape, strict=True)):
        if dim in shard_dims:
            shard, num_shards = shard * n + int(c), num_shards * n
        else:
            replica = replica * n + int(c)
    return shard, num_shards, replica


@dataclass(slots=True)
class ShardedPiece:
    """A saved local piece of a DTensor, with where it sits in the global tensor."""

    tensor: torch.Tensor
    meta: dict[str, Any]
    """JSON: ``shape`` (global), ``offset`` and ``local`` (the box), ``mesh``, ``coord``,
    ``placements``."""
    name: str = ""
    """The tensor's name in the checkpoint (the same on every rank)."""

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(self.meta["offset"]), tuple(self.meta["local"])


def _placement_json(p: Any, path: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):  # before Shard: a subclass of it in some torch versions
        return {"shard": int(p.dim), "split_factor": int(p.split_factor)}
    if type(p) is Shard:  # exactly Shard: a subclass may place its pieces differently
        return {"shard": int(p.dim)}
    if isinstance(p, Replicate):
        return "replicate"
    hint = " (Partial holds unreduced values: reduce them first)" if "Partial" in repr(p) else ""
    raise TypeError(
        f"state key {path!r}: DTensor placement {p!r} cannot be checkpointed as local pieces "
        f"(supported: Shard(dim), _StridedShard(dim, split_factor), Replicate()); redistribute "
        f"it to Shard/Replicate first{hint}"
    )


def _placement(obj: Any) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if obj == "replicate":
        return Replicate()
    if isinstance(obj, dict) and "shard" in obj:
        if "split_factor" in obj:
            return _StridedShard(int(obj["shard"]), split_factor=int(obj["split_factor"]))
        return Shard(int(obj["shard"]))
    raise ValueError(f"unknown DTensor placement {obj!r} in checkpoint")


def _local_box(
    shape: tuple[int, ...], mesh: Any, placements: Iterable[Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(
        torch.Size(shape), mesh, tuple(placements)
    )
    return tuple(int(o) for o in offset), tuple(int(s) for s in local)


_STRIDED_CACHE: dict[tuple[Any, ...], str | None] = {}


def _strided_problem(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Any, ...]
) -> str | None:
    """Why strided placements do not give every rank one block of the global tensor, the block
    FSDP2 holds; None when they do (or there is no strided placement).

    Per tensor dim, torch's own split of the indices (``_split_tensor``, what ``distribute_tensor``
    and ``full_tensor`` follow) is compared, for every coordinate of the mesh dims sharding that
    dim, with nested chunking: the ``Shard`` mesh dims first (tensor parallelism), then the
    strided one (FSDP2 chunking its TP piece). They agree for even sizes and for most uneven
    ones; where they do not, the box ``compute_local_shape_and_global_offset`` gives is not the
    data the rank holds. The same on every rank (no coordinate of this rank is used), so every
    rank refuses together.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not any(isinstance(p, _StridedShard) for p in placements):
        return None
    key = (shape, mesh_shape, placements)
    if key in _STRIDED_CACHE:
        return _STRIDED_CACHE[key]
    problem = None
    for d, n in enumerate(shape):
        on_d = [(i, p) for i, p in enumerate(placements) if _is_shard(p) and p.dim == d]
        strided = [i for i, p in on_d if isinstance(p, _StridedShard)]
        if not strided:
            continue
        if len(strided) > 1:
            problem = f"{len(strided)} strided placements on tensor dim {d}"
            break
        # torch's layout: the placements in mesh order, each splitting the indices it is given.
        torch_sets: dict[tuple[int, ...], torch.Tensor] = {(): torch.arange(n)}
        for i, p in on_d:
            split = (
                _StridedShard(0, split_factor=p.split_factor)
                if isinstance(p, _StridedShard)
                else Shard(0)
            )
            torch_sets = {
                (*c, j): piece
                for c, idx in torch_sets.items()
                for j, piece in enumerate(
                    split._split_tensor(idx, mesh_shape[i], with_padding=False)[0]
                )
            }
        # FSDP2's layout: the Shard mesh dims first, then the strided one chunks each piece.
        order = [i for i, _ in on_d if i not in strided] + strided
        nested: dict[tuple[int, ...], torch.Tensor] = {(): torch.arange(n)}
        for i in order:
            nested = {
                (*c, j): piece
                for c, idx in nested.items()
                for j, piece in enumerate(_chunks(idx, mesh_shape[i]))
            }
        pos = [order.index(i) for i, _ in on_d]  # nested keys are in `order`; torch's in mesh order
        for c, idx in nested.items():
            mine = torch_sets[tuple(c[k] for k in pos)]
            if not torch.equal(mine, idx):
                where = dict(zip([i for i, _ in on_d], (c[k] for k in pos), strict=True))
                problem = (
                    f"on tensor dim {d} of size {n}, mesh coordinate {where} holds indices "
                    f"{idx.tolist()[:8]} (nested chunking, as FSDP2 + TP place them), but the "
                    f"placements say {mine.tolist()[:8]}"
                )
                break
        if problem:
            break
    if len(_STRIDED_CACHE) > 4096:
        _STRIDED_CACHE.clear()
    _STRIDED_CACHE[key] = problem
    return problem


def _chunks(idx: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``torch.chunk`` into exactly ``n`` pieces (empty ones at the end), as ``Shard`` splits."""
    pieces = list(torch.chunk(idx, n)) if idx.numel() else []
    return pieces + [idx[:0]] * (n - len(pieces))


def _check_strided(
    shape: tuple[int, ...], mesh: Any, placements: Iterable[Any], what: str, error: type
) -> None:
    problem = _strided_problem(tuple(shape), tuple(mesh.shape), tuple(placements))
    if problem is not None:
        raise error(
            f"{what}: strided sharding {tuple(placements)} (FSDP2 + TP on one dim) of shape "
            f"{list(shape)} over mesh {tuple(mesh.shape)} does not give each rank one block: "
            f"{problem}. Make that dim a multiple of the TP degree, or shard FSDP2 and TP on "
            "different dims"
        )


_META_CACHE: dict[tuple[Any, ...], dict[str, Any]] = {}


def describe(t: Any, path: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """The local piece of a DTensor and its JSON description (no communication).

    Raises:
        TypeError: a placement other than Shard/_StridedShard/Replicate, or a strided layout
            that is not one block per rank, naming the key.
    """
    with torch.no_grad():  # to_local() is then a plain attribute read, not an autograd op
        local = t.to_local()
    key = (tuple(t.shape), t.device_mesh, tuple(t.placements))
    meta = _META_CACHE.get(key)
    if meta is None:
        # Computing the box costs ~40 us a tensor; it is the same at every save.
        placements = [_placement_json(p, path) for p in t.placements]
        _check_strided(
            tuple(t.shape), t.device_mesh, t.placements, f"state key {path!r}", TypeError
        )
        offset, shape = _local_box(tuple(t.shape), t.device_mesh, t.placements)
        mesh = t.device_mesh
        meta = {
            "shape": list(t.shape),
            "offset": list(offset),
            "local": list(shape),
            "mesh": list(mesh.shape),
            "coord": list(mesh.get_coordinate() or []),
            "placements": placements,
        }
        if len(_META_CACHE) > 65536:
            _META_CACHE.clear()
        _META_CACHE[key] = meta
    if list(local.shape) != meta["local"]:
        raise TypeError(
            f"state key {path!r}: DTensor local piece has shape {tuple(local.shape)}, but its "
            f"placements {t.placements} give {tuple(meta['local'])}: uneven custom sharding is "
            "not supported"
        )
    return local.detach(), meta


def target_box(
    shape: tuple[int, ...], mesh: Any, placements: Iterable[Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, local shape) of this rank's piece of a tensor of global ``shape``.

    Raises:
        ValueError: strided placements that do not give each rank one block.
    """
    placements = tuple(placements)
    _check_strided(shape, mesh, placements, "restoring a DTensor", ValueError)
    return _local_box(shape, mesh, placements)


def to_dtensor(local: torch.Tensor, mesh: Any, placements: Iterable[Any], shape: Any) -> Any:
    """Wraps this rank's piece as a DTensor (no communication)."""
    from torch.distributed.tensor import DTensor

    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, tuple(placements), run_check=False, shape=shape, stride=stride
    )


def _overlap(
    a_off: tuple[int, ...], a_len: tuple[int, ...], b_off: tuple[int, ...], b_len: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off, strict=True))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a_off, a_len, b_off, b_len, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def overlap_volume(
    a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]
) -> int:
    """Elements two boxes ``(offset, shape)`` share."""
    ov = _overlap(*a, *b)
    return 0 if ov is None else math.prod(ov[1])


def overlaps(meta: Mapping[str, Any], offset: Iterable[int], shape: Iterable[int]) -> bool:
    """Whether a saved piece overlaps a box (an empty box or piece overlaps nothing)."""
    return (
        _overlap(tuple(meta["offset"]), tuple(meta["local"]), tuple(offset), tuple(shape))
        is not None
    )


def assemble(
    name: str,
    pieces: Iterable[ShardedPiece],
    offset: tuple[int, ...],
    shape: tuple[int, ...],
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Builds the box ``offset``/``shape`` of a global tensor from saved pieces that cover it.

    Pieces with the same box (replicas) are used once.

    Raises:
        ValueError: the pieces do not cover the box, or disagree on the global shape.
    """
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    out: torch.Tensor | None = None
    covered = 0
    global_shape = None
    for p in pieces:
        if global_shape is None:
            global_shape = tuple(p.meta["shape"])
        elif tuple(p.meta["shape"]) != global_shape:
            raise ValueError(
                f"tensor {name!r}: saved pieces disagree on the global shape "
                f"({global_shape} vs {tuple(p.meta['shape'])})"
            )
        if p.box in seen:
            continue
        seen.add(p.box)
        ov = _overlap(*p.box, offset, shape)
        if ov is None:
            continue
        lo, n = ov
        if out is None:
            out = torch.empty(shape, dtype=dtype or p.tensor.dtype)
        src = p.tensor[_slices(lo, n, p.box[0])]
        out[_slices(lo, n, offset)] = src
        covered += math.prod(n)
    if out is None:
        out = torch.empty(shape, dtype=dtype or torch.float32)
    if covered != math.prod(shape):
        raise ValueError(
            f"tensor {name!r}: the saved pieces cover {covered} of the {math.prod(shape)} elements "
            f"of the box at {list(offset)} of shape {list(shape)} (a shard file is missing)"
        )
    return out


def _slices(lo: tuple[int, ...], n: tuple[int, ...], origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a - o, a - o + k) for a, k, o in zip(lo, n, origin, strict=True))


def walk_pieces(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Yields (key path, piece) for every ShardedPiece in a state tree."""
    if isinstance(obj, ShardedPiece):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk_pieces(v, (*path, k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from walk_pieces(v, (*path, i))


def replace_at(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    """Returns ``obj`` with the leaf at ``path`` replaced (dicts and lists in place; tuples
    rebuilt)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, tuple):
        items = list(obj)
        items[head] = replace_at(items[head], rest, value)
        return tuple(items)
    obj[head] = replace_at(obj[head], rest, value)
    return obj


def placement_objects(meta: Mapping[str, Any]) -> list[Any]:
    return [_placement(p) for p in meta["placements"]]
