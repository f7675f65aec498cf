"""Train a small GPT-style transformer with flash checkpointing (one process per rank).

Launch with torchrun (or ``flashckpt run`` later), e.g.::

    torchrun --standalone --nproc-per-node 2 examples/gpt_train.py --storage file:///tmp/ck

The data is synthetic text from a small deterministic grammar, tokenised as bytes. Everything that
decides the next batch is in the checkpoint (model, AdamW, LR schedule, RNG, data position), so a
resumed run continues exactly where the snapshot was taken.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import math
import os
import random
import sys

import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flashckpt

WORDS = {
    "det": ["the", "a", "every", "no", "one"],
    "noun": ["machine", "rank", "snapshot", "model", "cluster", "gradient", "agent", "step"],
    "verb": ["saves", "loads", "trains", "restarts", "joins", "copies", "persists", "waits for"],
    "adj": ["fast", "dead", "standby", "sharded", "complete", "torn", "elastic", "quiet"],
}


def corpus(n_sentences: int = 4000, seed: int = 7) -> bytes:
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        w = {k: rng.choice(v) for k, v in WORDS.items()}
        out.append(
            f"{w['det']} {w['adj']} {w['noun']} {w['verb']} {rng.choice(WORDS['det'])} "
            f"{rng.choice(WORDS['noun'])}."
        )
    return " ".join(out).encode()


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, dropout=0.1)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int = 256, ctx: int = 64, d: int = 128, layers: int = 2, heads: int = 4
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--storage", required=True, help="checkpoint root URL")
    p.add_argument("--job", default=None)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5, help="snapshot interval (steps)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--no-checkpoint", action="store_true", help="plain loop, no flashckpt")
    p.add_argument("--out", default=None, help="directory for progress, reports and final state")
    a = p.parse_args()

    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()

    torch.manual_seed(0)  # same init on every rank (DDP also broadcasts it)
    model = GPT(ctx=a.ctx)
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warm = 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps))),
    )
    torch.manual_seed(1000 + rank)  # per-rank dropout stream, restored with the checkpoint
    extras = {"data_pos": rank * a.batch * a.ctx}
    out = a.out or "."
    os.makedirs(out, exist_ok=True)

    def train(start: int, ckpt: flashckpt.Checkpointer | None) -> None:
        progress = open(os.path.join(out, f"progress-r{rank}.txt"), "a")  # noqa: SIM115
        with progress:
            for step in range(start, a.steps):
                pos = extras["data_pos"]
                idx = (
                    pos + torch.arange(a.batch)[:, None] * a.ctx + torch.arange(a.ctx + 1)
                ) % len(data)
                chunk = data[idx]
                logits = net(chunk[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, 256), chunk[:, 1:].reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                extras["data_pos"] = (pos + world * a.batch * a.ctx) % len(data)
                progress.write(
                    json.dumps({"step": step, "loss": loss.item(), "pid": os.getpid()}) + "\n"
                )
                progress.flush()
                if ckpt is not None:
                    ckpt.step()

    if a.no_checkpoint:
        train(0, None)
    else:
        with flashckpt.checkpointing(
            net, opt, scheduler=sched, extras=extras, storage=a.storage, every=a.every, job=a.job
        ) as ckpt:
            with open(os.path.join(out, "report.txt"), "a") as f:
                f.write(
                    json.dumps(
                        {
                            "rank": rank,
                            "pid": os.getpid(),
                            "start_step": ckpt.start_step,
                            "restored_from": ckpt.restored_from,
                        }
                    )
                    + "\n"
                )
            train(ckpt.start_step, ckpt)
            status = ckpt.status()
        if rank == 0:
            print(
                f"[rank 0] snapshots: {status['saves']}, skipped: {status['skips']}, "
                f"median stall {1e3 * (status['median_stall_s'] or 0):.2f} ms "
                f"({status['copy_mode']['resolved']} copies), "
                f"last committed step: {ckpt.stats.last_committed_step}",
                flush=True,
            )
    if rank == 0:
        final = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        safetensors.torch.save_file(final, os.path.join(out, "final.safetensors"))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # A multi-rank run ends without the interpreter's teardown once its outputs are written: with
    # torch 2.13's gloo, a DDP wrapper keeps the group (and gloo's worker threads) alive past
    # destroy_process_group(), and a worker thread freeing tensors during teardown aborts a run
    # that ended well (docs/training-loop.md#ending-a-multi-rank-run). `flashckpt run`'s
    # pre-warmed workers end so too.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
