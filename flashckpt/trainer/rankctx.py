"""The rank context of a trainer: who this rank is (ranks, world id, job, node), the group it
coordinates over, and the few collectives the checkpointer uses (all-gathers of short int lists
and of short texts, an all-reduce max). Every collective runs on the gloo coordination group, and
each is a no-op on a world of one (no ``torch.distributed`` needed)."""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from flashckpt import envnames
from flashckpt.format.shm import check_name
from flashckpt.protocol.channel import default_node_id, default_run_dir, socket_path
from flashckpt.state.sharded import is_sharded_dtensor, mesh_layout

__all__ = ["RankContext", "env", "replicated_error", "sharded_tensors", "world_id"]


def env(name: str) -> str | None:
    """An environment variable, None when unset or empty."""
    v = os.environ.get(name)
    return v if v else None


def world_id(world: int, group: Any = None) -> str:
    """Names the world (rendezvous round) this rank belongs to, the same on every rank of it.

    ``FLASHCKPT_WORLD_ID`` when set; else, under torch.distributed launchers, the rendezvous
    master's address and port (a new round gets a new port) and the world size.
    """
    wid = envnames.world_id()
    if wid:
        return wid
    addr, port = env("MASTER_ADDR"), env("MASTER_PORT")
    if world > 1 and addr and port:
        return f"{addr}:{port}/{world}"
    if world > 1 and torch.distributed.is_initialized():
        # Another init method (file://, tcp:// URL): rank 0 draws a name for this world. A
        # shared empty name would let the node agent mix a dead world's ranks into this one's.
        token = torch.tensor([int.from_bytes(os.urandom(6), "little")], dtype=torch.int64)
        torch.distributed.broadcast(token, group_src=0, group=group)  # None: the default group
        return f"w{int(token.item()):012x}/{world}"
    return ""


