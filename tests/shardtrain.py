"""A deterministic FSDP2 (fully_shard, gloo, CPU) training loop for the sharded tests; one per rank.

The global batch (12 rows) is split evenly over the ranks and FSDP2 averages the gradients, so the
loss sequence does not depend on the world size (2, 3 or 4 ranks) up to float rounding. Rank 0
writes ``<log>`` (step and global loss), and the gathered full model and optimizer state right after
restore (``<log>.restored.safetensors``) and at the end (``<log>.final.safetensors``, or
``<log>.crash.safetensors`` with ``--exit-at``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist

import flashckpt

BATCH = 12


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Dims 10 and 3 split unevenly over 3 and 4 ranks (4 ranks: 3+3+3+1 and 1+1+1+0 rows).
    return torch.nn.Sequential(torch.nn.Linear(16, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def make_optim(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 16, generator=g)
    y = torch.stack([x[:, :4].sum(1).sin(), x[:, 4:8].prod(1).tanh(), x[:, 8:].mean(1)], 1)
    return x, y


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The full (gathered) model and optimizer state, the way torch.distributed.checkpoint
    defines it, flattened to ``model/<fqn>`` and ``optim/<fqn>/<key>``. Collective."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    out = {f"model/{k}": v for k, v in get_model_state_dict(model, options=opts).items()}
    osd = get_optimizer_state_dict(model, opt, options=opts)
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{fqn}/{k}"] = torch.as_tensor(v)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--storage", "--job", "--run-dir", "--log", "--init-file"):
        p.add_argument(name, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--node", default="n0")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--report", default=None)
    p.add_argument("--exit-at", type=int, default=-1, help="die (no clean exit) after this step")
    a = p.parse_args()
    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = str(a.world)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{a.init_file}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=60),
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (a.world,))
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = make_optim(model)
    rows = BATCH // a.world
    lo = a.rank * rows
    with flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        storage=a.storage,
        every=a.every,
        job=a.job,
        node=a.node,
        run_dir=a.run_dir,
        mode="sync",
        replicated=False,
        agent_idle_timeout=120,
    ) as ckpt:
        if a.report:
            with open(a.report, "a") as f:
                f.write(f"{a.rank} {ckpt.start_step} {ckpt.restored_from}\n")
        if ckpt.start_step:
            restored = full_state(model, opt)
            if a.rank == 0:
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
                dist.all_reduce(total)
                if a.rank == 0:
                    log.write(f"{step} {float(total.item() / a.world).hex()}\n")
                    log.flush()
                ckpt.step(step)
                if step == a.exit_at:
                    crash = full_state(model, opt)
                    if a.rank == 0:
                        safetensors.torch.save_file(crash, a.log + ".crash.safetensors")
                    dist.barrier()
                    os._exit(3)  # as if killed: the agent keeps the snapshots in memory
    final = full_state(model, opt)
    if a.rank == 0:
        safetensors.torch.save_file(final, a.log + ".final.safetensors")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
