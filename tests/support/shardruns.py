"""Runs of ``shardtrain.py`` (FSDP2 on CPU, its ranks forked from one launcher process) and the
checks the sharded, tensor-parallel and resharding tests share: the losses a run logged, the
unsharded single-process reference, and the gathered state a resume restored."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import safetensors.torch
import torch
from fchelpers import FcEnv, agent_process, run_ranks

HERE = Path(__file__).resolve().parent
__all__ = ["HERE", "assert_same_state", "losses", "node_agents", "reference", "run"]


def run(
    env: FcEnv, tmp: Path, tag: str, world: int, steps: int, *extra: str, code: int = 0
) -> None:
    """Runs ``world`` ranks of shardtrain.py (forked from one launcher process) to the end; they
    must all exit with ``code``."""
    run_ranks(
        "shardtrain.py", env, tmp, tag, "--world", str(world), "--steps", str(steps), *extra,
        code=code,
    )  # fmt: skip


def losses(path: Path) -> dict[int, float]:
    return {
        int(a): float.fromhex(b)
        for a, b in (ln.split() for ln in path.read_text().split("\n") if ln)
    }


def reference(steps: int) -> list[float]:
    """The same training, unsharded, in one process."""
    sys.path.insert(0, str(HERE))
    from shardtrain import batch, make_model, make_optim

    model = make_model()
    opt, sched = make_optim(model)
    out = []
    for step in range(steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out.append(loss.item())
    return out


def assert_same_state(saved: Path, restored: Path) -> None:
    a = safetensors.torch.load_file(str(saved))
    b = safetensors.torch.load_file(str(restored))
    assert sorted(a) == sorted(b)
    # Model and Adam moments of every parameter, and the step counts.
    assert sum(k.startswith("model/") for k in a) == 4
    assert sum(k.endswith("/exp_avg_sq") for k in a) == 4
    for k in a:
        assert torch.equal(a[k], b[k]), k


@contextlib.contextmanager
def node_agents(env: FcEnv, *nodes: str) -> Iterator[None]:
    """Hand-started node agents of ``nodes`` (shardtrain's ``--per-node`` machines are
    ``n0-0``, ``n0-1``, ...) for a chain of crashed and restarted runs that must resume from
    memory. An agent the trainers start themselves exits 30 s after they left once storage holds
    their steps (by design), so on a loaded machine a slow restart found no agent and restored
    from storage. The agents are stopped at the end, and must exit 0."""
    procs = [agent_process(dataclasses.replace(env, node=n)) for n in nodes]
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=180)
    assert [p.returncode for p in procs] == [0] * len(procs)
