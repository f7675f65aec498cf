"""The advice of a restore that cannot be done, followed as written (issue 41, row 12: "pass
restore=False" over a storage root with committed steps led to a second refusal, which asked for
overwrite=True). The user changes the model's architecture, reads the error, and runs the same
loop with the arguments it names."""

from __future__ import annotations

import re

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_step

import flashckpt
from flashckpt.errors import RestoreError
from flashckpt.trainer.checkpointer import Checkpointer


def _run(env: FcEnv, width: int, steps: int, **kw: object) -> tuple[torch.nn.Module, Checkpointer]:
    model, opt, sched = make(0, width=width)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every=2, **env.ckpt_kwargs(agent="connect", **kw)
    ) as ck:
        for i in range(ck.start_step, steps):
            train_step(model, opt, sched, i)
            ck.step()
        if kw.get("storage", env.storage):
            assert ck.flush() == steps
    return model, ck


def _advice(text: str) -> dict[str, bool]:
    """The arguments the error's start-over advice names, as keyword arguments."""
    m = re.search(r"or pass (restore=False(?:, overwrite=True)?) to start from scratch", text)
    assert m is not None, text
    return {k: v == "True" for k, v in (a.split("=") for a in m.group(1).split(", "))}


def _refused(env: FcEnv, **kw: object) -> str:
    with pytest.raises(RestoreError) as refused:
        _run(env, 48, 6, **kw)
    text = str(refused.value)
    assert "shape mismatches: 0.bias: checkpoint (32,) vs model (48,)" in text, text
    assert text.count("restore=False") == 1, text  # one advice, the last line's
    return text


def test_the_start_over_advice_over_committed_steps_works(fc_env: FcEnv, agent: RunningAgent):
    _run(fc_env, 32, 4)
    committed = flashckpt.load(fc_env.storage).step
    assert committed == 4
    text = _refused(fc_env)
    advice = _advice(text)
    assert advice == {"restore": False, "overwrite": True}, text
    assert f"deletes the committed steps [2, 4] of storage {fc_env.storage}" in text or (
        f"deletes the committed steps [4] of storage {fc_env.storage}" in text
    ), text
    # Followed: starts from scratch, the new architecture's steps commit, the old ones are gone.
    model, ck = _run(fc_env, 48, 6, **advice)
    assert ck.start_step == 0 and ck.restored_from is None
    loaded = flashckpt.load(fc_env.storage)
    assert loaded.step == 6
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state["model"][k], v), k


def test_the_start_over_advice_of_a_memory_only_job_works(fc_env: FcEnv) -> None:
    env = fc_env
    agent = RunningAgent(fc_env.agent_config(storage=None))
    try:
        _run(env, 32, 4, storage=None)
        text = _refused(env, storage=None)
        advice = _advice(text)
        assert advice == {"restore": False}, text
        _, ck = _run(env, 48, 6, storage=None, **advice)
        assert ck.start_step == 0 and ck.restored_from is None
        assert ck.stats.last_snapshot_step == 6
    finally:
        agent.stop()
