"""A tiny run on torchtitan's real components, run as a subprocess by
``tests/integrations/test_torchtitan_real.py``: ``examples/torchtitan_train.py``'s ``build`` (its
``CheckpointManager``, ``OptimizersContainer``, ``LRSchedulersContainer``,
``ParallelAwareDataloader``; a small LM with dropout) and ``train`` (the loop of torchtitan's
``Trainer.train``).

torchtitan 0.3.0 is imported from ``--torchtitan-site`` (``scripts/setup.sh`` installs it there
with ``--no-deps``). ``--mode flash`` wraps the manager in ``FlashCheckpointManager``;
``--mode native`` keeps torchtitan's own (DCP saves every ``--every`` steps into
``<out>/tt/checkpoint``, loaded back by the same command). It appends the step to ``--log``
after each step's ``save()`` (a test kills it once enough are there), where each run of the
command started to ``<out>/starts.txt``, and at the end the model and optimizer tensors, the
learning rates, ``train_state`` and the data loader's state (its bytes) to
``<out>/final.safetensors`` and a report to ``<out>/final.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import torchtitan_train as example


def final_tensors(job: example.Job) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in job.model.state_dict().items()}
    for i, opt in enumerate(job.optimizers.optimizers):
        sd = opt.state_dict()
        for idx, st in sd["state"].items():
            for k, v in st.items():
                t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
                out[f"optim.{i}.{idx}.{k}"] = t.detach().clone()
        for j, g in enumerate(sd["param_groups"]):
            out[f"optim.{i}.group{j}.lr"] = torch.tensor(float(g["lr"]), dtype=torch.float64)
    for k, v in job.train_state.state_dict().items():
        out[f"train_state.{k}"] = torch.tensor(v)
    for k, v in job.dataloader.state_dict().items():  # {"dp_rank_0": pickled bytes, ...}
        out[f"dataloader.{k}"] = (
            torch.frombuffer(bytearray(v), dtype=torch.uint8)
            if isinstance(v, bytes)
            else torch.tensor(v)
        )
    return {k: v.contiguous() for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--torchtitan-site", required=True)
    p.add_argument("--storage", default=None)
    p.add_argument("--job", default=None)
    p.add_argument("--node", default=None)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--shm-dir", default=None)
    p.add_argument("--mode", choices=("flash", "native"), default="flash")
    p.add_argument("--out", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0)
    a = p.parse_args()
    sys.path.append(a.torchtitan_site)  # after the venv: torchtitan's own packages only
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    example.init_process_group()
    job = example.build(a.steps, a.every, os.path.join(a.out, "tt"))
    flash = None
    if a.mode == "flash":
        from flashckpt.integrations.torchtitan import FlashCheckpointManager

        opts = {k: v for k, v in (("job", a.job), ("node", a.node), ("run_dir", a.run_dir)) if v}
        if a.shm_dir:
            opts["shm_dir"] = a.shm_dir
        job.checkpointer = flash = FlashCheckpointManager(
            job.checkpointer,
            storage=a.storage,
            every=a.every,
            persist_every=1,
            agent_idle_timeout=120,
            **opts,
        )
    started: list[int] = []

    def after_step(step: int, loss: float) -> None:
        if not started:  # this run's first step: where it started
            started.append(step - 1)
            start = (
                f"{flash.restored_step} {flash.restored_from}" if flash else f"{step - 1} native"
            )
            with open(os.path.join(a.out, "starts.txt"), "a") as f:
                f.write(start + "\n")
        with open(a.log, "a") as f:
            f.write(f"{step}\n")
        if a.step_sleep:
            time.sleep(a.step_sleep)

    example.train(job, a.steps, after_step)
    safetensors.torch.save_file(final_tensors(job), os.path.join(a.out, "final.safetensors"))
    report = {
        "restored_step": flash.restored_step if flash else None,
        "restored_from": flash.restored_from if flash else None,
        "exports": sorted(os.listdir(os.path.join(a.out, "tt", "checkpoint"))),
    }
    with open(os.path.join(a.out, "final.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
