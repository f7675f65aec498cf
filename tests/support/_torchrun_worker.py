"""A small DDP (gloo) loop for plain ``torchrun --rdzv-backend=flashckpt-etcd`` (not collected).

Usage: torchrun ... _torchrun_worker.py --out DIR --steps N --every K --kill-rank R --kill-at S
[--kills M]

In each of the first M attempts (``TORCHELASTIC_RESTART_COUNT`` 0 to M-1; M is 1 by default)
rank R SIGKILLs itself right after iteration ``start_step + S`` of that attempt is marked done
(in the first attempt, iteration S); torchrun restarts the group, and the restarted ranks
restore. Every process appends JSON lines (``start``, ``restored``, ``done``) to
``<out>/events.jsonl``; ``start`` records the rendezvous store it was handed.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import flashckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainscript import exit_now


def _event(out: str, name: str, **fields: object) -> None:
    record = {
        "t": time.time(),
        "event": name,
        "pid": os.getpid(),
        "rank": int(os.environ.get("RANK", "-1")),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        **fields,
    }
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _mark_done(ckpt: object, index: int) -> None:
    # Iteration `index` (0-based) is done. The library's step convention is changing (issue 10:
    # `step()` with no argument marks one more step); this loop only needs a snapshot now and
    # then, so it follows whichever the installed flashckpt has.
    step = ckpt.step  # type: ignore[attr-defined]
    params = list(inspect.signature(step).parameters.values())
    if params and params[0].default is inspect.Parameter.empty:
        step(index)
    else:
        step()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-at", type=int, default=5)
    p.add_argument("--kills", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    _event(
        a.out,
        "start",
        master_port=os.environ.get("MASTER_PORT"),
        use_agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
    )
    print(f"hello from rank {os.environ.get('RANK')}", flush=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with flashckpt.checkpointing(
        ddp,
        opt,
        storage=a.storage,
        every=a.every,
        persist_every=1,  # the tests read the steps they snapshot back from storage
        replicated=True,
        flush_timeout=120.0 if rank == 0 else 1.0,
    ) as ckpt:
        _event(a.out, "restored", start_step=ckpt.start_step, restored_from=ckpt.restored_from)
        killed_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < a.kills
        kill_at = ckpt.start_step + a.kill_at
        for index in range(ckpt.start_step, a.steps):
            g = torch.Generator().manual_seed(1000 * rank + index)
            x = torch.randn(4, 8, generator=g)
            loss = ddp(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            _mark_done(ckpt, index)
            if killed_attempt and rank == a.kill_rank and index == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)
    _event(a.out, "done")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())  # (see trainscript.exit_now: no interpreter teardown after gloo)
