"""Resharding from memory: a sharded (DTensor) state saved by another world or layout, rebuilt
from the snapshots that the ranks of this world still hold in shared memory.

When the world size changes (a machine lost with HSDP replicas left, a job that grows, fewer
trainers on a machine) or ranks are renumbered, each rank needs pieces that other ranks hold.
If the snapshots of some step that survive in memory cover every piece, they are exchanged over
torch.distributed (gloo, point to point) instead of being read back from storage.

Everything travels as JSON and raw tensor bytes: nothing is pickled.

The plan is computed identically on every rank from all-gathered descriptions, and sends and
receives are walked in one global order, so they always pair (each transfer involves two ranks
and the earliest unfinished one can always proceed). A sender whose snapshot changed under it
still takes part in every transfer (it sends a "torn" status instead of bytes), so no peer is
left waiting in a receive.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flashckpt.format.layout import Layout, tensor_views, torch_dtype
from flashckpt.state.codec import piece_nodes
from flashckpt.state.sharded import overlap_volume

__all__ = [
    "HeldSnapshot",
    "MemoryPiecesPlan",
    "covered",
    "gather_json",
]


@dataclass(slots=True)
class HeldSnapshot:
    """A complete snapshot of a sharded state that this rank can read (its own slot, or the slot
    of a local rank that no trainer of this world uses)."""

    step: int
    world_id: str
    world_size: int
    rank: int
    """The rank that took it, in its world."""
    meta: dict[str, Any]
    data: torch.Tensor
    """uint8, the snapshot's tensor bytes (``layout.nbytes`` of them)."""
    check: Callable[[], bool]
    """Whether the slot still holds this snapshot, complete."""

    @property
    def key(self) -> tuple[int, str, int]:
        return self.step, self.world_id, self.world_size


@dataclass(slots=True)
class MemoryPiecesPlan:
    """A step that the memory of this world's ranks covers, and what this rank needs."""

    step: int
    world_id: str
    world_size: int
    metas: dict[int, dict[str, Any]]
    """Old rank -> its snapshot description."""
    holders: dict[int, int]
    """Old rank -> the rank of this world that sends its snapshot's tensors."""
    base: int
    """The old rank whose snapshot gives this rank the unsharded part of the state."""
    requests: dict[int, list[str]]
    """Old rank -> the tensor names this rank needs from it (snapshots it does not hold)."""


