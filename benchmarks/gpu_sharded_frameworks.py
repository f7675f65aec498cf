"""The sharded framework paths of issue 42 that only a GPU machine runs, for gpu_check.sh.

Run under ``torchrun --standalone --nproc-per-node N`` (N GPUs, 1 or more), one check per call:

- ``lightning-mp``: Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in
  ``configure_model()``) on CUDA with ``FlashCheckpoint(every=2)``: a fit of 6 steps, then a new
  Trainer resumes it (from memory) and fits to 8 steps; the state of every rank equals (``torch.
  equal``) that of an uninterrupted 8-step fit, per rank.
- ``lightning-fsdp1``: ``FSDPStrategy`` (FSDP1) on CUDA: the adapter refuses it, naming
  ModelParallelStrategy (on CPU Lightning refuses it first: "requires a GPU accelerator").
- ``hf-fsdp2``: the HF ``Trainer`` with ``fsdp=True, fsdp_config={"fsdp_version": 2}`` on CUDA:
  accelerate enables FSDP here (``is_fsdp_enabled``), and ``FlashCheckpoint`` refuses it,
  saying why (accelerate shards the model after the point where the callback restores).

Prints one JSON line (rank 0) and exits non-zero when a check does not hold.

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_sharded_frameworks.py lightning-mp
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from typing import Any

import torch

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def _pl_module() -> Any:
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
            )

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if getattr(self, "_sharded", False) or self.device_mesh is None:
                return
            self._sharded = True
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, i: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Net()


def _loader() -> Any:
    from torch.utils.data.distributed import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    sampler = DistributedSampler(ds, num_replicas=WORLD, rank=RANK, shuffle=True, seed=7)
    return StatefulDataLoader(ds, batch_size=8, sampler=sampler)


def _fit(strategy: Any, steps: int, callbacks: list) -> Any:
    import lightning.pytorch as pl

    model = _pl_module()
    t = pl.Trainer(
        accelerator="gpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t.fit(model, _loader())
    return model, t


def _local(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    def loc(v: Any) -> torch.Tensor:
        return (v.to_local() if hasattr(v, "to_local") else v).detach().cpu().clone()

    out = {f"model.{k}": loc(v) for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{k}"] = loc(v)
    return out


def lightning_mp() -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from flashckpt.integrations.lightning import FlashCheckpoint

    def strategy() -> Any:
        return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)

    ref_model, ref_t = _fit(strategy(), 8, [])
    ref = _local(ref_model, ref_t.optimizers[0])
    job = "g" + uuid.uuid4().hex[:10]
    root = tempfile.mkdtemp(prefix="fc-gpu-mp-")
    opts = {"every": 2, "persist_every": 1, "job": job, "agent_idle_timeout": 60}
    _fit(strategy(), 6, [FlashCheckpoint(f"file://{root}", **opts)])
    fc = FlashCheckpoint(f"file://{root}", **opts)
    model, t = _fit(strategy(), 8, [fc])
    got = _local(model, t.optimizers[0])
    differ = sorted(k for k in ref if not torch.equal(ref[k], got[k]))
    return {
        "restored_step": fc.restored_step,
        "restored_from": fc.restored_from,
        "differ": differ,
        "ok": fc.restored_step == 6 and not differ and got.keys() == ref.keys(),
    }


def lightning_fsdp1() -> dict:
    from flashckpt.integrations.lightning import FlashCheckpoint

    try:
        _fit("fsdp", 2, [FlashCheckpoint(None, every=1, job="g" + uuid.uuid4().hex[:10])])
    except NotImplementedError as e:
        return {"refused": str(e), "ok": "ModelParallelStrategy" in str(e)}
    return {"refused": None, "ok": False}


def hf_fsdp2() -> dict:
    from transformers import Trainer, TrainingArguments

    from flashckpt.integrations.huggingface import FlashCheckpoint

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x: Any, labels: Any = None) -> Any:
            return {"loss": torch.nn.functional.mse_loss(self.lin(x), labels)}

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="fc-gpu-hf-"),
        fsdp=True,
        fsdp_config={"fsdp_version": 2},
        report_to=[],
        max_steps=2,
    )
    enabled = Trainer(model=M(), args=args).is_fsdp_enabled
    try:
        Trainer(model=M(), args=args, callbacks=[FlashCheckpoint(None, every=1)])
    except NotImplementedError as e:
        return {"is_fsdp_enabled": enabled, "refused": str(e), "ok": enabled and "FSDP" in str(e)}
    return {"is_fsdp_enabled": enabled, "refused": None, "ok": False}


CHECKS = {"lightning-mp": lightning_mp, "lightning-fsdp1": lightning_fsdp1, "hf-fsdp2": hf_fsdp2}


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        print(f"usage: gpu_sharded_frameworks.py {{{','.join(CHECKS)}}}", file=sys.stderr)
        return 64
    if not torch.cuda.is_available():
        print("gpu_sharded_frameworks.py: no CUDA device", file=sys.stderr)
        return 2
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    result = {"check": sys.argv[1], "world": WORLD, **CHECKS[sys.argv[1]]()}
    if RANK == 0:
        print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown after NCCL/gloo (see tests/support/trainscript.py)
