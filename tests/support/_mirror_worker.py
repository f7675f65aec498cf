"""One rank of a 2-rank gloo run with a remote tier (``mirror=``); run one per rank by
test_mirror.py. Each rank is a machine of its own (node ``n<rank>``, its own auto-started node
agent), both persisting to one storage root and mirroring to one mirror root. Writes the steps
snapshotted and the rank's counters to ``<out>.<rank>.json``.
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

import flashckpt


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--storage", "--mirror", "--job", "--run-dir", "--init-file", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    torch.set_num_threads(1)
    init_gloo(a.init_file, a.rank, 2, 60, local_world=1)
    model, opt, sched = make(0)
    saved = []
    with flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        storage=a.storage,
        mirror=a.mirror,
        mirror_every=2,
        persist_every=1,  # every snapshot persisted: the mirror counts over them
        job=a.job,
        node=f"n{a.rank}",
        run_dir=a.run_dir,
        every=0,
        replicated=True,
        keep=10,
        agent_idle_timeout=60,
    ) as ckpt:
        for step in range(a.steps):
            train_step(model, opt, sched, step)
            ckpt.step()
            handle = ckpt.save(mode="sync")
            saved.append(handle.step)
            assert ckpt.flush() == handle.step  # the primary tier commits each step
        # One more step: the exit's final snapshot (mirrored too).
        train_step(model, opt, sched, a.steps)
        ckpt.step()
    with open(f"{a.out}.{a.rank}.json", "w") as f:
        json.dump({"saved": saved, "mirror_marked": ckpt.stats.mirror_marked}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
