"""One rank training a dropout model over the loader recipe of docs/training-loop.md, for
tests/trainer/test_loader_recipe.py: ``--recipe new`` gives the loader its own generator (the
recipe), ``--recipe old`` leaves it on the global RNG (the recipe before issue 30). With
``--hold-at N`` it writes ``<log>.held`` after the Nth step's snapshot and waits there to be
SIGKILLed. It logs each step's loss (hex) and saves the final model next to ``--log``."""

from __future__ import annotations

import argparse
import os
import sys
import time

import safetensors.torch
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import flashckpt


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--storage", "--job", "--node", "--run-dir", "--shm-dir", "--log"):
        p.add_argument(name, required=True)
    p.add_argument("--recipe", choices=["new", "old"], required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hold-at", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())  # 12 batches of 4
    torch.manual_seed(0)
    kw = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    if a.recipe == "new":
        kw["generator"] = torch.Generator().manual_seed(1234 + rank)
    loader = StatefulDataLoader(data, **kw)  # type: ignore[arg-type]
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),  # draws its masks from the global RNG at every step
        torch.nn.Linear(32, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with (
        flashckpt.checkpointing(
            model,
            opt,
            per_rank={"loader": loader},
            storage=a.storage,
            job=a.job,
            node=a.node,
            run_dir=a.run_dir,
            shm_dir=a.shm_dir,
            every=5,
            mode="sync",
            agent_idle_timeout=120,
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
                if ckpt.steps_done == a.hold_at:
                    open(a.log + ".held", "w").close()
                    while True:  # SIGKILLed here by the test
                        time.sleep(1)
                if ckpt.steps_done == a.steps:
                    break
    final = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(final, a.log + ".final.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
