"""One rank training a dropout model over the loader recipe of docs/training-loop.md, for
tests/trainer/test_loader_recipe.py: ``--recipe new`` gives the loader its own generator (the
recipe), ``--recipe old`` leaves it on the global RNG (the recipe before issue 30), with
``--num-workers`` workers. It logs each step's loss (hex) to ``--steps-log`` (``LOG``) and saves
the final model next to it. With ``--hold-at N`` the first run to get there writes its pid to
``LOG.held`` after the Nth step's snapshot and waits there to be SIGKILLed (a run that finds
``LOG.held`` trains on: the same command restarted by ``flashckpt run``). With ``--orphan-fifo
PATH`` every loader worker outlives its trainer: once the trainer is dead, the worker appends
its pid to ``PATH.orphans`` and blocks until the FIFO's writer closes it. The job's flags
(``--storage``, ``--job``, ...) may be left out under ``flashckpt run``, which sets them."""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time
from typing import Any

import safetensors.torch
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import flashckpt

PR_SET_PDEATHSIG = 1


def outlive_the_trainer(fifo: str) -> None:
    """A loader worker's ``worker_init_fn``: when its trainer dies, the kernel sends it SIGUSR2;
    it then records its pid and blocks on the FIFO instead of noticing the death and exiting
    (as a worker stuck in a slow read would)."""

    def orphaned(*_: Any) -> None:
        with open(fifo + ".orphans", "a") as f:
            f.write(f"{os.getpid()}\n")
        os.read(os.open(fifo, os.O_RDONLY), 1)  # until the test closes its end
        os._exit(0)

    signal.signal(signal.SIGUSR2, orphaned)
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGUSR2) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--storage", "--job", "--node", "--run-dir", "--shm-dir"):
        p.add_argument(name)
    p.add_argument("--steps-log", dest="log", required=True)
    p.add_argument("--recipe", choices=["new", "old"], required=True)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hold-at", type=int, default=0)
    p.add_argument("--orphan-fifo")
    a = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())  # 12 batches of 4
    torch.manual_seed(0)
    kw: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": a.num_workers}
    if a.recipe == "new":
        kw["generator"] = torch.Generator().manual_seed(1234 + rank)
    if a.orphan_fifo:
        kw["worker_init_fn"] = lambda _: outlive_the_trainer(a.orphan_fifo)
    loader = StatefulDataLoader(data, **kw)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),  # draws its masks from the global RNG at every step
        torch.nn.Linear(32, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = {
        k: v
        for k, v in (
            ("storage", a.storage),
            ("job", a.job),
            ("node", a.node),
            ("run_dir", a.run_dir),
            ("shm_dir", a.shm_dir),
        )
        if v is not None
    }
    hold = a.hold_at and not os.path.exists(a.log + ".held")
    with (
        flashckpt.checkpointing(
            model,
            opt,
            per_rank={"loader": loader},
            every=5,
            mode="sync",
            agent_idle_timeout=120,
            **job,
        ) as ckpt,
        open(a.log, "a") as log,
    ):
        log.write(f"start {ckpt.start_step} {ckpt.restored_from}\n")
        while ckpt.steps_done < a.steps:
            for xb, yb in loader:
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                ckpt.step()
                log.write(f"{ckpt.steps_done} {float(loss.item()).hex()}\n")
                log.flush()
                if hold and ckpt.steps_done == a.hold_at:
                    with open(a.log + ".held.tmp", "w") as f:
                        f.write(f"{os.getpid()}\n")
                    os.rename(a.log + ".held.tmp", a.log + ".held")
                    while True:  # SIGKILLed here by the test
                        time.sleep(1)
                if ckpt.steps_done == a.steps:
                    break
    final = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(final, a.log + ".final.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
