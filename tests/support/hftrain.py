"""A tiny Hugging Face Trainer run (GPT-2 of 2 layers from a config, random tokens, no
downloads) for the integration tests and the benchmark, run as a subprocess.

``--mode flash`` checkpoints with ``flashckpt.integrations.huggingface.FlashCheckpoint``;
``--mode native`` with the Trainer's own checkpoints (``save_steps``) and, when one exists,
``resume_from_checkpoint=True``; ``--mode none`` not at all. Every run of one command line is the
same job: started again after a kill, it resumes. It appends ``global_step`` lines to ``--log``
as steps end (a test kills it once enough are there) and writes, at the end, the final model and
optimizer tensors (``final.safetensors``), the log history and the resume report
(``final.json``) into ``--out``. ``--step-times`` appends each step's wall time (for the stall
benchmark).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import safetensors.torch
import torch
import trainscript
from trainscript import final_tensors

RANK = int(os.environ.get("RANK", "0"))  # under torchrun: rank 0 logs and writes the results


def build(seed: int = 0, width: int = 32) -> tuple[torch.nn.Module, torch.utils.data.Dataset]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=width, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)  # dropout 0.1 everywhere: resume must restore the RNGs
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, 64, (40, 16), generator=g)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(tokens)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": tokens[i], "labels": tokens[i]}

    return model, Tokens()


def fsdp2_on_cpu() -> None:
    """Lifts accelerate's device-type gate on FSDP: ``AcceleratorState`` enables the FSDP plugin
    only for a multi-accelerator type (MULTI_GPU, ...), so on CPU it drops it and trains
    unsharded. Set to FSDP, the rest of accelerate's FSDP2 path (``fsdp2_prepare_model``:
    ``fully_shard`` per block, the optimizer pointed at the DTensor parameters) runs as it is,
    on gloo: the Trainer + FSDP2 run the adapter must resume, on a machine without a GPU."""
    import accelerate.state as acc_state
    from accelerate.utils import DistributedType

    init = acc_state.AcceleratorState.__init__

    def patched(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    acc_state.AcceleratorState.__init__ = patched  # type: ignore[method-assign]


def main() -> int:
    p = argparse.ArgumentParser()
    trainscript.add_common_args(p)
    p.add_argument("--mode", choices=("flash", "native", "none"), default="flash")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--step-times", default=None)
    p.add_argument("--width", type=int, default=32, help="n_embd (the state's size)")
    p.add_argument(
        "--fsdp2-cpu",
        action="store_true",
        help="accelerate's FSDP2 plugin on CPU (gloo), its device-type gate lifted",
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.fsdp2_cpu:
        fsdp2_on_cpu()
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.makedirs(a.out, exist_ok=True)
    model, ds = build(width=a.width)

    class StepLog(TrainerCallback):
        def __init__(self) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            if RANK == 0:
                with open(a.log, "a") as f:
                    f.write(f"{state.global_step}\n")
            if a.step_sleep:
                time.sleep(a.step_sleep)

        def on_train_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            if RANK == 0 and flash is not None:  # where each run of the command started
                with open(os.path.join(a.out, "starts.txt"), "a") as f:
                    f.write(f"{flash.restored_step} {flash.restored_from}\n")

        def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            now = time.perf_counter()
            if a.step_times and state.global_step > 0 and RANK == 0:
                with open(a.step_times, "a") as f:
                    f.write(f"{state.global_step} {now - self.t}\n")
            self.t = now

    callbacks: list = [StepLog()]
    flash = None
    if a.mode == "flash":
        from flashckpt.integrations.huggingface import FlashCheckpoint

        flash = FlashCheckpoint(**trainscript.flash_options(a))
        callbacks.append(flash)
    native_dir = os.path.join(a.out, "hf")
    args = TrainingArguments(
        output_dir=native_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=a.accum,
        max_steps=a.steps,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=3,
        weight_decay=0.01,
        logging_steps=3,
        save_strategy="steps" if a.mode == "native" else "no",
        save_steps=a.every,
        report_to=[],
        use_cpu=True,
        seed=42,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **(
            {
                "fsdp": "full_shard",
                "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True},
            }
            if a.fsdp2_cpu
            else {}
        ),
    )
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)
    resume = None
    if a.mode == "native":
        from transformers.trainer_utils import get_last_checkpoint

        resume = get_last_checkpoint(native_dir) if os.path.isdir(native_dir) else None
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.optimizer is not None
    tensors = final_tensors(trainer.model, trainer.optimizer)
    if a.fsdp2_cpu:  # each rank's own pieces (DTensor local shards), one file per rank
        from torch.distributed.tensor import DTensor

        assert trainer.is_fsdp_enabled and isinstance(tensors["model.lm_head.weight"], DTensor)
        tensors = {
            k: (v.to_local() if isinstance(v, DTensor) else v).contiguous()
            for k, v in tensors.items()
        }
        name = "final.safetensors" if RANK == 0 else f"final.rank{RANK}.safetensors"
        safetensors.torch.save_file(tensors, os.path.join(a.out, name))
    trainscript.end_process_group()
    if RANK != 0:  # data parallel: every rank ends with the same state
        return 0
    if not a.fsdp2_cpu:
        safetensors.torch.save_file(tensors, os.path.join(a.out, "final.safetensors"))
    history = [
        {k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k}
        for e in trainer.state.log_history
    ]
    report = {
        "log_history": history,
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "total_flos": trainer.state.total_flos,
        "restored_step": flash.restored_step if flash else resume,
        "restored_from": flash.restored_from if flash else None,
    }
    with open(os.path.join(a.out, "final.json"), "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    trainscript.exit_now(main())  # (see exit_now: no interpreter teardown after gloo)
