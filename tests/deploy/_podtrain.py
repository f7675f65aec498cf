"""One rank of a deterministic 2-rank DDP (gloo) job, run as a trainer "pod" by
tests/deploy/test_deploy_topology.py: it connects to the node agent that the environment names
(``FLASHCKPT_JOB/NODE/RUN_DIR`` and ``agent="connect"``: it never starts an agent of its own),
as a trainer container of deploy/kubernetes does.

It appends ``step loss-hex`` lines to ``--log``, writes ``rank start_step restored_from`` to
``--report`` once restored, and saves its final model next to the log. With ``--gate STEP:PATH``
it stops before training STEP, creates ``PATH.at<rank>`` and waits until PATH exists (so a test
can act on the topology while the ranks are at a known step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from tinytrain import init_gloo, make
from trainscript import exit_now

import flashckpt


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--storage", "--log", "--init-file", "--report"):
        p.add_argument(name, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--gate", action="append", default=[], help="STEP:PATH (repeatable)")
    a = p.parse_args()
    gates = {int(s): path for s, path in (g.split(":", 1) for g in a.gate)}
    torch.set_num_threads(1)
    init_gloo(a.init_file, a.rank, 2, 60, local_rank=a.rank, local_world=2)
    model, opt, sched = make(0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    with flashckpt.checkpointing(
        ddp,
        opt,
        scheduler=sched,
        storage=a.storage,
        every=a.every,
        persist_every=1,
        mode="sync",
        agent="connect",
    ) as ckpt:
        with open(a.report, "a") as f:
            f.write(f"{a.rank} {ckpt.start_step} {ckpt.restored_from}\n")
        with open(a.log, "a") as log:
            for step in range(ckpt.start_step, a.steps):
                if step in gates:
                    Path(f"{gates[step]}.at{a.rank}").touch()
                    while not os.path.exists(gates[step]):
                        time.sleep(0.02)
                g = torch.Generator().manual_seed(10_000 * a.rank + step)
                x = torch.randn(8, 16, generator=g)
                loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True).sin())
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                log.write(f"{step} {float(loss.item()).hex()}\n")
                log.flush()
                ckpt.step()
    final = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(final, a.log + ".final.safetensors")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())  # (see trainscript.exit_now: no interpreter teardown after gloo)
