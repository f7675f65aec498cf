"""A Lightning ``Trainer`` run with flash checkpoints (runs on CPU, downloads nothing).

An MLP with dropout trains on random data from a resumable ``StatefulDataLoader``;
``FlashCheckpoint`` snapshots it into shared memory every ``--every`` steps. Kill it (``kill -9``)
and run the same command again: it resumes from the newest snapshot, in memory or in storage,
mid-epoch included, and ends with the weights an uninterrupted run ends with::

    python examples/lightning_trainer.py --storage file:///tmp/pl-ck      # kill it midway, then
    python examples/lightning_trainer.py --storage file:///tmp/pl-ck      # resumes
"""

from __future__ import annotations

import argparse
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from flashckpt.integrations.lightning import FlashCheckpoint


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True, help="checkpoint root URL")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--every", type=int, default=20, help="snapshot interval (optimizer steps)")
    a = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(1))
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    # A resumable position (StatefulDataLoader) and a shuffle order set by (seed, epoch), so a
    # run resumed mid-epoch trains exactly the batches an uninterrupted run would.
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=7)
    loader = StatefulDataLoader(ds, batch_size=32, sampler=sampler)
    flash = FlashCheckpoint(storage=a.storage, every=a.every)
    trainer = pl.Trainer(
        max_steps=a.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        callbacks=[flash],
    )
    trainer.fit(Net(), loader)  # no ckpt_path: the callback resumes by itself
    print(
        f"resumed from step {flash.restored_step} ({flash.restored_from}); ran to step "
        f"{trainer.global_step}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
