"""A DDP (gloo) loop for the straggler-swap test, run by ``flashckpt run``; not collected.

``$FCE_SLOW_FORWARD_S`` makes every forward of this machine's workers that much slower (a slow
GPU, as the monitor sees it: compute time, which the all-reduce does not even out). Every
process appends ``restored`` and ``step`` events to ``<out>/events.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import flashckpt


class _Slow(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, delay: float) -> None:
        super().__init__()
        self.inner = inner
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return self.inner(x)


def _event(out: str, name: str, **fields: object) -> None:
    record = {
        "t": time.time(),
        "event": name,
        "node": os.environ.get("FLASHCKPT_NODE"),
        "rank": int(os.environ.get("RANK", "-1")),
        **fields,
    }
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--every", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model = _Slow(inner, float(os.environ.get("FCE_SLOW_FORWARD_S", "0")))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    with flashckpt.checkpointing(ddp, opt, storage=a.storage, every=a.every) as ckpt:
        _event(a.out, "restored", start_step=ckpt.start_step, world_size=dist.get_world_size())
        for step in range(ckpt.start_step, a.steps):
            g = torch.Generator().manual_seed(10_000 * rank + step)
            x = torch.randn(8, 16, generator=g)
            loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True).sin())
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step(step)
            _event(a.out, "step", step=step)
            time.sleep(0.02)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
