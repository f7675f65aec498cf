"""A tiny run on torchtitan's real components, run as a subprocess by
``tests/integrations/test_torchtitan_real.py``: ``examples/torchtitan_train.py``'s ``build`` (its
``CheckpointManager``, ``OptimizersContainer``, ``LRSchedulersContainer``,
``ParallelAwareDataloader``; a small LM with dropout) and ``train`` (the loop of torchtitan's
``Trainer.train``).

torchtitan 0.3.0 is imported from ``--torchtitan-site`` (``scripts/setup.sh`` installs it there
with ``--no-deps``). ``--mode flash`` wraps the manager in ``FlashCheckpointManager``;
``--mode native`` keeps torchtitan's own (DCP saves every ``--every`` steps into
``<out>/tt/checkpoint``, loaded back by the same command); ``native-async`` and
``native-pinned`` the same with its ``async_mode="async"`` / ``"async_with_pinned_mem"``;
``--mode none`` checkpoints nothing. ``--width`` sets the model's width (the state's size) and
``--step-times`` appends ``<step> <seconds>`` for each step, the wall time from the previous
step's ``save()`` return to this one's (so step s's line holds its ``save(s)``), for
``benchmarks/integrations_stall.py``. It appends the step to ``--log``
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

# --mode native*: torchtitan's checkpoint.async_mode
ASYNC_MODES = {
    "native": "disabled",
    "native-async": "async",
    "native-pinned": "async_with_pinned_mem",
}


class _NoCheckpoint:
    """``--mode none``: the manager's interface, checkpointing nothing."""

    def load(self, step: int = -1) -> bool:
        return False

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        return False

    def maybe_wait_for_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


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
    p.add_argument("--mode", choices=(*ASYNC_MODES, "flash", "none"), default="flash")
    p.add_argument("--width", type=int, default=32, help="the model's dim (the state's size)")
    p.add_argument("--step-times", default=None)
    a = p.parse_args()
    sys.path.append(a.torchtitan_site)  # after the venv: torchtitan's own packages only
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    example.init_process_group()
    mode = ASYNC_MODES.get(a.mode, "disabled")
    job = example.build(a.steps, a.every, os.path.join(a.out, "tt"), dim=a.width, async_mode=mode)
    if a.mode == "none":
        job.checkpointer.close()
        job.checkpointer = _NoCheckpoint()
    flash = None
    if a.mode == "flash":
        from flashckpt.integrations.torchtitan import FlashCheckpointManager

        flash = FlashCheckpointManager(job.checkpointer, **trainscript.flash_options(a))
        job.checkpointer = flash
    started: list[int] = []
    last = [time.perf_counter()]

    def after_step(step: int, loss: float) -> None:
        now = time.perf_counter()
        if a.step_times:
            with open(a.step_times, "a") as f:
                f.write(f"{step} {now - last[0]}\n")
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
        last[0] = time.perf_counter()

    example.train(job, a.steps, after_step)
    if a.step_times:  # a memory copy of the state a snapshot holds, for the benchmark
        from ttshard import copy_seconds

        state = [t for t in final_tensors(job).values() if t.numel()]
        with open(a.step_times + ".copy", "w") as f:
            f.write(f"{copy_seconds(state)} {sum(t.nbytes for t in state)}\n")
    safetensors.torch.save_file(final_tensors(job), os.path.join(a.out, "final.safetensors"))
    native = os.path.join(a.out, "tt", "checkpoint")
    report = {
        "restored_step": flash.restored_step if flash else None,
        "restored_from": flash.restored_from if flash else None,
        "exports": sorted(os.listdir(native)) if os.path.isdir(native) else [],
    }
    with open(os.path.join(a.out, "final.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