@dataclass(slots=True)
class RankContext:
    """Who this rank is, and the collectives it takes part in."""

    pg: Any = None
    """The user's process group (None: the world)."""
    coord_pg: Any = None
    """The gloo group the checkpointer's collectives run on (the user's when it is gloo)."""
    rank: int = 0
    """This rank in ``pg``."""
    world: int = 1
    """The size of ``pg``."""
    local_rank: int = 0
    """This rank's position on its machine (the agent keys slots by it)."""
    local_world: int = 1
    """Trainers on this machine."""
    world_id: str = ""
    """The name of this world (rendezvous round), the same on every rank of it."""
    job: str = ""
    """The job id (names segments and the agent)."""
    node: str = ""
    """The node id."""
    run_dir: str | None = None
    """Directory of the agent's socket and logs."""
    socket: str | None = None
    """The node agent's socket path."""
    shard: int = 0
    """The shard of a committed step this rank writes (and reads back in the same layout)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < max(self.world, 1):
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")

    def join(self, pg: Any) -> None:
        """Reads the ranks of ``pg`` (and this machine's from $LOCAL_RANK/$LOCAL_WORLD_SIZE) and
        names the world: collective where torch.distributed is initialised."""
        self.pg = pg
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(pg)
            self.world = dist.get_world_size(pg)
            backend = dist.get_backend(pg)
            self.coord_pg = pg if backend == "gloo" else dist.new_group(backend="gloo")
        lws = env("LOCAL_WORLD_SIZE")
        self.local_world = int(lws) if lws else self.world
        lr = env("LOCAL_RANK")
        # The agent keys slots by local rank: after a membership change a surviving trainer may
        # get another global rank, and still finds its snapshots.
        self.local_rank = int(lr) if lr else self.rank % max(self.local_world, 1)
        self.world_id = world_id(self.world, self.coord_pg)

    def name(
        self, *, job: str | None, node: str | None, run_dir: str | None, storage: str | None
    ) -> None:
        """Resolves the job, node and run directory (arguments, then $FLASHCKPT_*, then the
        torch launcher's run id, then a hash of the storage URL) and the agent's socket.

        Raises:
            ValueError: no job name can be had, a name is not safe, or the socket path is too
                long.
        """
        job = job or envnames.job()
        if job is None:
            run_id = env("TORCHELASTIC_RUN_ID")
            # torchrun --standalone draws a new random id per launch: as the job's name it would
            # make the same command's rerun another job (its snapshots out of sight, its storage
            # another job's). With storage, the storage URL names the job instead.
            if run_id and run_id != "none" and not (storage and _random_run_id(run_id)):
                job = run_id
        if job is None:
            if storage is None:
                raise ValueError("pass job= (or storage=) so the snapshots have a name")
            job = "j" + hashlib.sha1(storage.encode()).hexdigest()[:12]
        self.job = check_name("job", job)
        self.node = check_name("node", node or envnames.node() or default_node_id())
        self.run_dir = run_dir or envnames.run_dir() or default_run_dir()
        path = socket_path(self.run_dir, self.job, self.node)
        if len(path.encode()) > 100:
            raise ValueError(f"agent socket path {path!r} is too long: use a shorter run_dir/job")
        self.socket = path

    def all_max(self, code: int) -> int:
        """The largest ``code`` of every rank (an agreement: every rank calls it)."""
        if self.world == 1:
            return code
        t = torch.tensor([code], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.coord_pg)
        return int(t.item())

    def gather_rows(self, row: list[int], k: int) -> list[list[int]]:
        """All-gathers one short int list from every rank, order kept: result[rank]."""
        if self.world == 1:
            return [list(row[:k])]
        t = torch.zeros(k + 1, dtype=torch.int64)
        t[0] = len(row[:k])
        if row:
            t[1 : 1 + len(row[:k])] = torch.tensor(row[:k])
        out = [torch.empty_like(t) for _ in range(self.world)]
        torch.distributed.all_gather(out, t, group=self.coord_pg)
        return [o[1 : 1 + int(o[0])].tolist() for o in out]

    def gather_sets(self, lists: list[list[int]], k: int) -> list[list[set[int]]]:
        """All-gathers a few short int lists from every rank: result[i][rank] is a set."""
        if self.world == 1:
            return [[set(xs[:k])] for xs in lists]
        t = torch.full((len(lists), k), -1, dtype=torch.int64)
        for i, xs in enumerate(lists):
            if xs:
                t[i, : len(xs)] = torch.tensor(xs[:k])
        out = [torch.empty_like(t) for _ in range(self.world)]
        torch.distributed.all_gather(out, t, group=self.coord_pg)
        return [[set(o[i].tolist()) - {-1} for o in out] for i in range(len(lists))]

    def gather_texts(self, text: str, limit: int) -> list[str]:
        """All-gathers one short text from every rank (UTF-8, cut to ``limit`` bytes), order kept:
        result[rank]. Bytes in a tensor, as the other collectives: nothing is unpickled."""
        data = text.encode()[:limit]
        if self.world == 1:
            return [data.decode(errors="replace")]
        t = torch.zeros(4 + limit, dtype=torch.uint8)  # length (4 bytes, little-endian), bytes
        t[: 4 + len(data)] = torch.frombuffer(
            bytearray(len(data).to_bytes(4, "little") + data), dtype=torch.uint8
        )
        out = [torch.empty_like(t) for _ in range(self.world)]
        torch.distributed.all_gather(out, t, group=self.coord_pg)
        texts = []
        for o in out:
            raw = bytes(o.tolist())
            n = min(int.from_bytes(raw[:4], "little"), limit)
            texts.append(raw[4 : 4 + n].decode(errors="replace"))
        return texts

    def shard_layout(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        replicated: bool | None,
    ) -> tuple[bool, int, int, int]:
        """Resolves ``replicated`` (None: detected) and gives it with this rank's (shard,
        num_shards, replica) for the agent and the manifest; keeps ``shard``.

        Replicated: one shard, written by replica 0 (rank 0). Sharded DTensors on one mesh of this
        world: the ranks at coordinate 0 of the replicate dims (HSDP) write one shard per
        coordinate on the shard dims; the other replicas write only their per-rank file. Any
        other sharded state: every rank writes a shard of its own.

        Raises:
            ValueError: ``replicated=True`` but the state holds a sharded DTensor.
        """
        found = sharded_tensors(model, optimizer)
        if replicated is None:
            replicated = not found
        elif replicated and found:
            raise replicated_error(found[0][0])
        if replicated:
            layout: tuple[int, int, int] | None = (0, 1, self.rank)
        else:
            dist = torch.distributed
            ranks = (
                dist.get_process_group_ranks(self.pg) if self.pg is not None else range(self.world)
            )
            layout = mesh_layout((t for _, t in found), ranks)
        shard, num_shards, replica = layout if layout is not None else (self.rank, self.world, 0)
        self.shard = shard
        return replicated, shard, num_shards, replica


def sharded_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> list[tuple[str, Any]]:
    """(where, tensor) of the model state's and optimizer parameters' sharded DTensors."""
    found = [
        (f"model state key {k!r}", v)
        for k, v in model.state_dict().items()
        if is_sharded_dtensor(v)
    ]
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        seen = {id(v) for _, v in found}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in seen and is_sharded_dtensor(p):
                    found.append((f"optimizer parameter {names.get(id(p), '?')!r}", p))
    return found


def replicated_error(where: str) -> ValueError:
    """The error for a sharded DTensor in a state declared (or used as) replicated."""
    return ValueError(
        f"{where} is a DTensor sharded over ranks (FSDP2 / tensor parallel / HSDP): every rank "
        "holds a different piece, but replicated=True persists one rank's state only; drop "
        "replicated=True (sharding is then detected) or pass replicated=False"
    )


def _random_run_id(run_id: str) -> bool:
    """Whether ``run_id`` is a random UUID (version 4), as torchrun --standalone draws one."""
    try:
        return uuid.UUID(run_id).version == 4 and str(uuid.UUID(run_id)) == run_id.lower()
    except ValueError:
        return False
