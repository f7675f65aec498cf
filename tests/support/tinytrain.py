"""A tiny deterministic training loop used by the tests (in-process and as a subprocess).

Run as a script it trains with flashckpt and appends ``step loss-hex`` lines to a log, so a test
can kill it (or its node agent) at any instant, restart it, and compare the trajectory with an
uninterrupted run. ``--report`` gets ``start_step restored_from`` when the run starts,
``--final-report`` ``start_step restored_from agent_restarts skips last_committed_step`` when it
ends; ``--step-sleep`` paces the run so a test can kill the agent several times during it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

import flashckpt


def make(seed: int = 0, width: int = 32) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.BatchNorm1d(width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),  # consumes the global RNG: resume must restore it exactly
        torch.nn.Linear(width, 1),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    return model, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def train_step(model, opt, sched, step: int) -> float:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.item())


def train_steps(ck, model, opt, sched, start: int, stop: int) -> None:
    """Trains steps ``start`` .. ``stop - 1``, with ``ck.step()`` after each."""
    for step in range(start, stop):
        train_step(model, opt, sched, step)
        ck.step()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True, help='checkpoint root URL; "": memory only')
    p.add_argument("--job", required=True)
    p.add_argument("--node", default="n0")
    p.add_argument("--run-dir", required=True)
    p.add_argument(
        "--shm-dir", default=None, help="shared-memory directory (default: the library's)"
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--log", required=True)
    p.add_argument("--mode", default="overlap")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after a step")
    p.add_argument("--report", default=None, help="write 'start_step restored_from' here")
    p.add_argument("--final-report", default=None, help="write the end-of-run line here")
    p.add_argument("--quiet", action="store_true", help="ignore warnings (skipped snapshots)")
    p.add_argument("--kill-in-copy", type=int, default=0, help="SIGKILL self mid-copy of save N")
    p.add_argument("--persist-every", default="1", help="snapshots (int) or a duration ('1h')")
    p.add_argument("--barrier", default=None, help="enter once 2 processes are ready in DIR")
    p.add_argument("--storage-options", default=None, help="a JSON file: storage_options=")
    a = p.parse_args()
    if a.kill_in_copy:
        kill_in_copy(a.kill_in_copy)
    torch.set_num_threads(1)
    if a.quiet:
        warnings.simplefilter("ignore")  # skipped snapshots while no agent runs are expected
    model, opt, sched = make(0, a.width)
    extras = {"epoch": 0}
    if a.barrier:
        barrier(a.barrier, a.job)
    with flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        extras=extras,
        storage=a.storage or None,  # "": memory only
        **({"storage_options": _json_file(a.storage_options)} if a.storage_options else {}),
        every=a.every,
        job=a.job,
        node=a.node,
        run_dir=a.run_dir,
        mode=a.mode,
        persist_every=int(a.persist_every) if a.persist_every.isdigit() else a.persist_every,
        agent_idle_timeout=120,
        **({"shm_dir": a.shm_dir} if a.shm_dir else {}),
    ) as ckpt:
        start, source = ckpt.start_step, ckpt.restored_from
        if a.report:
            with open(a.report, "a") as f:
                f.write(f"{start} {source}\n")
        with open(a.log, "a") as log:
            for step in range(start, a.steps):
                loss = train_step(model, opt, sched, step)
                extras["epoch"] = step // 10
                log.write(f"{step} {loss.hex()}\n")
                log.flush()
                ckpt.step()
                if a.step_sleep:
                    time.sleep(a.step_sleep)
    final = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(final, a.log + ".final.safetensors")
    if a.final_report:
        with open(a.final_report, "a") as f:
            f.write(
                f"{start} {source} {getattr(ckpt, 'agent_restarts', -1)} {ckpt.stats.skips} "
                f"{ckpt.stats.last_committed_step}\n"
            )
    return 0


def _json_file(path: str) -> dict:
    with open(path) as f:
        doc: dict = json.load(f)
    return doc


def logged_losses(log: Path) -> list[tuple[int, str]]:
    """The ``(step, loss as float.hex)`` lines a trainer's ``--log`` holds so far (none: no
    file yet; a line being written is passed over)."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.append((int(parts[0]), parts[1]))
    return out


