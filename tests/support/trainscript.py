"""What the framework runs of ``tests/integrations`` (``hftrain.py``, ``pltrain.py``,
``tttrain.py``) share: their common flags, the flashckpt options those give, and the final
model and optimizer tensors they write for the comparison with ``torch.equal``."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

import torch


def add_common_args(p: argparse.ArgumentParser, steps: int = 24) -> None:
    """The job's flags (as ``FcEnv.cli_flags()`` gives them), ``--out``, ``--log`` (one line per
    step is appended), ``--steps``, ``--every``, ``--persist-every`` and ``--step-sleep``."""
    p.add_argument("--storage", default=None)
    p.add_argument("--job", default=None)
    p.add_argument("--node", default=None)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--shm-dir", default=None)
    p.add_argument("--out", required=True)
    # --steps-log: the spelling torchrun lets through (its parser takes --log for --log-dir)
    p.add_argument("--log", "--steps-log", dest="log", required=True)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--persist-every", default="1", help="snapshots (int) or a duration")
    p.add_argument("--step-sleep", type=float, default=0.0)


def flash_options(a: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of the adapters' constructors for the parsed common flags."""
    opts: dict[str, Any] = {
        k: v for k, v in (("job", a.job), ("node", a.node), ("run_dir", a.run_dir)) if v
    }
    if a.shm_dir:
        opts["shm_dir"] = a.shm_dir
    every = a.persist_every
    opts.update(
        storage=a.storage,
        every=a.every,
        persist_every=int(every) if every.isdigit() else every,
        agent_idle_timeout=120,
    )
    return opts


def final_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, prefix: str = "optim."
) -> dict[str, torch.Tensor]:
    """The model's state and the optimizer's (its per-parameter state and each group's lr),
    contiguous copies, named ``model.<key>`` and ``<prefix><index>.<key>``."""
    out = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    sd = optimizer.state_dict()
    for idx, st in sd["state"].items():
        for k, v in st.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            out[f"{prefix}{idx}.{k}"] = t.detach().clone().contiguous()
    for i, g in enumerate(sd["param_groups"]):
        out[f"{prefix}group{i}.lr"] = torch.tensor(float(g["lr"]), dtype=torch.float64)
    return out


def end_process_group() -> None:
    """Ends the process group the framework started before the exit, as torch asks (it stops
    gloo's threads only once nothing else holds the group: see :func:`exit_now`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_now(code: int) -> NoReturn:
    """Ends a multi-rank script without the interpreter's teardown: ``atexit`` handlers run,
    output is flushed, then ``os._exit(code)``.

    torch 2.13's gloo worker thread drops a finished collective's work (and with it the caller's
    Python tensors, which needs the GIL) a moment after ``wait()`` returned; if the interpreter
    is being torn down by then, the thread cannot take the GIL and the process aborts (SIGABRT,
    "terminate called without an active exception") although the run ended well
    (``benchmarks/exit_abort.py``). ``destroy_process_group()`` does not close that window while
    a DDP-wrapped model still holds the group, as the HF Trainer's and Lightning's do: an HF
    reference run aborted so in CI and in 1 of 18 runs beside two CPU burners (core dump: the
    abort in ``AsyncAllgatherWork``'s destructor on gloo's ``runLoop`` thread, the main thread in
    ``Py_FinalizeEx``). ``flashckpt run``'s pre-warmed workers end the same way.

    The product's own teardown has ended by then (``train()``/``fit()`` returned: the
    checkpointer closed); a non-daemon thread still running is reported and fails the exit,
    so this way out does not hide a thread the interpreter's teardown would have waited for."""
    import atexit
    import os
    import sys
    import threading

    left = [
        t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
    ]
    if left:
        print(f"trainscript: non-daemon threads still running at the exit: {left}", file=sys.stderr)
        code = code or 3
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
