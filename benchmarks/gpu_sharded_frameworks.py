"""The sharded framework paths of issue 42 that only a GPU machine runs, for gpu_check.sh.

Run under ``torchrun --standalone --nproc-per-node N`` (N GPUs, 1 or more), one check per call:

- ``lightning-mp``: Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in
  ``configure_model()``) on CUDA with ``FlashCheckpoint(every=2)``: a fit of 6 steps, then a new
  Trainer resumes it (from memory) and fits to 8 steps; the state of every rank equals (``torch.
  equal``) that of an uninterrupted 8-step fit, per rank.
- ``lightning-fsdp1``: ``FSDPStrategy`` (FSDP1) on CUDA: the adapter refuses it, naming
  ModelParallelStrategy (on CPU Lightning refuses it first: "requires a GPU accelerator").
- ``hf-fsdp2``: the HF ``Trainer`` (a tiny GPT-2) with accelerate's FSDP2 plugin
  (``fsdp="full_shard", fsdp_config={"fsdp_version": 2}``) on CUDA and ``FlashCheckpoint(every=2)``:
  a 6-step run, then a new Trainer resumes it (from memory) to 8 steps; every rank's pieces equal
  (``torch.equal``) an uninterrupted 8-step run's.
- ``hf-fsdp1``: the same with ``"fsdp_version": 1``: the adapter refuses it, naming FSDP2 (on CPU
  accelerate's FSDP1 plugin will not even build: "no available devices found").

Prints one JSON line (rank 0) and exits non-zero when a check does not hold.

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_sharded_frameworks.py lightning-mp
    python benchmarks/gpu_sharded_frameworks.py --cpu-check   # imports only, no GPU needed
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


def _hf_run(steps: int, fsdp_version: int, callbacks: list) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    )
    tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
    ds = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="fc-gpu-hf-"),
        fsdp="full_shard",
        fsdp_config={"fsdp_version": fsdp_version, "reshard_after_forward": True},
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        report_to=[],
        save_strategy="no",
        seed=42,
        use_cpu=not torch.cuda.is_available(),  # (a dry run of the check on CPU, gate lifted)
        disable_tqdm=True,
    )
    t = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)
    t.train()
    return t


def hf_fsdp2() -> dict:
    """accelerate's FSDP2 plugin: a 6-step run with FlashCheckpoint, then a new Trainer resumes
    it (from memory) to 8 steps; every rank's pieces equal an uninterrupted 8-step run's. (A
    constant LR: the 6-step run's schedule is the 8-step run's.)"""
    from flashckpt.integrations.huggingface import FlashCheckpoint

    ref_t = _hf_run(8, 2, [])
    enabled = bool(ref_t.is_fsdp_enabled)
    ref = _local(ref_t.model, ref_t.optimizer)
    job = "g" + uuid.uuid4().hex[:10]
    root = tempfile.mkdtemp(prefix="fc-gpu-hf2-")
    opts = {"every": 2, "persist_every": 1, "job": job, "agent_idle_timeout": 60}
    _hf_run(6, 2, [FlashCheckpoint(f"file://{root}", **opts)])
    fc = FlashCheckpoint(f"file://{root}", **opts)
    t = _hf_run(8, 2, [fc])
    got = _local(t.model, t.optimizer)
    differ = sorted(k for k in ref if not torch.equal(ref[k], got[k]))
    return {
        "is_fsdp_enabled": enabled,
        "restored_step": fc.restored_step,
        "restored_from": fc.restored_from,
        "differ": differ,
        "ok": enabled and fc.restored_step == 6 and not differ and got.keys() == ref.keys(),
    }


def hf_fsdp1() -> dict:
    """accelerate's FSDP1 plugin: refused by the adapter, naming FSDP2 as the fix."""
    from flashckpt.integrations.huggingface import FlashCheckpoint

    try:
        _hf_run(2, 1, [FlashCheckpoint(None, every=1, job="g" + uuid.uuid4().hex[:10])])
    except NotImplementedError as e:
        return {"refused": str(e), "ok": "FSDP1" in str(e) and '"fsdp_version": 2' in str(e)}
    return {"refused": None, "ok": False}


def _cpu_check() -> int:
    """What runs without a GPU (``--cpu-check``): the checks' imports and their refusal of a
    machine without CUDA (exit 2); used by the suite to keep this script importable."""
    import lightning.pytorch  # noqa: F401
    import transformers  # noqa: F401

    import flashckpt.integrations.huggingface
    import flashckpt.integrations.lightning  # noqa: F401

    print(json.dumps({"checks": sorted(CHECKS)}))
    return 0


CHECKS = {
    "lightning-mp": lightning_mp,
    "lightning-fsdp1": lightning_fsdp1,
    "hf-fsdp2": hf_fsdp2,
    "hf-fsdp1": hf_fsdp1,
}


def main() -> int:
    if sys.argv[1:] == ["--cpu-check"]:
        return _cpu_check()
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
