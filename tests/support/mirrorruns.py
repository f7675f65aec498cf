"""The run a mirror (``mirror=``) breaks under: shared by the trainer's exit tests and the agent's
stop tests of a failing mirror."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tinytrain import make, persisted_steps, train_step
from waiting import wait_until

import flashckpt
from flashckpt.format.shm import exchange_files
from flashckpt.format.storage import Storage


def train_with_a_broken_mirror(
    env: Any,
    remote: Path,
    *,
    recover: bool = False,
    timeout: float = 120.0,
    state: dict[str, torch.Tensor] | None = None,
    errors: list[Any] | None = None,
    **ckpt_kw: Any,
) -> int:
    """Step 1 reaches the mirror at ``remote``, then its root becomes a file (the directory
    moves to ``remote-away``); steps 2, 3 commit to storage only, and the mirror's errors reach
    the trainer; ``recover``: the mirror is put back before step 4, the exit's final snapshot.

    Args:
        state: gets the final model state (before the exit, which may raise).
        errors: gets the trainer's persist errors seen before step 4.
        ckpt_kw: more keywords of ``checkpointing()`` (``agent=``, ``on_persist_failure=``).

    Returns:
        The last snapshot step (4).
    """
    url = f"file://{remote}"
    model, opt, sched = make(0)
    kw = env.ckpt_kwargs(every=0, persist_every=1, mirror=url, mirror_every=1, **ckpt_kw)
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        persisted_steps(ck, model, opt, sched, 0, 1)
        wait_until(lambda: Storage(url).committed_steps() == [1], "step 1 in the mirror", timeout)
        away = remote.with_name("remote-away")
        remote.rename(away)
        remote.write_text("the mirror is gone")
        persisted_steps(ck, model, opt, sched, 1, 3)  # the storage root still commits every step
        wait_until(lambda: ck.stats.persist_errors, "the mirror's error at the trainer", timeout)
        if errors is not None:
            errors.extend(ck.stats.persist_errors)
        if recover:
            # One step (the agent retries the mirror meanwhile: between an unlink and a rename
            # its retry could make a new, non-empty root at the mirror's path).
            if exchange_files(str(away), str(remote)):
                away.unlink()  # the file, now at the other name
            else:
                remote.unlink()
                away.rename(remote)
        train_step(model, opt, sched, 3)
        ck.step()
        if state is not None:
            state.update({k: v.clone() for k, v in model.state_dict().items()})
    return int(ck.stats.last_snapshot_step)
