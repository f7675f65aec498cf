"""A shuffled, multi-worker data loader that resumes mid-epoch exactly (runs on CPU).

torchdata's ``StatefulDataLoader`` keeps its position (shuffle order, worker state); passed in
``per_rank=`` it is snapshotted with each rank's own RNG states and its generator's state, so a
resumed run sees exactly the batches (and the dropout masks) an uninterrupted run would have, in
the resumed epoch and the ones after it, with any ``num_workers``. Give the loader its own
``generator=``, seeded per rank, so each rank shuffles its own way. Run it twice: the second run
resumes where the first stopped (``--stop-at``), and prints the same batch checksums an
uninterrupted run prints::

    python examples/dataloader_resume.py --storage file:///tmp/dl-ck --stop-at 13
    python examples/dataloader_resume.py --storage file:///tmp/dl-ck
    python examples/dataloader_resume.py --storage file:///tmp/dl-ref   # uninterrupted

It works the same under ``torchrun`` / ``flashckpt run`` (one loader per rank); use a
``DistributedSampler`` there so each rank reads its own part of the data.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

import flashckpt


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True, help="checkpoint root URL")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="snapshot interval (steps)")
    p.add_argument("--stop-at", type=int, default=None, help="stop (as if killed) at this step")
    a = p.parse_args()
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        print("this example needs torchdata: pip install 'flashckpt[data]'", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # where the restore came from
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the model's init and the dropout masks
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())  # 12 batches of 8
    rank = int(os.environ.get("RANK", "0"))  # set by torchrun / flashckpt run
    loader_gen = torch.Generator().manual_seed(1234 + rank)  # the loader's own: seeded per rank
    loader = StatefulDataLoader(
        data, batch_size=8, shuffle=True, num_workers=2, generator=loader_gen
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with flashckpt.checkpointing(
        model, opt, per_rank={"loader": loader}, storage=a.storage, every=a.every
    ) as ckpt:
        print(f"starting at step {ckpt.start_step} (restored from {ckpt.restored_from})")
        while ckpt.steps_done < a.steps:
            for xb, yb in loader:  # after a restore: continues mid-epoch
                if ckpt.steps_done == a.stop_at:
                    raise SystemExit(f"stopped at step {a.stop_at}, as if killed")
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                ckpt.step()
                done, total = ckpt.steps_done, xb.sum().item()
                print(f"step {done:3d}  batch sum {total:+.6f}  loss {loss:.6f}")
                if ckpt.steps_done == a.steps:
                    break
    total = sum(p.double().sum().item() for p in model.parameters())
    print("final parameter sum", f"{total:.12f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
