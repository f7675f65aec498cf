"""A trainer for the agent-kill tests: tinytrain's model and batches, paced by --step-sleep so a
test can kill its node agent several times during one run. Appends ``step loss-hex`` lines to
--log; on exit writes the final model and a line ``start_step restored_from agent_restarts
skips`` to --report."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import safetensors.torch
import torch

sys.path.insert(0, os.path.dirname(__file__))

from tinytrain import make, train_step

import flashckpt


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--node", default="n0")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--shm-dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--log", required=True)
    p.add_argument("--report", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # skipped snapshots while no agent runs are expected
    model, opt, sched = make(0, a.width)
    extras = {"epoch": 0}
    with flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        extras=extras,
        storage=a.storage,
        every=a.every,
        job=a.job,
        node=a.node,
        run_dir=a.run_dir,
        shm_dir=a.shm_dir,
        agent_idle_timeout=120,
    ) as ckpt:
        start, source = ckpt.start_step, ckpt.restored_from
        with open(a.report + ".start", "a") as f:
            f.write(f"{start} {source}\n")
        with open(a.log, "a") as log:
            for step in range(start, a.steps):
                loss = train_step(model, opt, sched, step)
                extras["epoch"] = step // 10
                log.write(f"{step} {loss.hex()}\n")
                log.flush()
                ckpt.step()
                if a.step_sleep:
                    time.sleep(a.step_sleep)
    final = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(final, a.log + ".final.safetensors")
    with open(a.report, "a") as f:
        f.write(
            f"{start} {source} {getattr(ckpt, 'agent_restarts', -1)} {ckpt.stats.skips} "
            f"{ckpt.stats.last_committed_step}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
