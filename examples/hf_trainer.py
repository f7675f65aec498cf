"""A Hugging Face ``Trainer`` run with flash checkpoints (runs on CPU, downloads nothing).

A 2-layer GPT-2 built from a config trains on random tokens; ``FlashCheckpoint`` snapshots it
into shared memory every ``--every`` steps. Kill it (Ctrl-C, ``kill -9``) and run the same command
again: it resumes from the newest snapshot, in memory or in storage, and ends with the same
weights an uninterrupted run ends with::

    python examples/hf_trainer.py --storage file:///tmp/hf-ck          # kill it midway, then
    python examples/hf_trainer.py --storage file:///tmp/hf-ck          # resumes

Under ``torchrun --nproc-per-node 2`` (or ``flashckpt run``) each rank checkpoints its part.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from flashckpt.integrations.huggingface import FlashCheckpoint


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.tokens = torch.randint(
            0, vocab, (n, length), generator=torch.Generator().manual_seed(1)
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True, help="checkpoint root URL")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10, help="snapshot interval (optimizer steps)")
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    )
    args = TrainingArguments(
        output_dir="/tmp/hf-trainer-example",
        per_device_train_batch_size=8,
        max_steps=a.steps,
        learning_rate=1e-3,
        logging_steps=20,
        save_strategy="no",  # flashckpt checkpoints; the Trainer's own checkpoints can stay on too
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    flash = FlashCheckpoint(storage=a.storage, every=a.every)
    trainer = Trainer(
        model=model, args=args, train_dataset=RandomTokens(256, 64, 128), callbacks=[flash]
    )
    trainer.train()  # no resume_from_checkpoint: the callback resumes by itself
    if torch.distributed.is_initialized():  # under torchrun: end the group before the exit
        torch.distributed.destroy_process_group()  # (docs/training-loop.md, "Ending ...")
    print(
        f"resumed from step {flash.restored_step} ({flash.restored_from}); ran to step "
        f"{trainer.state.global_step}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
