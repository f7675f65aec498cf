"""torchtitan sharded on several ranks (gloo, CPU), one process per rank: its own Llama 3 model
code (``Llama3Model`` from a tiny config: dim 64, 2 layers), its ``ParallelDims`` and
``parallelize_llama`` (FSDP2, and tensor parallel with ``--tp``), its ``OptimizersContainer``,
``LRSchedulersContainer``, ``ParallelAwareDataloader`` (each data-parallel rank its own part of
the data) and real ``CheckpointManager``, wrapped in ``FlashCheckpointManager`` (``--mode
flash``) or alone (``--mode native``: DCP every ``--every`` steps, loaded back by the same
command); the loop of torchtitan's ``Trainer.train``. Run by
``tests/integrations/test_torchtitan_sharded.py``.

Launched by ``torchrun`` or ``flashckpt run`` (``RANK`` in the environment), or with
``--fork-world N``: the N ranks forked from this process once it has imported torchtitan (a
rank then starts in milliseconds instead of the seconds of its imports; the tests' uninterrupted
reference runs).

Two settings CPU needs, both outside the checkpoint path: torchtitan's ``device_type`` is
``"cuda"`` on a machine without an accelerator (its mesh is built on ``"cpu"`` here), and its
FSDP2 gradient division factor of 1.0 becomes a ``PREMUL_SUM`` that gloo lacks (a SUM
reduction is forced, which multiplies by the same 1.0 afterwards). The attention is torchtitan's
``ScaledDotProductAttention`` (its ``FlexAttention`` has no backward on CPU).

Rank 0 appends the step to ``--log`` after each step's ``save()`` and where each start resumed
to ``<out>/starts.txt``. After ``load()`` and at the end every rank writes its local shards
(``<out>/{restored,final}.rank<r>.safetensors``: each parameter's and optimizer moment's local
piece, the learning rates, ``train_state``, its data loader's state), and rank 0 the gathered
full model and optimizer state (``<out>/{restored,final}.full.safetensors``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import trainscript
from torchtitan_train import TokenStream, TrainState

VOCAB = 128
SEQ = 17


def tiny_llama(dim: int, layers: int, heads: int = 4) -> Any:
    """torchtitan's Llama 3 config, built as its ``debugmodel`` is, smaller."""
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    cfg = Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=VOCAB, param_init=_output_linear_init(dim)
        ),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=layers,
            dim=dim,
            n_heads=heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),
            rope=ComplexRoPE.Config(
                dim=dim // heads, max_seq_len=64, theta=500000, scaling="llama"
            ),
            attn_backend="flex",
        ),
    )
    for layer in cfg.layers:  # FlexAttention has no backward on CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


