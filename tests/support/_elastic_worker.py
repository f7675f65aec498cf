"""A deterministic DDP (gloo) training loop run by ``flashckpt run`` in the elastic tests.

Not collected by pytest. Every process appends JSON-line events to ``<out>/events.jsonl``
(``start``, ``restored``, ``step``, ``done``) with wall-clock times, and rank 0 saves the final
model to ``<out>/final.safetensors``. The job id, node and shared-memory directory come from the
environment the launcher sets (``FLASHCKPT_JOB``, ``FLASHCKPT_NODE``, ...).

The loss at each step depends only on the model, the step and the rank, so a run interrupted
and resumed from any snapshot ends with the bitwise same model as an uninterrupted one.

``--slow-forward S`` makes every forward of this process S seconds slower: a slow GPU, as the
monitor sees it (compute time, which the all-reduce does not even out). Given to one machine's
workers, it makes that machine a straggler.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashckpt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainscript import exit_now  # noqa: E402


def _event(out: str, name: str, **fields: object) -> None:
    record = {
        "t": time.time(),
        "event": name,
        "pid": os.getpid(),
        "node": os.environ.get("FLASHCKPT_NODE"),
        "rank": int(os.environ.get("RANK", "-1")),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        **fields,
    }
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument(
        "--persist-every",
        default="1",
        help="checkpointing()'s persist_every: a number of snapshots, or a duration ('1h')",
    )
    p.add_argument(
        "--sleep-world-size",
        type=int,
        default=0,
        help="sleep --step-sleep only in a world of this many ranks (0: in every world)",
    )
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    p.add_argument("--mode", choices=("sync", "overlap"), default="sync", help="snapshot mode")
    p.add_argument("--slow-forward", type=float, default=0.0, help="seconds added to a forward")
    p.add_argument(
        "--stall-at",
        type=int,
        default=0,
        help="after this many steps done (not in a run restored past them), sleep --stall-s "
        "outside any collective (a data loader stall): only a launcher learns that a peer died",
    )
    p.add_argument("--stall-s", type=float, default=0.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    _event(a.out, "start", t_process=T_START)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if a.slow_forward:  # a hook, not a wrapper: every machine's state dict has the same keys
        model.register_forward_pre_hook(lambda _module, _args: time.sleep(a.slow_forward))
    if a.fsdp:  # every rank holds a piece: a new world size reshards at restore
        from torch.distributed.fsdp import fully_shard

        ddp = fully_shard(model)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
    # The node agent learns of a commit only where rank 0 runs (it writes the manifest), so a
    # flush on another machine would wait its whole timeout: rank 0's flush is the one that
    # guarantees the final step is committed.
    with flashckpt.checkpointing(
        ddp,
        opt,
        scheduler=sched,
        storage=a.storage or None,  # "": memory only
        every=a.every,
        mode=a.mode,
        replicated=not a.fsdp,
        # 1 by default: the tests read the steps they snapshot back from storage.
        persist_every=int(a.persist_every) if a.persist_every.isdigit() else a.persist_every,
        flush_timeout=600.0 if rank == 0 else 1.0,
        # Only rank 0's flush waits for the commit: the others' short flush may end before it
        # and must not turn a committed job into a failed one.
        on_persist_failure="raise" if rank == 0 else "warn",
    ) as ckpt:
        _event(
            a.out,
            "restored",
            start_step=ckpt.start_step,
            restored_from=ckpt.restored_from,
            world_size=dist.get_world_size(),
        )
        for step in range(ckpt.start_step, a.steps):
            g = torch.Generator().manual_seed(10_000 * rank + step)
            x = torch.randn(8, 16, generator=g)
            loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True).sin())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            ckpt.step()
            _event(a.out, "step", step=step, loss=float(loss.item()).hex())
            if a.stall_at and ckpt.steps_done == a.stall_at and ckpt.start_step < a.stall_at:
                _event(a.out, "stalled", step=step)
                time.sleep(a.stall_s)
            if a.sleep_world_size in (0, dist.get_world_size()):
                time.sleep(a.step_sleep)
    if a.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        final = {k: v.detach().clone().contiguous() for k, v in full.items()}
    else:
        final = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if rank == 0:
        safetensors.torch.save_file(final, os.path.join(a.out, "final.safetensors"))
    _event(a.out, "done")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())  # (see trainscript.exit_now: no interpreter teardown after gloo)
