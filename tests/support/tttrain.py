"""A tiny torchtitan-shaped training run on torchtitan's real components, run as a subprocess by
``tests/integrations/test_torchtitan_real.py``.

torchtitan 0.3.0 is imported from ``--torchtitan-site`` (``scripts/setup.sh`` installs it there
with ``--no-deps``: its requirements cannot live next to transformers). Its real
``CheckpointManager`` (built from its ``Config`` as its ``Trainer`` builds it), its
``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` (warmup + linear decay),
``ParallelAwareDataloader`` (a ``StatefulDataLoader`` whose state torchtitan pickles) over a
stateful token stream, ``clip_grad_norm_`` and ``cross_entropy_loss``; the loop is the one of
torchtitan's ``Trainer.train``/``train_step``. torchtitan's own models are not used: importing
them needs ``triton`` (``torchtitan.models.common.moe``). The model is a small language model
built from a config, with dropout, so that a resume must restore the RNGs too.

``--mode flash`` wraps the manager in ``FlashCheckpointManager``; ``--mode native`` keeps
torchtitan's own manager (DCP saves every ``--every`` steps into ``<out>/tt/checkpoint``, loaded
back by the same command). It appends the step to ``--log`` after each step's ``save()`` (a
test kills it once enough are there) and writes at the end the model and optimizer tensors, the
learning rates, ``train_state`` and the data loader's state (its bytes) into
``<out>/final.safetensors``, and where each run of the command started into
``<out>/starts.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import safetensors.torch
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset


@dataclass
class TinyLMConfig:
    vocab: int = 64
    dim: int = 32
    layers: int = 2
    dropout: float = 0.1


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
    """An endless stream of samples, each epoch in its own fixed order, that keeps its position
    the way torchtitan's ``HuggingFaceTextDataset`` does (``state_dict``/``load_state_dict``,
    which ``StatefulDataLoader`` calls)."""

    def __init__(self, n: int = 40, seq: int = 17, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, vocab, (n, seq), generator=g)
        self.sample_idx = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        n = len(self.tokens)
        while True:
            epoch, i = divmod(self.sample_idx, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(100 + epoch))
            self.sample_idx += 1
            t = self.tokens[order[i]]
            yield {"input": t[:-1]}, t[1:]

    def state_dict(self) -> dict:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, sd: dict) -> None:
        self.sample_idx = sd["sample_idx"]


class TrainState:
    """What torchtitan's ``Trainer`` registers as ``states={"train_state": self}``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]
        self.ntokens_seen = sd["ntokens_seen"]


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
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.distributed.utils import clip_grad_norm_

    os.makedirs(a.out, exist_ok=True)
    # torchtitan's Trainer runs in a process group (one rank here, gloo)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(42)  # its Trainer seeds once at start (set_determinism)
    model = TinyLM(TinyLMConfig())
    model_parts = [model]
    optimizers = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=".*",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.01, "eps": 1e-8},
            )
        ],
        implementation="for-loop",
    ).build(model_parts=model_parts)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
        optimizers=optimizers, training_steps=a.steps
    )
    dataloader = ParallelAwareDataloader(TokenStream(), dp_rank=0, dp_world_size=1, batch_size=4)
    train_state = TrainState()
    checkpointer = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=a.every, async_mode="disabled"
    ).build(
        dataloader=dataloader,
        model_parts=model_parts,
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=os.path.join(a.out, "tt"),
    )
    flash = None
    if a.mode == "flash":
        from flashckpt.integrations.torchtitan import FlashCheckpointManager

        opts = {k: v for k, v in (("job", a.job), ("node", a.node), ("run_dir", a.run_dir)) if v}
        if a.shm_dir:
            opts["shm_dir"] = a.shm_dir
        checkpointer = flash = FlashCheckpointManager(
            checkpointer,
            storage=a.storage,
            every=a.every,
            persist_every=1,
            agent_idle_timeout=120,
            **opts,
        )

    # torchtitan's Trainer.train
    checkpointer.load(step=-1)
    with open(os.path.join(a.out, "starts.txt"), "a") as f:
        if flash is not None:
            f.write(f"{flash.restored_step} {flash.restored_from}\n")
        else:
            f.write(f"{train_state.step} native\n")
    data_iterator = iter(dataloader)
    while train_state.step < a.steps:
        train_state.step += 1
        # its train_step (no gradient accumulation, no pipeline)
        optimizers.zero_grad()
        input_dict, labels = next(data_iterator)
        pred = model(input_dict["input"])
        loss = cross_entropy_loss(pred, labels) / labels.numel()
        loss.backward()
        train_state.ntokens_seen += labels.numel()
        clip_grad_norm_([p for m in model_parts for p in m.parameters()], 1.0, foreach=True)
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        checkpointer.save(train_state.step, last_step=train_state.step == a.steps)
        with open(a.log, "a") as f:
            f.write(f"{train_state.step}\n")
        if a.step_sleep:
            time.sleep(a.step_sleep)
    checkpointer.close()

    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, opt in enumerate(optimizers.optimizers):
        sd = opt.state_dict()
        for idx, st in sd["state"].items():
            for k, v in st.items():
                t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
                out[f"optim.{i}.{idx}.{k}"] = t.detach().clone()
        for j, g in enumerate(sd["param_groups"]):
            out[f"optim.{i}.group{j}.lr"] = torch.tensor(float(g["lr"]), dtype=torch.float64)
    for k, v in train_state.state_dict().items():
        out[f"train_state.{k}"] = torch.tensor(v)
    for k, v in dataloader.state_dict().items():  # {"dp_rank_0": pickled bytes, "world_size"}
        out[f"dataloader.{k}"] = (
            torch.frombuffer(bytearray(v), dtype=torch.uint8)
            if isinstance(v, bytes)
            else torch.tensor(v)
        )
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in out.items()}, os.path.join(a.out, "final.safetensors")
    )
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
