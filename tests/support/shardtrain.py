"""A deterministic FSDP2 (fully_shard, gloo, CPU) training loop for the sharded tests; one per rank.

The global batch (12 rows) is split evenly over the ranks and FSDP2 averages the gradients, so the
loss sequence does not depend on the world size (2, 3 or 4 ranks) up to float rounding. Rank 0
writes ``<log>`` (step and global loss), and the gathered full model and optimizer state right after
restore (``<log>.restored.safetensors``) and at the end (``<log>.final.safetensors``, or
``<log>.crash.safetensors`` with ``--exit-at``).

``--mesh R,S`` trains HSDP (a replicate dim of R, a shard dim of S, R * S = world) instead of 1-D
FSDP2. ``--ema`` adds a ``stateful=`` object holding an exponential moving average of the
parameters as DTensors (saved in the full state as ``ema/<fqn>``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from tinytrain import init_gloo

import flashckpt

BATCH = 12


def make_model(hidden: int = 10) -> torch.nn.Module:
    torch.manual_seed(0)
    # Dims 10 and 3 split unevenly over 3 and 4 ranks (4 ranks: 3+3+3+1 and 1+1+1+0 rows).
    return torch.nn.Sequential(
        torch.nn.Linear(16, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3)
    )


def make_optim(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 16, generator=g)
    y = torch.stack([x[:, :4].sum(1).sin(), x[:, 4:8].prod(1).tanh(), x[:, 8:].mean(1)], 1)
    return x, y


class Ema:
    """A stateful object whose state is DTensors: a moving average of the (sharded) parameters."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for n, p in model.named_parameters():
            self.shadow[n].mul_(0.75).add_(p.detach(), alpha=0.25)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": dict(self.shadow), "decay": 0.75}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for n, t in sd["shadow"].items():
            # The restored DTensor must carry this rank's piece on this run's mesh.
            assert t.device_mesh == self.shadow[n].device_mesh, n
            assert t.placements == self.shadow[n].placements, n
            self.shadow[n].copy_(t)


def full_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer, ema: Ema | None = None
) -> dict[str, torch.Tensor]:
    """The full (gathered) model and optimizer state, the way torch.distributed.checkpoint
    defines it, flattened to ``model/<fqn>`` and ``optim/<fqn>/<key>`` (and ``ema/<fqn>``).
    Collective."""
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
    if ema is not None:
        for n, t in ema.shadow.items():
            out[f"ema/{n}"] = t.full_tensor()
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--storage", "--job", "--run-dir", "--log", "--init-file"):
        p.add_argument(name, required=True)
    p.add_argument("--rank", type=int, default=None, help="default: fork every rank from here")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--node", default="n0")
    p.add_argument(
        "--per-node",
        type=int,
        default=0,
        help="ranks per machine: rank r runs on node <node>-<r // per-node> (default: all on one)",
    )
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--report", default=None)
    p.add_argument("--exit-at", type=int, default=-1, help="die (no clean exit) after this step")
    p.add_argument("--mesh", default=None, help="HSDP: R,S (replicate dim R, shard dim S)")
    p.add_argument("--replicated", choices=("auto", "false", "true"), default="auto")
    p.add_argument("--ema", action="store_true")
    p.add_argument("--hidden", type=int, default=10, help="hidden width (a bigger state)")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.rank is None:
        return launch(a)
    return train(a)


def launch(a: argparse.Namespace) -> int:
    """Runs every rank in a process of its own (see :func:`fork_ranks`)."""
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp  # noqa: F401

    import flashckpt.trainer.checkpointer  # noqa: F401

    def run(rank: int) -> int:
        a.rank = rank
        return train(a)

    return fork_ranks(a.world, 3 if a.exit_at >= 0 else 0, run, "shardtrain")


def fork_ranks(world: int, expected: int, run: Callable[[int], int], name: str) -> int:
    """Runs ``run(rank)`` for every rank in a process of its own, forked from this one once it
    has imported what the ranks use: a rank then starts in milliseconds instead of seconds of
    imports (on a loaded 2-core machine, most of a sharded test's time). The children share
    nothing after the fork.

    Returns:
        The ranks' exit code when they all agree; else 1 (the codes are printed to stderr). A rank
        failing with another code than ``expected`` gets the others killed (they would wait in a
        collective until its timeout).
    """
    import signal
    import traceback

    from flashckpt.elastic.procutil import set_parent_death_signal

    pids: dict[int, int] = {}
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                set_parent_death_signal(signal.SIGKILL)  # die with the launcher
                code = run(rank)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = rank
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        pid, status = os.wait()
        codes[pids[pid]] = code = os.waitstatus_to_exitcode(status)
        if code != expected:
            for other in pids:
                if pids[other] not in codes:
                    os.kill(other, signal.SIGKILL)
    if len(set(codes.values())) == 1:
        return codes[0]
    print(f"{name}: exit codes by rank {dict(sorted(codes.items()))}", file=sys.stderr)
    return 1


def train(a: argparse.Namespace) -> int:
    per_node = a.per_node or a.world
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    os.environ["LOCAL_RANK"] = str(a.rank % per_node)
    node = f"{a.node}-{a.rank // per_node}" if a.per_node else a.node
    init_gloo(a.init_file, a.rank, a.world, 60)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dims = tuple(int(n) for n in a.mesh.split(",")) if a.mesh else (a.world,)
    names = ("replicate", "shard") if len(dims) == 2 else None  # HSDP state dicts want names
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
    model = make_model(a.hidden)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = make_optim(model)
    ema = Ema(model) if a.ema else None
    options: dict[str, Any] = {}
    if a.replicated != "auto":  # else detected: sharded (DTensors with Shard placements)
        options["replicated"] = a.replicated == "true"
    rows = BATCH // a.world
    lo = a.rank * rows
    with flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        stateful={"ema": ema} if ema is not None else None,
        storage=a.storage,
        every=a.every,
        persist_every=1,  # the tests read the steps they snapshot back from storage
        job=a.job,
        node=node,
        run_dir=a.run_dir,
        mode="sync",
        agent_idle_timeout=120,
        **options,
    ) as ckpt:
        if a.report:
            with open(a.report, "a") as f:
                f.write(f"{a.rank} {ckpt.start_step} {ckpt.restored_from}\n")
            with open(a.log + ".restore.jsonl", "a") as f:
                f.write(json.dumps({"rank": a.rank, **ckpt.status()["restore"]}) + "\n")
        if ckpt.start_step:
            restored = full_state(model, opt, ema)
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
                if ema is not None:
                    ema.update(model)
                total = loss.detach().clone()
                dist.all_reduce(total)
                if a.rank == 0:
                    log.write(f"{step} {float(total.item() / a.world).hex()}\n")
                    log.flush()
                ckpt.step()
                if step == a.exit_at:
                    crash = full_state(model, opt, ema)
                    if a.rank == 0:
                        safetensors.torch.save_file(crash, a.log + ".crash.safetensors")
                    dist.barrier()
                    os._exit(3)  # as if killed: the agent keeps the snapshots in memory
    final = full_state(model, opt, ema)
    if a.rank == 0:
        safetensors.torch.save_file(final, a.log + ".final.safetensors")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
