"""Ranks of one machine (gloo, CPU) that save a tiny model, or restore it where some ranks' models
do not fit the checkpoint (tests/test_restore_failure.py); forked from one launcher process.

``--phase save`` trains 2 steps (every step snapshotted and persisted). ``--phase restore``
enters the checkpointer with the model of ``--misfit``: on rank 1 a narrower model (a shape
mismatch), on rank 2 one more layer (missing keys), the other ranks the saved model. Every rank
writes what entering raised (or what it restored) to ``<out>/rank<r>.json`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from shardtrain import fork_ranks
from tinytrain import init_gloo, make, train_steps

import flashckpt


def _model(rank: int, misfit: set[int]) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    if rank not in misfit:
        return make(0)
    if rank == 1:
        return make(0, width=24)  # every layer's shape differs from the checkpoint's
    model, opt, sched = make(0)
    assert isinstance(model, torch.nn.Sequential)
    model.append(torch.nn.Linear(1, 1))  # keys the checkpoint lacks
    return model, opt, sched


def run(a: argparse.Namespace, rank: int) -> int:
    init_gloo(a.init_file, rank, a.world, 60)
    misfit = {int(r) for r in a.misfit.split(",") if r}
    model, opt, sched = _model(rank, misfit)
    kw = {
        "storage": a.storage,
        "job": a.job,
        "node": "n0",
        "run_dir": a.run_dir,
        "every": 1,
        "persist_every": 1,
        "mode": "sync",
        "agent_idle_timeout": 120,
    }
    out: dict[str, object] = {"rank": rank}
    try:
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            out.update(start_step=ck.start_step, restored_from=ck.restored_from)
            if a.phase == "save":
                train_steps(ck, model, opt, sched, ck.start_step, 2)
    except Exception as e:
        out.update(
            error=type(e).__name__,
            message=str(e),
            flashckpt_error=isinstance(e, flashckpt.FlashckptError),
            value_error=isinstance(e, ValueError),
            cause=type(e.__cause__).__name__ if e.__cause__ is not None else None,
            step=getattr(e, "step", None),
            failures={str(r): t for r, t in getattr(e, "failures", {}).items()},
        )
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--storage", "--job", "--run-dir", "--init-file", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--phase", choices=("save", "restore"), required=True)
    p.add_argument("--misfit", default="", help="comma-separated ranks whose model differs")
    a = p.parse_args()
    torch.set_num_threads(1)
    import flashckpt.trainer.checkpointer  # noqa: F401  (imported once, before the fork)

    return fork_ranks(a.world, 0, lambda rank: run(a, rank), "restore_fail")


if __name__ == "__main__":
    sys.exit(main())