def assert_same_run(
    log: Path, ref: dict[int, str], ref_final: dict[str, torch.Tensor], steps: int
) -> None:
    """Every step ``0..steps - 1`` is in the trainer's ``log``, every line (of every incarnation
    of a killed and resumed run) has the uninterrupted run's loss ``ref[step]``, and the final
    model (``<log>.final.safetensors``) is bitwise ``ref_final``."""
    seen = logged_losses(log)
    assert {s for s, _ in seen} == set(range(steps))
    for step, loss in seen:
        assert loss == ref[step], f"step {step}: {loss} != {ref[step]}"
    final = safetensors.torch.load_file(str(log) + ".final.safetensors")
    for k, v in ref_final.items():
        assert torch.equal(final[k], v), k


def persisted_steps(ck: Any, model: Any, opt: Any, sched: Any, start: int, stop: int) -> None:
    """Trains steps ``start``..``stop - 1``, each saved (sync) and flushed: committed before
    the next is taken (the agent persists the newest complete snapshot, so without the flush
    a step may be skipped for the next)."""
    for i in range(start, stop):
        train_step(model, opt, sched, i)
        ck.step()
        ck.save(mode="sync")
        assert ck.flush() == i + 1


@contextlib.contextmanager
def trained(env: Any, steps: int = 4, every: int = 2, **ckpt_kw: Any) -> Iterator[Any]:
    """``checkpointing()`` of a fresh model (``make(0)``) for ``env``'s job, connected to its
    agent (``ckpt_kw`` adds to or overrides ``env.ckpt_kwargs(agent="connect")``), ``steps``
    steps trained (a snapshot every ``every``) and flushed: yields the open checkpointer."""
    model, opt, sched = make(0)
    kw = env.ckpt_kwargs(**{"agent": "connect", **ckpt_kw})
    with flashckpt.checkpointing(model, opt, scheduler=sched, every=every, **kw) as ck:
        train_steps(ck, model, opt, sched, 0, steps)
        assert ck.flush() == steps
        yield ck


def trained_run(env: Any, **kw: Any) -> None:
    """A whole run of :func:`trained`: entry, the steps, the flush, the exit."""
    with trained(env, **kw):
        pass


def init_gloo(
    init_file: str,
    rank: int,
    world: int,
    timeout_s: float,
    *,
    local_world: int | None = None,
    local_rank: int | None = None,
) -> None:
    """Joins the test's gloo group (rendezvous through ``init_file``) as ``rank`` of ``world``,
    with ``LOCAL_WORLD_SIZE`` (and ``LOCAL_RANK``) set first as a launcher would: the ranks on
    one machine, which the checkpointer reads."""
    import datetime

    import torch.distributed as dist

    if local_world is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    if local_rank is not None:
        os.environ["LOCAL_RANK"] = str(local_rank)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def barrier(d: str, name: str, parties: int = 2) -> None:
    """Waits until ``parties`` processes (this one included) are ready in ``d``: two trainers
    then enter ``checkpointing()`` at the same instant."""
    from waiting import wait_until  # this folder: on sys.path as a test's module or a script

    open(os.path.join(d, f"{name}.ready"), "w").close()
    wait_until(
        lambda: len([n for n in os.listdir(d) if n.endswith(".ready")]) >= parties,
        f"{parties} processes ready at barrier {d}",
        120,
        0.001,
        state=lambda: sorted(os.listdir(d)),
    )


def kill_in_copy(nth: int) -> None:
    """Fault injection: the nth snapshot copy with tensors SIGKILLs this process halfway."""
    from flashckpt.trainer.snapshot import Snapshotter

    orig = Snapshotter.copy
    calls = [0]

    def copy(self, sm, pairs):  # type: ignore[no-untyped-def]
        if pairs:
            calls[0] += 1
            if calls[0] == nth:
                orig(self, sm, pairs[: len(pairs) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
        orig(self, sm, pairs)

    Snapshotter.copy = copy  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())
