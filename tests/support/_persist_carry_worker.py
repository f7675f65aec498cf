"""One rank of a 2-rank gloo run for test_persist_every.py's carried mark: each rank is a machine
of its own (node ``n<rank>``), linked to a node agent the test serves in its own process
(``agent="connect"``), so the test can hold one machine's persister back.

It takes ``--saves`` snapshots (one per step, only the first marked by ``--persist-every``),
rank 0 first waiting after the first until its own agent has persisted its part of it (so only
rank 1 finds its mark lost), then writes its counters to ``<out>.<rank>.json`` and waits for the
file ``<out>.go`` before leaving the ``with`` block (the exit's flush would persist the newest
snapshot anyway: the test looks at storage before it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from tinytrain import init_gloo, make, train_step
from waiting import wait_until

import flashckpt
from flashckpt.trainer.config import Stats


def _wait(what: str, cond: object, timeout: float = 240.0) -> None:
    wait_until(cond, what, timeout)  # type: ignore[arg-type]


def _heard(stats: Stats, step: int) -> bool:
    return stats.last_persisted_step is not None and stats.last_persisted_step >= step


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--storage", "--job", "--run-dir", "--init-file", "--out", "--persist-every"):
        p.add_argument(name, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--saves", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    init_gloo(a.init_file, a.rank, 2, 300, local_world=1)
    pe = a.persist_every
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        storage=a.storage,
        persist_every=int(pe) if pe.isdigit() else pe,
        job=a.job,
        node=f"n{a.rank}",
        run_dir=a.run_dir,
        agent="connect",
        every=0,
        mode="sync",
        replicated=True,
        keep=10,
    ) as ckpt:
        for step in range(a.saves):
            train_step(model, opt, sched, step)
            ckpt.step()
            ckpt.save()
            if step == 0 and a.rank == 0:
                _wait("its agent to persist step 1", lambda: _heard(ckpt.stats, 1))
            dist.barrier()
        s = ckpt.stats
        with open(f"{a.out}.{a.rank}.json", "w") as f:
            json.dump(
                {
                    "marked": s.persist_marked,
                    "carried": s.persist_carried,
                    "last_persisted": s.last_persisted_step,
                },
                f,
            )
        _wait("the test's go", lambda: os.path.exists(f"{a.out}.go"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
