"""A deterministic DDP (gloo) training loop for the multi-rank tests (2 ranks unless ``--world``);
run one per rank."""

from __future__ import annotations

import argparse
import json
import os
import sys

import safetensors.torch
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from tinytrain import init_gloo, kill_in_copy, make
from trainscript import exit_now

import flashckpt
from flashckpt.trainer.ddp import distributed_data_parallel


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--storage", "--job", "--run-dir", "--log", "--init-file"):
        p.add_argument(name, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--node", default="n0")
    p.add_argument("--local-world", type=int, default=0, help="ranks on this node (default all)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--report", default=None)
    p.add_argument("--kill-in-copy", type=int, default=0)
    p.add_argument(
        "--persist-every",
        default="1",
        help="snapshots (int), a duration ('1h'), or 'default' (the library's); 1 by default: "
        "the tests read the steps they snapshot back from storage",
    )
    p.add_argument(
        "--clock-due-at",
        type=int,
        default=0,
        help="at the snapshot after this many steps, this rank's clock says a persist is due "
        "(its last mark moved an hour back); the other ranks' clocks are left alone",
    )
    p.add_argument(
        "--wrap",
        choices=["plain", "fixed"],
        default="plain",
        help="the DDP wrapper: torch's own, or flashckpt.trainer.ddp's (buckets fixed at "
        "construction)",
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    init_gloo(a.init_file, a.rank, a.world, 30, local_world=a.local_world or a.world)
    if a.kill_in_copy:
        kill_in_copy(a.kill_in_copy)
    model, opt, sched = make(0)
    if a.wrap == "fixed":
        ddp = distributed_data_parallel(model)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    persist: dict[str, int | str] = {}
    if a.persist_every != "default":
        pe = a.persist_every
        persist["persist_every"] = int(pe) if pe.isdigit() else pe
    with flashckpt.checkpointing(
        ddp,
        opt,
        scheduler=sched,
        storage=a.storage,
        every=a.every,
        **persist,
        job=a.job,
        node=a.node,
        run_dir=a.run_dir,
        mode="sync",
        agent_idle_timeout=120,
    ) as ckpt:
        if a.report:
            with open(a.report, "a") as f:
                f.write(f"{a.rank} {ckpt.start_step} {ckpt.restored_from}\n")
        with open(a.log, "a") as log:
            for step in range(ckpt.start_step, a.steps):
                g = torch.Generator().manual_seed(10_000 * a.rank + step)
                x = torch.randn(8, 16, generator=g)
                loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True).sin())
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                log.write(f"{step} {float(loss.item()).hex()}\n")
                log.flush()
                if a.clock_due_at and step + 1 == a.clock_due_at:
                    # The time form's own clock of this rank (flashckpt.trainer.checkpointer): an
                    # hour
                    # since its last mark, however little time passed on the others.
                    assert ckpt._persist_cadence.mark_t is not None, "no snapshot marked yet"
                    ckpt._persist_cadence.mark_t -= 3600.0
                ckpt.step()
        with open(a.log + ".stats.json", "w") as f:
            s = ckpt.stats
            json.dump(
                {
                    "saves": s.saves,
                    "persist_marked": s.persist_marked,
                    "persist_carried": s.persist_carried,
                },
                f,
            )
    final = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(final, a.log + ".final.safetensors")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())  # (see trainscript.exit_now: no interpreter teardown after gloo)
