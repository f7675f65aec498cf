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
import trainscript

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import torchtitan_train as example


def final_tensors(job: example.Job) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, opt in enumerate(job.optimizers.optimizers):  # the container's optimizers
        out.update(trainscript.final_tensors(job.model, opt, prefix=f"optim.{i}."))
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
    trainscript.add_common_args(p)
    p.add_argument("--torchtitan-site", required=True)
    p.add_argument("--mode", choices=("flash", "native"), default="flash")
    a = p.parse_args()
    sys.path.append(a.torchtitan_site)  # after the venv: torchtitan's own packages only
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    example.init_process_group()
    job = example.build(a.steps, a.every, os.path.join(a.out, "tt"))
    flash = None
    if a.mode == "flash":
        from flashckpt.integrations.torchtitan import FlashCheckpointManager

        flash = FlashCheckpointManager(job.checkpointer, **trainscript.flash_options(a))
        job.checkpointer = flash
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
