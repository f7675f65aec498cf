"""A tiny Lightning run (an MLP with dropout, random data, no downloads) for the integration
tests and the benchmark, run as a subprocess.

``--mode flash`` checkpoints with ``flashckpt.integrations.lightning.FlashCheckpoint``;
``--mode native`` with Lightning's own ``ModelCheckpoint(every_n_train_steps=...)`` and
``fit(ckpt_path="last")``; ``--mode none`` not at all. ``--loader stateful`` trains from
torchdata's ``StatefulDataLoader`` (a resumable position), ``plain`` from a ``DataLoader``. It
appends ``global_step`` lines to ``--log`` as steps end and writes, at the end, the final model
and optimizer tensors (``final.safetensors``) and a report (``final.json``) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from typing import Any

import safetensors.torch
import torch
import trainscript
from trainscript import final_tensors

RANK = int(os.environ.get("RANK", "0"))  # under torchrun: rank 0 logs and writes the results
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def build(seed: int = 0, width: int = 64, parallel: str = "none"):  # type: ignore[no-untyped-def]
    """The module and the data set; ``parallel`` ``fsdp2`` or ``fsdp2tp`` gives the module a
    ``configure_model()`` (for ``ModelParallelStrategy``) that applies ``fully_shard`` on the
    data-parallel mesh dim, after tensor parallelism (the first Linear column-wise, the second
    row-wise) on the tensor-parallel dim for ``fsdp2tp``."""
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.sharded = False
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, width),
                torch.nn.ReLU(),
                torch.nn.Dropout(0.2),  # consumes the global RNG: resume must restore it
                torch.nn.Linear(width, width),
                torch.nn.ReLU(),
                torch.nn.Linear(width, 1),
            )
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_model(self) -> None:
            if parallel == "none" or self.sharded:
                return
            self.sharded = True
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh
            if parallel == "fsdp2tp":
                from torch.distributed.tensor.parallel import (
                    ColwiseParallel,
                    RowwiseParallel,
                    parallelize_module,
                )

                plan = {"0": ColwiseParallel(), "3": RowwiseParallel()}
                parallelize_module(self.net, mesh["tensor_parallel"], plan)
            dp = mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=dp)
            fully_shard(self.net, mesh=dp)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(seed)
    model = Net()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(80, 16, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    return model, ds


def _dcp_async_callback():  # type: ignore[no-untyped-def]
    import lightning.pytorch as pl

    class DcpAsync(pl.Callback):
        """The benchmark's peer for sharded runs: ``torch.distributed.checkpoint.async_save``
        of the module's and the optimizer's sharded state every ``every`` steps, through one
        ``DefaultStager`` kept for the run (its staging buffers cached; async staging; no pinned
        memory on CPU). The next step waits for the staging, the next save for the write."""

        def __init__(self, root: str, every: int) -> None:
            self.root, self.every = root, every
            self.stager: Any = None
            self.resp: Any = None
            self.last = -1
            self.pg: Any = None

        def on_train_start(self, trainer, module):  # type: ignore[no-untyped-def]
            import torch.distributed as dist

            # A group of its own: the background write's collectives must not interleave with
            # the training's on the default group (torchtitan does the same).
            self.pg = dist.new_group(backend="gloo") if dist.is_initialized() else None

        def on_train_batch_start(self, trainer, module, batch, i):  # type: ignore[no-untyped-def]
            if self.resp is not None:
                self.resp.staging_completion.result()

        def on_train_batch_end(self, trainer, module, outputs, batch, i):  # type: ignore[no-untyped-def]
            step = trainer.global_step
            if step % self.every or step == self.last:
                return
            self.last = step
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            if self.resp is not None:
                self.resp.upload_completion.result()
            if self.stager is None:
                self.stager = DefaultStager(StagingOptions(False, False, True, False))
            sd = {
                "model": get_model_state_dict(module),
                "optim": get_optimizer_state_dict(module, trainer.optimizers[0]),
            }
            self.resp = dcp.async_save(
                sd,
                checkpoint_id=os.path.join(self.root, f"step-{step}"),
                async_stager=self.stager,
                process_group=self.pg,
            )

        def on_train_end(self, trainer, module):  # type: ignore[no-untyped-def]
            if self.resp is not None:
                self.resp.staging_completion.result()
                self.resp.upload_completion.result()
            if self.stager is not None:
                self.stager.close()

    return DcpAsync


def local_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """:func:`final_tensors` of a sharded run: each DTensor's local piece on this rank."""

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    sd = {k: local(v) for k, v in model.state_dict().items()}
    out = {f"model.{k}": v.detach().clone().contiguous() for k, v in sd.items()}
    for idx, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            t = local(v) if isinstance(v, torch.Tensor) else torch.tensor(v)
            out[f"optim.{idx}.{k}"] = t.detach().clone().contiguous()
    for i, g in enumerate(opt.param_groups):
        out[f"optim.group{i}.lr"] = torch.tensor(float(g["lr"]), dtype=torch.float64)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    trainscript.add_common_args(p)
    p.add_argument(
        "--mode",
        choices=("flash", "native", "native-async", "dcp-async", "none"),
        default="flash",
    )
    p.add_argument("--loader", choices=("stateful", "plain"), default="stateful")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--step-times", default=None)
    p.add_argument("--width", type=int, default=64, help="hidden width (the state's size)")
    p.add_argument(
        "--parallel",
        choices=("none", "fsdp2", "fsdp2tp"),
        default="none",
        help="ModelParallelStrategy: FSDP2 on all ranks, or FSDP2 x TP on a (world/2, 2) mesh",
    )
    p.add_argument(
        "--pause-at",
        type=int,
        default=0,
        help="every rank stops (sleeps) once this step is logged: a test kills it there",
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import logging

    import lightning.pytorch as pl

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    os.makedirs(a.out, exist_ok=True)
    model, ds = build(width=a.width, parallel=a.parallel)
    tp = 2 if a.parallel == "fsdp2tp" else 1
    dp_size, dp_rank = WORLD // tp, RANK // tp  # the ranks of a TP group train the same batch
    if a.loader == "stateful":
        from torch.utils.data.distributed import DistributedSampler
        from torchdata.stateful_dataloader import StatefulDataLoader

        # The shuffle order a function of (seed, epoch): Lightning calls set_epoch. (With
        # shuffle=True and a generator= instead, torchdata 0.11's loader restored mid-epoch
        # draws the next epoch's order from another generator state than an uninterrupted run.)
        sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=7)
        loader = StatefulDataLoader(ds, batch_size=8, sampler=sampler)
    else:
        gen = torch.Generator().manual_seed(7)  # the loader's own RNG (its shuffle order)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, generator=gen)

    class StepLog(pl.Callback):
        def __init__(self) -> None:
            self.t = time.perf_counter()
            self.last = -1
            self.pg: Any = None

        def on_train_start(self, trainer, module):  # type: ignore[no-untyped-def]
            if flash is not None and RANK == 0:  # where each run of the command started
                with open(os.path.join(a.out, "starts.txt"), "a") as f:
                    f.write(f"{flash.restored_step} {flash.restored_from}\n")

        def on_train_batch_end(self, trainer, module, outputs, batch, i):  # type: ignore[no-untyped-def]
            if trainer.global_step != self.last and RANK == 0:
                self.last = trainer.global_step
                data = float(batch[0].sum()).hex()  # which samples the step trained on
                with open(a.log, "a") as f:
                    f.write(f"{trainer.global_step} {float(outputs['loss']).hex()} {data}\n")
                now = time.perf_counter()
                if a.step_times:
                    with open(a.step_times, "a") as f:
                        f.write(f"{trainer.global_step} {now - self.t}\n")
                if a.step_sleep:
                    time.sleep(a.step_sleep)
                self.t = time.perf_counter()
            while a.pause_at and trainer.global_step == a.pause_at:
                time.sleep(1)  # until SIGKILLed (the test waits for what it needs first)

    callbacks: list = [StepLog()]
    plugins: list = []
    flash = None
    ckpt_path = None
    native_dir = os.path.join(a.out, "pl")
    if a.mode == "flash":
        from flashckpt.integrations.lightning import FlashCheckpoint

        flash = FlashCheckpoint(**trainscript.flash_options(a))
        callbacks.append(flash)
    elif a.mode in ("native", "native-async"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        # (save_last="link" links to a file an async save has not written yet: lightning 2.6
        # fails with FileNotFoundError; the async mode keeps its files only)
        last: Any = "link" if a.mode == "native" else None
        callbacks.append(
            ModelCheckpoint(dirpath=native_dir, every_n_train_steps=a.every, save_last=last)
        )
        if os.path.exists(os.path.join(native_dir, "last.ckpt")):
            ckpt_path = "last"
        if a.mode == "native-async":  # Lightning's own background writer (a thread)
            from lightning.pytorch.plugins.io import AsyncCheckpointIO

            plugins.append(AsyncCheckpointIO())
    elif a.mode == "dcp-async":
        callbacks.append(_dcp_async_callback()(native_dir, a.every))
    strategy: Any = "ddp" if WORLD > 1 else "auto"
    if a.parallel != "none":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=dp_size, tensor_parallel_size=tp)
    trainer = pl.Trainer(
        max_steps=a.steps,
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        accumulate_grad_batches=a.accum,
        callbacks=callbacks,
        plugins=plugins or None,
        logger=False,
        enable_checkpointing=a.mode in ("native", "native-async"),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=a.out,
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path, weights_only=False if ckpt_path else None)
    opt = trainer.optimizers[0]
    if a.parallel != "none":  # every rank its own pieces (DTensors' local shards)
        name = f"final.rank{RANK}.safetensors"
        safetensors.torch.save_file(local_tensors(model, opt), os.path.join(a.out, name))
    trainscript.end_process_group()
    if RANK != 0:  # data parallel: every rank ends with the same state
        return 0
    if a.parallel == "none":
        tensors = final_tensors(model, opt)
        safetensors.torch.save_file(tensors, os.path.join(a.out, "final.safetensors"))
    report = {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "restored_step": flash.restored_step if flash else ckpt_path,
        "restored_from": flash.restored_from if flash else None,
    }
    with open(os.path.join(a.out, "final.json"), "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    trainscript.exit_now(main())  # (see exit_now: no interpreter teardown after gloo)
