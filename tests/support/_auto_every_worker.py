"""One rank of a 2-rank gloo loop with ``every="auto"``; run one per rank by test_interval.py.

Rank 1's iterations are slower (a sleep), so the two ranks measure different step times and
propose different intervals; they must still snapshot at the same steps. Writes the labels of
the snapshots taken and ``status()["every"]`` after each to ``<out>.<rank>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from tinytrain import init_gloo, make, train_step

import flashckpt


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--storage", "--job", "--run-dir", "--init-file", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--rank", type=int, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    init_gloo(a.init_file, a.rank, 2, 30, local_world=2)
    model, opt, sched = make(0)
    labels, decisions = [], []
    with flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        storage=a.storage,
        job=a.job,
        node="n0",
        run_dir=a.run_dir,
        every="auto",
        mtbf_s=0.5,
        replicated=False,
        agent_idle_timeout=60,
    ) as ckpt:
        step = 0
        while len(labels) < 4 and step < 3000:
            train_step(model, opt, sched, step)
            if a.rank == 1:
                time.sleep(0.002)
            handle = ckpt.step()
            if handle is not None:
                labels.append(handle.step)
                decisions.append(ckpt.status()["every"])
            step += 1
    with open(f"{a.out}.{a.rank}.json", "w") as f:
        json.dump({"labels": labels, "decisions": decisions}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