def gather_json(obj: Any, world: int, group: Any) -> list[Any]:
    """All-gathers one JSON value from every rank (as bytes: no pickle). result[rank]."""
    raw = json.dumps(obj, separators=(",", ":")).encode()
    if world == 1:
        return [json.loads(raw)]
    dist = torch.distributed
    n = torch.tensor([len(raw)], dtype=torch.int64)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    top = max(int(s.item()) for s in sizes)
    buf = torch.zeros(top, dtype=torch.uint8)
    if raw:
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    outs = [torch.empty(top, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(outs, buf, group=group)
    return [
        json.loads(o[: int(s.item())].numpy().tobytes()) for o, s in zip(outs, sizes, strict=True)
    ]


def covered(
    box: tuple[tuple[int, ...], tuple[int, ...]],
    pieces: Iterable[tuple[tuple[int, ...], tuple[int, ...]]],
) -> bool:
    """Whether pieces (Shard/Replicate boxes: two boxes are equal or disjoint) cover ``box``."""
    total = sum(overlap_volume(p, box) for p in set(pieces))
    return total == math.prod(box[1])


def plan_needs(
    rank: int,
    world: int,
    metas: Mapping[int, dict[str, Any]],
    mine: set[int],
    boxes: Iterable[tuple[str, tuple[tuple[int, ...], tuple[int, ...]]]],
    base: int,
) -> dict[int, list[str]]:
    """What this rank must receive: old rank -> tensor names (none from snapshots it holds).

    Raises:
        ValueError: the snapshots in memory do not cover a piece this rank needs.
    """
    where: dict[str, list[tuple[int, tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
    for o in sorted(metas):
        for name, pm in piece_nodes(metas[o]["skeleton"]):
            where.setdefault(name, []).append((o, (tuple(pm["offset"]), tuple(pm["local"]))))
    requests: dict[int, set[str]] = {}
    if base not in mine:
        piece_names = {n for n, _ in piece_nodes(metas[base]["skeleton"])}
        plain = [e[0] for e in metas[base]["entries"] if e[0] not in piece_names]
        if plain:
            requests.setdefault(base, set()).update(plain)
    for name, box in boxes:
        have = where.get(name, [])
        if not covered(box, (b for _, b in have)):
            raise ValueError(
                f"the snapshots in memory do not cover tensor {name!r} at {list(box[0])} "
                f"of shape {list(box[1])} for rank {rank} of {world}"
            )
        # One source per distinct box that overlaps: a snapshot this rank holds if any.
        by_box: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        for o, b in sorted(have, key=lambda ob: (ob[0] not in mine, ob[0])):
            if overlap_volume(b, box) and b not in by_box:
                by_box[b] = o
        for o in by_box.values():
            if o not in mine:
                requests.setdefault(o, set()).add(name)
    return {o: sorted(names) for o, names in sorted(requests.items())}


def _entries(meta: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    return {
        str(e[0]): (str(e[1]), tuple(int(s) for s in e[2]), int(e[3]), int(e[4]))
        for e in meta["entries"]
    }


def exchange(
    plan: MemoryPiecesPlan,
    rank: int,
    world: int,
    group: Any,
    held: Mapping[int, HeldSnapshot],
) -> tuple[dict[int, dict[str, torch.Tensor]], str | None]:
    """Sends and receives the tensors of the plan.

    Returns:
        Old rank -> name -> tensor received by this rank, and an error (a snapshot of this rank
        or of a peer changed during the exchange) or None.
    """
    all_requests = gather_json({str(o): n for o, n in plan.requests.items()}, world, group)
    dist = torch.distributed
    received: dict[int, dict[str, torch.Tensor]] = {}
    error: str | None = None
    for r in range(world):
        for o_key in sorted(all_requests[r], key=int):
            o, names = int(o_key), all_requests[r][o_key]
            h = plan.holders[o]
            if h == r or not names or rank not in (h, r):
                continue
            entries = _entries(plan.metas[o])
            if rank == h:
                snap = held[o]
                ok = snap.check()
                dist.send(torch.tensor([1 if ok else -1], dtype=torch.int64), r, group=group)
                if ok:
                    parts = [
                        snap.data[entries[n][2] : entries[n][2] + entries[n][3]] for n in names
                    ]
                    buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
                    if buf.numel():
                        dist.send(buf, r, group=group)
                    if not snap.check():
                        error = f"this rank's snapshot of step {plan.step} changed while sent"
                else:
                    error = f"this rank's snapshot of step {plan.step} changed"
            else:
                status = torch.empty(1, dtype=torch.int64)
                dist.recv(status, h, group=group)
                if int(status.item()) < 0:
                    error = f"rank {h}'s snapshot of step {plan.step} changed"
                    continue
                total = sum(entries[n][3] for n in names)
                buf = torch.empty(total, dtype=torch.uint8)
                if total:
                    dist.recv(buf, h, group=group)
                got, off = {}, 0
                for n in names:
                    code, shape, _, nbytes = entries[n]
                    got[n] = buf[off : off + nbytes].view(torch_dtype(code)).view(shape)
                    off += nbytes
                received[o] = got
    return received, error


def views_of(snap: HeldSnapshot) -> dict[str, torch.Tensor]:
    """Every tensor of a held snapshot, viewing its slot."""
    layout = Layout.from_json(snap.meta["entries"])
    return tensor_views(layout, snap.data[: layout.nbytes])


class Placeholders(dict[str, torch.Tensor]):
    """Tensors by name; a missing name (a piece that is rebuilt anyway) is an empty tensor."""

    def __missing__(self, key: str) -> torch.Tensor:
        return torch.empty(0)
