"""Sharded state (DTensor, as FSDP2 and tensor parallelism hold it): save local pieces, reshard on
restore.

A DTensor is saved as its *local piece* plus a JSON description (global shape, the box of the
global tensor this rank holds, mesh shape and coordinate, placements). Nothing is gathered on the
save path.
On restore each rank computes the box its new DTensor needs (from the placements on the new mesh)
and fills it from the saved pieces that overlap it; when the boxes are the same (same world, same
mesh) its own piece is used as is.

Supported placements: ``Shard(dim)`` and ``Replicate()`` on meshes of any rank (FSDP2, TP, HSDP).
``Partial`` (unreduced values) and strided sharding (FSDP2 + TP on one dim) raise a clear error.
"""

from __future__ import annotations

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

    if type(p) is Shard:  # exactly Shard: _StridedShard subclasses it but its boxes differ
        return {"shard": int(p.dim)}
    if isinstance(p, Replicate):
        return "replicate"
    hint = " (Partial holds unreduced values: reduce them first)" if "Partial" in repr(p) else ""
    raise TypeError(
        f"state key {path!r}: DTensor placement {p!r} cannot be checkpointed as local pieces "
        f"(supported: Shard(dim), Replicate()); redistribute it to Shard/Replicate first{hint}"
    )


def _placement(obj: Any) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if obj == "replicate":
        return Replicate()
    if isinstance(obj, dict) and "shard" in obj:
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


_META_CACHE: dict[tuple[Any, ...], dict[str, Any]] = {}


def describe(t: Any, path: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """The local piece of a DTensor and its JSON description (no communication).

    Raises:
        TypeError: a placement other than Shard/Replicate, naming the key.
    """
    with torch.no_grad():  # to_local() is then a plain attribute read, not an autograd op
        local = t.to_local()
    key = (tuple(t.shape), t.device_mesh, tuple(t.placements))
    meta = _META_CACHE.get(key)
    if meta is None:
        # Computing the box costs ~40 us a tensor; it is the same at every save.
        placements = [_placement_json(p, path) for p in t.placements]
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
    """(offset, local shape) of this rank's piece of a tensor of global ``shape``."""
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
        covered += _numel(n)
    if out is None:
        out = torch.empty(shape, dtype=dtype or torch.float32)
    if covered != _numel(shape):
        raise ValueError(
            f"tensor {name!r}: the saved pieces cover {covered} of the {_numel(shape)} elements "
            f"of the box at {list(offset)} of shape {list(shape)} (a shard file is missing)"
        )
    return out


def _slices(lo: tuple[int, ...], n: tuple[int, ...], origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a - o, a - o + k) for a, k, o in zip(lo, n, origin, strict=True))


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


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
