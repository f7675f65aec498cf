"""FSDP2 + tensor parallelism (gloo, CPU) on a (dp, tp) mesh: the training loop of the strided
sharding test, one process per rank, forked from one launcher.

shardtrain.py's model, data and optimizer: the first Linear (10 outputs) is ColwiseParallel, the
second RowwiseParallel, on the "tp" dim; then ``fully_shard`` on the "dp" dim. FSDP2 then shards
the first layer's weight and bias on the dim TP shards: ``(_StridedShard(0, split_factor=tp),
Shard(0))``, unevenly (10 rows: 5 per TP rank, 3 + 2 per FSDP rank). Each dp group trains on its
share of the 12-row batch (the tp ranks of a group on the same rows), so the losses are the
unsharded ones up to float rounding, and shardtrain.py (1-D FSDP2) can resume from the checkpoint.

Rank 0 writes ``<log>`` (step and global loss, as shardtrain.py), the gathered full state after
restore, at the end (or at ``--exit-at``), and ``<log>.placements.json`` (each parameter's
placements). Every rank checks that each parameter's local piece is the box of the full tensor
that its placements give, before training and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import safetensors.torch
import torch
import torch.distributed as dist
from shardtrain import BATCH, batch, fork_ranks, full_state, make_model, make_optim
from tinytrain import init_gloo

import flashckpt


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--storage", "--job", "--run-dir", "--log", "--init-file", "--report"):
        p.add_argument(name, required=True)
    p.add_argument("--mesh", default="2,2", help="dp,tp")
    p.add_argument("--node", default="n0")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--exit-at", type=int, default=-1, help="die (no clean exit) after this step")
    a = p.parse_args()
    a.dims = tuple(int(n) for n in a.mesh.split(","))
    a.world = a.dims[0] * a.dims[1]
    torch.set_num_threads(1)
    return launch(a)


def launch(a: argparse.Namespace) -> int:
    """Forks every rank from here once torch is imported (shardtrain.fork_ranks)."""
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp
    import torch.distributed.tensor.parallel  # noqa: F401

    import flashckpt.trainer.checkpointer  # noqa: F401

    expected = 3 if a.exit_at >= 0 else 0
    return fork_ranks(a.world, expected, lambda rank: train(a, rank), "tptrain")


def check_pieces(model: torch.nn.Module) -> dict[str, str]:
    """Asserts each parameter's local piece is the box of its full tensor that its placements
    give (the box flashckpt saves it as). Collective. Returns the placements by name."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor()
        shape, offset = compute_local_shape_and_global_offset(
            p.shape,
            p.device_mesh,
            p.placements,
        )
        box = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        local = p.to_local()
        assert torch.equal(local, box), (name, p.placements, offset, shape, local.shape)
        out[name] = repr(tuple(p.placements))
    return out


def train(a: argparse.Namespace, rank: int) -> int:
    init_gloo(a.init_file, rank, a.world, 60, local_world=a.world, local_rank=rank)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", a.dims, mesh_dim_names=("dp", "tp"))
    model = make_model()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = check_pieces(model)
    # The case under test: FSDP2 and TP shard the first layer on the same dim.
    assert isinstance(model[0].weight.placements[0], _StridedShard), placements
    if rank == 0:
        with open(a.log + ".placements.json", "w") as f:
            json.dump(placements, f)
    opt, sched = make_optim(model)
    dp = mesh["dp"].get_local_rank()
    rows = BATCH // a.dims[0]
    lo = dp * rows
    with flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        storage=a.storage,
        every=a.every,
        persist_every=1,  # the tests read the steps they snapshot back from storage
        job=a.job,
        node=a.node,
        run_dir=a.run_dir,
        mode="sync",
        agent_idle_timeout=120,
    ) as ckpt:
        with open(a.report, "a") as f:
            f.write(f"{rank} {ckpt.start_step} {ckpt.restored_from}\n")
        if ckpt.start_step:
            check_pieces(model)
            restored = full_state(model, opt)
            if rank == 0:
                safetensors.torch.save_file(restored, a.log + ".restored.safetensors")
        with open(a.log, "a") as log:
            for step in range(ckpt.start_step, a.steps):
                x, y = batch(step)
                loss = torch.nn.functional.mse_loss(model(x[lo : lo + rows]), y[lo : lo + rows])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                total = loss.detach().clone()
                dist.all_reduce(total)  # each dp group's loss, counted once per tp rank
                if rank == 0:
                    log.write(f"{step} {float(total.item() / a.world).hex()}\n")
                    log.flush()
                ckpt.step()
                if step == a.exit_at:
                    crash = full_state(model, opt)
                    if rank == 0:
                        safetensors.torch.save_file(crash, a.log + ".crash.safetensors")
                    dist.barrier()
                    os._exit(3)  # as if killed: the agent keeps the snapshots in memory
    check_pieces(model)
    final = full_state(model, opt)
    if rank == 0:
        safetensors.torch.save_file(final, a.log + ".final.safetensors")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
