"""One worker of the failover benchmark: a tiny DDP (gloo) training loop that logs timestamps
(with ``--fsdp-gib``: a sharded FSDP2 job of that much state per machine instead).

Run by ``flashckpt run`` (``--mode flashckpt``: flash checkpoints, resume from memory or
storage) or by plain ``torchrun`` (``--mode torchsave``: rank 0 writes ``torch.save`` files with
fsync every ``--every`` steps, every rank loads the newest on start). Appends JSON lines to
``<out>/events.jsonl``: ``start`` (with the process start time, taken before any import),
``pg_ready``, ``restored`` (with the step resumed from) and one ``step`` per finished step.
"""

from __future__ import annotations

import time

T_PROCESS = time.time()

import argparse  # noqa: E402
import datetime  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashckpt  # noqa: E402


def _event(out: str, name: str, **fields: object) -> None:
    record = {
        "t": time.time(),
        "event": name,
        "pid": os.getpid(),
        "rank": int(os.environ.get("RANK", "-1")),
        "node": os.environ.get("FLASHCKPT_NODE", os.environ.get("BENCH_NODE", "")),
        **fields,
    }
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _latest_torch_save(directory: str) -> str | None:
    path = os.path.join(directory, "latest.pt")
    return path if os.path.exists(path) else None


def _torch_save(directory: str, state: dict[str, object]) -> None:
    tmp = os.path.join(directory, f"latest.pt.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, "latest.pt"))


def main() -> int:
    # A worker stopped by its launcher (SIGTERM) prints where every thread was: a worker that
    # hangs instead of failing when its peer dies shows where in the launcher's log.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("flashckpt", "torchsave"), required=True)
    p.add_argument("--storage", required=True, help="flashckpt URL or torch.save directory")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--width", type=int, default=256)
    p.add_argument(
        "--fsdp-gib",
        type=float,
        default=0.0,
        help="> 0: a sharded job instead (FSDP2, Linear(W, W) layers, AdamW) with this many "
        "GiB of state per machine; the DDP job otherwise",
    )
    p.add_argument("--fsdp-width", type=int, default=1024, help="W of the sharded job's layers")
    p.add_argument(
        "--persist-every",
        type=int,
        default=0,
        help="> 0: persist every Nth snapshot (persist_every=N); 0: the library's default",
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    _event(a.out, "start", t_process=T_PROCESS)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    _event(a.out, "pg_ready")
    torch.manual_seed(0)
    sharded = a.fsdp_gib > 0
    ddp: torch.nn.Module
    if sharded:
        from torch.distributed.fsdp import fully_shard

        width = a.fsdp_width
        world = dist.get_world_size()
        # fp32 params + two AdamW moments: 12 bytes a parameter, split over the machines.
        layers = max(world, round(a.fsdp_gib * world * 2**30 / 12 / (width * width + width)))
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        ddp = model
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    else:
        width = a.width
        model = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
        )
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    _event(a.out, "ddp_ready")

    def train(step: int) -> None:
        g = torch.Generator().manual_seed(10_000 * rank + step)
        x = torch.randn(16 if not sharded else 8, width, generator=g)
        out = ddp(x)
        loss = (
            out.square().mean()
            if sharded
            else torch.nn.functional.mse_loss(out, x.sum(1, keepdim=True).sin())
        )
        opt.zero_grad()
        loss.backward()
        opt.step()

    if a.mode == "torchsave":
        os.makedirs(a.storage, exist_ok=True)
        start = 0
        path = _latest_torch_save(a.storage)
        if path is not None:
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start = int(state["step"])
        _event(a.out, "restored", start_step=start, restored_from="torch.save" if path else None)
        for step in range(start, a.steps):
            train(step)
            if rank == 0 and (step + 1) % a.every == 0:
                _torch_save(
                    a.storage,
                    {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1},
                )
            _event(a.out, "step", step=step)
            time.sleep(a.step_sleep)
        return 0

    # Only the machine that runs rank 0 learns of commits (it writes the manifest): a flush
    # elsewhere would wait its whole timeout.
    with flashckpt.checkpointing(
        ddp,
        opt,
        storage=a.storage or None,  # "": memory only
        every=a.every,
        **({"persist_every": a.persist_every} if a.persist_every > 0 else {}),
        replicated=not sharded,
        flush_timeout=600.0 if rank == 0 else 1.0,
        # Only rank 0's flush waits for the commit: the others' short flush may end before it
        # and must not turn a committed job into a failed one.
        on_persist_failure="raise" if rank == 0 else "warn",
    ) as ckpt:
        t_entered = time.time()  # the event's time: status() asks the agent, after the entry
        st = ckpt.status()
        _event(
            a.out,
            "restored",
            t=t_entered,
            start_step=ckpt.start_step,
            restored_from=ckpt.restored_from,
            # The restore pipeline's own time (the rest of the entry: the agent link, the
            # slots, the prefault's start) and, from peer memory, the pull's phases.
            restore_pipeline_s=st.get("restore_s"),
            pull_phases_s=(st.get("restore") or {}).get("pull_phases_s"),
            prefault=(st.get("prefault") or {}).get("resolved"),
            entry_phases_s=(st.get("entry") or {}).get("phases_s"),
        )
        for step in range(ckpt.start_step, a.steps):
            # Where a step's time goes (the first one after a resume against steady ones).
            t0 = time.perf_counter()
            train(step)
            t1 = time.perf_counter()
            ckpt.step()
            _event(a.out, "step", step=step, train_s=t1 - t0, ckpt_step_s=time.perf_counter() - t1)
            time.sleep(a.step_sleep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
