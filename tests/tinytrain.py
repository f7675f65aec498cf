"""A tiny deterministic training loop used by the tests (in-process and as a subprocess).

Run as a script it trains with flashckpt and appends ``step loss-hex`` lines to a log, so a test
can kill it at any instant, restart it, and compare the trajectory with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import safetensors.torch
import torch

import flashckpt


def make(seed: int = 0, width: int = 32) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.BatchNorm1d(width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),  # consumes the global RNG: resume must restore it exactly
        torch.nn.Linear(width, 1),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    return model, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def train_step(model, opt, sched, step: int) -> float:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.item())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--node", default="n0")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--log", required=True)
    p.add_argument("--mode", default="overlap")
    p.add_argument("--report", default=None, help="write 'start_step restored_from' here")
    p.add_argument("--kill-in-copy", type=int, default=0, help="SIGKILL self mid-copy of save N")
    a = p.parse_args()
    if a.kill_in_copy:
        kill_in_copy(a.kill_in_copy)
    torch.set_num_threads(1)
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
        mode=a.mode,
        agent_idle_timeout=120,
    ) as ckpt:
        if a.report:
            with open(a.report, "a") as f:
                f.write(f"{ckpt.start_step} {ckpt.restored_from}\n")
        with open(a.log, "a") as log:
            for step in range(ckpt.start_step, a.steps):
                loss = train_step(model, opt, sched, step)
                extras["epoch"] = step // 10
                log.write(f"{step} {loss.hex()}\n")
                log.flush()
                ckpt.step()
    final = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(final, a.log + ".final.safetensors")
    return 0


def kill_in_copy(nth: int) -> None:
    """Fault injection: the nth snapshot copy with tensors SIGKILLs this process halfway."""
    from flashckpt.snapshot import Snapshotter

    orig = Snapshotter.copy
    calls = [0]

    def copy(self, sm, pairs):  # type: ignore[no-untyped-def]
        if pairs:
            calls[0] += 1
            if calls[0] == nth:
                orig(self, sm, pairs[: len(pairs) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
        orig(self, sm, pairs)

    Snapshotter.copy = copy  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())