class Job:
    """torchtitan's components as its ``Trainer.__init__`` builds them, on this rank."""

    def __init__(self, a: argparse.Namespace, world: int) -> None:
        import torchtitan.distributed.parallel_dims as parallel_dims_mod
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.components.optimizer import OptimizersContainer
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.models.llama3 import parallelize_llama

        parallel_dims_mod.device_type = "cpu"  # torchtitan falls back to "cuda" without one
        parallelism = ParallelismConfig(tensor_parallel_degree=a.tp, spmd_backend=a.spmd_backend)
        self.dims = dims = ParallelDims.from_config(parallelism, world)
        dims.build_mesh()
        if dims.dp_enabled:
            batch = dims.get_mesh("batch")
            self.dp_world, self.dp_rank = batch.size(), batch.get_local_rank()
        else:
            self.dp_world, self.dp_rank = 1, 0
        torch.manual_seed(42)  # its Trainer seeds every rank alike (set_determinism)
        with torch.device("meta"):
            cfg = tiny_llama(a.dim, a.layers)
        if a.spmd_backend == "full_dtensor":
            # what torchtitan's Llama3Model.Config.update_from_config does with the job's
            # config: the tensor-parallel placements of each sub-module (without them
            # Module.parallelize shards nothing)
            from torchtitan.models.llama3.sharding import set_llama3_sharding_config

            set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
        with torch.device("meta"):
            model = cfg.build()
        model = parallelize_llama(
            model,
            parallel_dims=dims,
            training=TrainingConfig(),
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder=a.out,
        )
        for m in model.modules():  # gloo has no PREMUL_SUM (torchtitan's factor 1.0 makes one)
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model = model
        adamw = {"lr": 3e-3, "weight_decay": 0.01, "eps": 1e-8}
        self.optimizers = OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=adamw)
            ],
            implementation="for-loop",
        ).build(model_parts=[model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
            optimizers=self.optimizers, training_steps=a.steps
        )
        self.dataloader = ParallelAwareDataloader(
            TokenStream(n=40 * self.dp_world, seq=SEQ, vocab=VOCAB),
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world,
            batch_size=2,
        )
        self.train_state = TrainState()
        mode = a.mode.split(":", 1)[1] if a.mode.startswith("native:") else "disabled"
        self.checkpointer: Any = CheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            interval=a.every,
            async_mode=mode,
            last_save_model_only=False,
            exclude_from_loading=["dataloader"] if a.exclude_dataloader else [],
        ).build(
            dataloader=self.dataloader,
            model_parts=[model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
            base_folder=os.path.join(a.out, "tt"),
        )


def _named_state(job: Job) -> dict[str, Any]:
    """Parameters, optimizer moments and learning rates by name (DTensors as they are)."""
    out: dict[str, Any] = {}
    names = {id(p): n for n, p in job.model.named_parameters()}
    for name, p in job.model.named_parameters():
        out[f"model.{name}"] = p
    for i, opt in enumerate(job.optimizers.optimizers):
        for g, group in enumerate(opt.param_groups):
            out[f"optim.{i}.group{g}.lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64)
            for p in group["params"]:
                for k, v in opt.state.get(p, {}).items():
                    out[f"optim.{i}.{names[id(p)]}.{k}"] = v
    for k, v in job.train_state.state_dict().items():
        out[f"train_state.{k}"] = torch.tensor(v)
    return out


def local_tensors(job: Job) -> dict[str, torch.Tensor]:
    """This rank's pieces: parameters, optimizer moments, learning rates, train_state and its data
    loader's state (the StatefulDataLoader state it pickles, as JSON)."""
    out = {
        k: v.to_local() if hasattr(v, "to_local") else torch.as_tensor(v)
        for k, v in _named_state(job).items()
    }
    loader = job.dataloader.state_dict()
    out["dataloader.world_size"] = torch.tensor(loader["world_size"])
    inner = pickle.loads(loader[f"dp_rank_{job.dp_rank}"])  # what this process just made
    out["dataloader.state"] = torch.frombuffer(
        bytearray(json.dumps(inner, sort_keys=True, default=str).encode()), dtype=torch.uint8
    )
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def full_tensors(job: Job) -> dict[str, torch.Tensor]:
    """The gathered full parameters and optimizer moments (``full_tensor()``: collective), named
    as :func:`local_tensors` names the pieces."""
    return {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in _named_state(job).items()
    }


def copy_seconds(tensors: list[torch.Tensor], rounds: int = 5) -> float:
    """The median time of a memory copy of ``tensors`` into buffers allocated (and touched)
    beforehand: the floor a snapshot of that state cannot go below, measured in the same run
    (``benchmarks/integrations_stall.py`` sets each checkpoint's loss against it)."""
    dst = [torch.empty_like(t) for t in tensors]
    for d in dst:
        d.zero_()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def dump(job: Job, out: str, tag: str, rank: int) -> None:
    safetensors.torch.save_file(
        local_tensors(job), os.path.join(out, f"{tag}.rank{rank}.safetensors")
    )
    full = {k: v.detach().clone().contiguous() for k, v in full_tensors(job).items()}
    if rank == 0:
        safetensors.torch.save_file(full, os.path.join(out, f"{tag}.full.safetensors"))


def train(a: argparse.Namespace, rank: int, world: int) -> int:
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.utils import clip_grad_norm_

    torch.set_num_threads(1)
    job = Job(a, world)
    flash = None
    if a.mode == "none":
        from tttrain import _NoCheckpoint

        job.checkpointer.close()
        job.checkpointer = _NoCheckpoint()
    if a.mode == "flash":
        from flashckpt.integrations.torchtitan import FlashCheckpointManager

        opts = trainscript.flash_options(a)
        opts["agent_idle_timeout"] = a.agent_idle_timeout
        flash = FlashCheckpointManager(job.checkpointer, **opts)
        job.checkpointer = flash
    ts = job.train_state
    job.checkpointer.load(step=-1)
    if rank == 0:
        with open(os.path.join(a.out, "starts.txt"), "a") as f:
            src = f"{flash.restored_step} {flash.restored_from}" if flash else f"{ts.step} native"
            f.write(f"{src} {world}\n")
    if flash is not None and flash.ckpt is not None and flash.restored_from:
        with open(os.path.join(a.out, "restore.jsonl"), "a") as f:  # why memory or storage
            f.write(json.dumps({"rank": rank, **flash.ckpt.status()["restore"]}, default=str))
            f.write("\n")
    if ts.step:
        dump(job, a.out, "restored", rank)
    if a.stop_after_load:
        job.checkpointer.close()
        return 0
    prof = None
    if a.profile and rank == 0:  # where a step's time goes (benchmarks: profile first)
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    last = time.perf_counter()
    data = iter(job.dataloader)
    while ts.step < a.steps:
        ts.step += 1
        job.optimizers.zero_grad()
        inputs, labels = next(data)
        # the global token count: FSDP sums the gradients (torchtitan's division factor 1.0)
        tokens = labels.numel() * job.dp_world
        x = inputs["input"]
        if a.spmd_backend == "full_dtensor":  # as torchtitan's Trainer.post_dataloading_process
            from torchtitan.distributed import full_dtensor

            x, labels, _ = full_dtensor.parallelize_inputs(job.dims, x, labels, {})
        loss = cross_entropy_loss(job.model(x), labels) / tokens
        loss.backward()
        ts.ntokens_seen += tokens
        clip_grad_norm_([p for p in job.model.parameters()], 1.0, foreach=True)
        job.checkpointer.maybe_wait_for_staging()
        job.optimizers.step()
        job.lr_schedulers.step()
        job.checkpointer.save(ts.step, last_step=ts.step == a.steps)
        now = time.perf_counter()
        if rank == 0:
            if a.step_times:
                with open(a.step_times, "a") as f:
                    f.write(f"{ts.step} {now - last}\n")
            with open(a.log, "a") as f:
                f.write(f"{ts.step}\n")
        if a.step_sleep:
            time.sleep(a.step_sleep)
        last = time.perf_counter()
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.profile)
    if a.step_times and rank == 0:  # the state one rank snapshots: its pieces, copied
        pieces = [t for t in local_tensors(job).values() if t.numel()]
        with open(a.step_times + ".copy", "w") as f:
            f.write(f"{copy_seconds(pieces)} {sum(t.nbytes for t in pieces)}\n")
    dump(job, a.out, "final", rank)
    job.checkpointer.close()
    if rank == 0:
        with open(os.path.join(a.out, "final.json"), "w") as f:
            json.dump({"restored_from": flash.restored_from if flash else None}, f)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    trainscript.add_common_args(p)
    p.add_argument("--torchtitan-site", required=True)
    p.add_argument(
        "--mode",
        default="flash",
        help="flash, native (torchtitan's DCP), native:<its async_mode>, none (no checkpoint)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (FSDP2 on the rest)")
    p.add_argument(
        "--spmd-backend",
        default="partial_dtensor",
        choices=("partial_dtensor", "full_dtensor"),
        help="torchtitan's parallelism.spmd_backend (full_dtensor: the TP split in the metadata)",
    )
    p.add_argument("--dim", "--width", type=int, default=64, help="the model's dim")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fork-world", type=int, default=0, help="fork this many ranks from here")
    p.add_argument("--exclude-dataloader", action="store_true")
    p.add_argument("--stop-after-load", action="store_true", help="exit right after load()")
    p.add_argument("--step-times", default=None)
    p.add_argument("--agent-idle-timeout", type=float, default=120)
    p.add_argument("--profile", default=None, help="rank 0's loop under cProfile, to this file")
    a = p.parse_args()
    sys.path.append(a.torchtitan_site)  # after the venv: torchtitan's own packages only
    os.makedirs(a.out, exist_ok=True)
    import torchtitan.components.checkpoint
    import torchtitan.models.llama3  # noqa: F401

    if not a.fork_world:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        code = train(a, dist.get_rank(), dist.get_world_size())
        trainscript.end_process_group()
        trainscript.exit_now(code)
    from shardtrain import fork_ranks

    init = os.path.join(a.out, f"init-{os.getpid()}")

    def run(rank: int) -> int:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(a.fork_world),
            LOCAL_WORLD_SIZE=str(a.fork_world),
        )
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init}",
            rank=rank,
            world_size=a.fork_world,
            timeout=datetime.timedelta(seconds=120),
        )
        code = train(a, rank, a.fork_world)
        trainscript.end_process_group()
        trainscript.exit_now(code)

    return fork_ranks(a.fork_world, 0, run, "ttshard")


if __name__ == "__main__":
    sys.exit(main())
