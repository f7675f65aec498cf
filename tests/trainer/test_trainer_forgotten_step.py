"""A loop that steps its optimizer but never calls ckpt.step() is warned at the first point a
snapshot was due, and its exit still snapshots and commits the state it holds (issue 30)."""

from __future__ import annotations

import warnings

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_step

import flashckpt


def test_a_loop_without_ckpt_step_is_warned_and_its_exit_commits_the_state(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    model, opt, sched = make(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, every=3, **fc_env.ckpt_kwargs(agent="connect")
        ) as ckpt:
            for step in range(7):
                train_step(model, opt, sched, step)  # ckpt.step() forgotten
                if step == 1:
                    assert not [w for w in caught if "ckpt.step()" in str(w.message)]
                if step == 2:  # the 3rd optimizer step: a snapshot was due (every=3)
                    msgs = [str(w.message) for w in caught if "ckpt.step()" in str(w.message)]
                    assert len(msgs) == 1, msgs
                    assert "the optimizer took 3 steps" in msgs[0]
                    assert "called 0 times" in msgs[0]
                    assert "Fix: call ckpt.step() once per optimizer step" in msgs[0]
    assert ckpt.stats.last_committed_step == 7
    assert ckpt.steps_done == 7
    want = {k: v.clone() for k, v in model.state_dict().items()}

    # The state restores bitwise.
    model2, opt2, sched2 = make(1)
    with flashckpt.checkpointing(
        model2, opt2, scheduler=sched2, **fc_env.ckpt_kwargs(agent="connect")
    ) as ck2:
        assert ck2.start_step == 7
        for k, v in model2.state_dict().items():
            assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("order", ["before", "after"])
def test_ckpt_step_on_every_optimizer_step_is_not_warned(
    fc_env: FcEnv, agent: RunningAgent, order: str
) -> None:
    # Two optimizers (one in stateful=), gradient accumulation of 2 micro-batches per optimizer
    # step, and a step GradScaler-like code skipped (no optimizer.step() that iteration).
    model, opt, sched = make(0)
    head = torch.nn.Linear(4, 1)
    opt2 = torch.optim.SGD(head.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with flashckpt.checkpointing(
            model,
            opt,
            scheduler=sched,
            stateful={"head": head, "opt2": opt2},
            every=2,
            **fc_env.ckpt_kwargs(agent="connect"),
        ) as ckpt:
            for step in range(6):
                if order == "before":
                    ckpt.step()
                for micro in range(2):
                    head(torch.ones(1, 4)).sum().backward()
                    if micro:  # the optimizer steps once per 2 micro-batches
                        train_step(model, opt, sched, step)
                if step != 3:  # step 3: skipped, as GradScaler does on an inf gradient
                    opt2.step()
                opt2.zero_grad()
                if order == "after":
                    ckpt.step()
    assert not [str(w.message) for w in caught if "ckpt.step()" in str(w.message)]
    assert ckpt.stats.last_committed_step == 6
