"""torchtitan's checkpointing replaced by flashckpt, on torchtitan's own components (runs on CPU,
downloads nothing).

torchtitan's real ``CheckpointManager`` (built from its ``Config``, as its ``Trainer`` builds
it), ``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` (warmup, then linear decay) and
``ParallelAwareDataloader`` drive a small language model built from a config; the loop is the one
of torchtitan's ``Trainer.train``. One line hands the manager to ``FlashCheckpointManager``, which
snapshots every ``--every`` steps into shared memory (its node agent persists them to
``--storage``). Kill it (Ctrl-C, ``kill -9``) and run the same command again: it resumes from the
newest snapshot, in memory or in storage, and ends with the weights an uninterrupted run ends
with::

    pip install torchtitan==0.3.0
    python examples/torchtitan_train.py --storage file:///tmp/tt-ck     # kill it midway, then
    python examples/torchtitan_train.py --storage file:///tmp/tt-ck     # resumes

In this repository ``scripts/setup.sh`` installs torchtitan (``--no-deps``) into
``.venv/torchtitan-site``: add ``--torchtitan-site .venv/torchtitan-site``. torchtitan's own
models are not used here: importing them needs ``triton``. In a torchtitan job the same line goes
into its ``Trainer.__init__`` (docs/integrations/torchtitan.md).
``tests/integrations/test_torchtitan_real.py`` runs this file's ``build`` and ``train``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset


@dataclass
class TinyLMConfig:
    vocab: int = 64
    dim: int = 32
    layers: int = 2
    dropout: float = 0.1  # draws from torch's RNG: a resume must restore it


class TinyLM(torch.nn.Module):
    def __init__(self, c: TinyLMConfig) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(c.vocab, c.dim)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(c.dim),
                torch.nn.Linear(c.dim, 2 * c.dim),
                torch.nn.GELU(),
                torch.nn.Dropout(c.dropout),
                torch.nn.Linear(2 * c.dim, c.dim),
            )
            for _ in range(c.layers)
        )
        self.norm = torch.nn.LayerNorm(c.dim)
        self.output = torch.nn.Linear(c.dim, c.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.output(self.norm(h))


class TokenStream(IterableDataset):
    """An endless stream of random-token samples, each epoch in its own order, that keeps its
    position as torchtitan's ``HuggingFaceTextDataset`` does (``state_dict`` and
    ``load_state_dict``, which the ``StatefulDataLoader`` under torchtitan's loader calls)."""

    def __init__(self, n: int = 40, seq: int = 17, vocab: int = 64) -> None:
        self.tokens = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))
        self.sample_idx = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        n = len(self.tokens)
        while True:
            epoch, i = divmod(self.sample_idx, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(100 + epoch))
            self.sample_idx += 1
            t = self.tokens[order[i]]
            yield {"input": t[:-1]}, t[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sample_idx = sd["sample_idx"]


class TrainState:
    """What torchtitan's ``Trainer`` registers in the manager as ``states={"train_state": self}``:
    the step, which ``FlashCheckpointManager`` checks against the step it restores."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]
        self.ntokens_seen = sd["ntokens_seen"]


@dataclass
class Job:
    model: TinyLM
    optimizers: Any  # torchtitan's OptimizersContainer
    lr_schedulers: Any  # its LRSchedulersContainer
    dataloader: Any  # its ParallelAwareDataloader
    train_state: TrainState
    checkpointer: Any  # its CheckpointManager, or FlashCheckpointManager around it


def build(
    steps: int, every: int, folder: str, *, dim: int = 32, async_mode: str = "disabled"
) -> Job:
    """torchtitan's components as its ``Trainer.__init__`` builds them (one rank, no
    parallelism), its ``CheckpointManager`` saving into ``folder``/checkpoint every ``every``
    steps (``async_mode`` as its ``checkpoint.async_mode``); ``dim``: the model's width."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    torch.manual_seed(42)  # its Trainer seeds once at the start
    model = TinyLM(TinyLMConfig(dim=dim))
    adamw = {"lr": 3e-3, "weight_decay": 0.01, "eps": 1e-8}
    optimizers = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=adamw)
        ],
        implementation="for-loop",
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
        optimizers=optimizers, training_steps=steps
    )
    dataloader = ParallelAwareDataloader(TokenStream(), dp_rank=0, dp_world_size=1, batch_size=4)
    train_state = TrainState()
    checkpointer = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=every, async_mode=async_mode
    ).build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=folder,
    )
    return Job(model, optimizers, lr_schedulers, dataloader, train_state, checkpointer)


def train(job: Job, steps: int, after_step: Callable[[int, float], None] | None = None) -> None:
    """torchtitan's ``Trainer.train`` and ``train_step`` (no gradient accumulation, no pipeline):
    ``load()`` once, ``save(step, last_step=...)`` after every step, ``close()`` at the end."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.utils import clip_grad_norm_

    ts = job.train_state
    job.checkpointer.load(step=-1)
    data_iterator = iter(job.dataloader)
    while ts.step < steps:
        ts.step += 1
        job.optimizers.zero_grad()
        input_dict, labels = next(data_iterator)
        loss = cross_entropy_loss(job.model(input_dict["input"]), labels) / labels.numel()
        loss.backward()
        ts.ntokens_seen += labels.numel()
        clip_grad_norm_(list(job.model.parameters()), 1.0, foreach=True)
        job.checkpointer.maybe_wait_for_staging()
        job.optimizers.step()
        job.lr_schedulers.step()
        job.checkpointer.save(ts.step, last_step=ts.step == steps)
        if after_step is not None:
            after_step(ts.step, loss.item())
    job.checkpointer.close()


def init_process_group() -> None:
    """torchtitan's components run in a process group: one rank here (gloo, a free port)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True, help="checkpoint root URL")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10, help="snapshot interval (steps)")
    p.add_argument("--folder", default="/tmp/torchtitan-example", help="torchtitan's dump folder")
    p.add_argument("--torchtitan-site", default=None, help="a --target install of torchtitan")
    a = p.parse_args()
    if a.torchtitan_site:
        sys.path.append(os.path.abspath(a.torchtitan_site))
    from flashckpt.integrations.torchtitan import FlashCheckpointManager

    init_process_group()
    job = build(a.steps, a.every, a.folder)
    # The one line (in torchtitan's Trainer.__init__, after it builds self.checkpointer):
    job.checkpointer = FlashCheckpointManager(job.checkpointer, storage=a.storage, every=a.every)

    def report(step: int, loss: float) -> None:
        if step % 20 == 0 or step == a.steps:
            print(f"step {step} loss {loss:.4f}", flush=True)

    train(job, a.steps, report)
    ck = job.checkpointer
    print(f"done at step {job.train_state.step} (resumed: {ck.restored_from} {ck.restored_step})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
