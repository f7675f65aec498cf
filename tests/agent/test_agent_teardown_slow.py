"""Slow storage does not hold the training loop (issue 30): a persist that may no longer give way
to a trainer wanting its slot copies the snapshot out of the slot first and writes from that
copy, so the trainer waits for a memory copy, not for storage. Every step so written is the
snapshot's bytes (the manifest's hashes verify; a restore from storage equals the trained state
bitwise). Storage is slowed in the agent's process: every 1 MiB chunk of a shard write waits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from slowfs import slow_storage_writes
from tinytrain import make, train_step

import flashckpt
from flashckpt.format.storage import Storage


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_write_that_no_longer_yields_is_staged_and_exact(
    fc_env: FcEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_storage_writes(monkeypatch, 0.1)  # a ~4.5 MB shard takes ~0.5 s: several steps
    agent = RunningAgent(fc_env.agent_config())
    try:
        model, opt, sched = make(0, 20_000)
        kw = fc_env.ckpt_kwargs(every=1, persist_every=1, when_busy="wait")
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            for i in range(30):
                train_step(model, opt, sched, i)
                ck.step()
                if agent.agent.st.staged_writes >= 2 and i >= 10:
                    break
        final = _state(model)
        status = agent.agent.status()
        assert status["staged_writes"] >= 1, status
        st = Storage(fc_env.storage)
        committed = st.committed_steps()
        assert committed[-1] == ck.stats.last_snapshot_step
        for step in committed:
            assert st.verify(step) == [], step
    finally:
        agent.stop()
    # A restore from storage (the agent's memory went with it) is the trained state, bitwise.
    agent = RunningAgent(fc_env.agent_config())
    try:
        model, opt, sched = make(1, 20_000)
        with flashckpt.checkpointing(model, opt, scheduler=sched, **fc_env.ckpt_kwargs()) as ck:
            assert ck.restored_from == "storage"
            got = _state(model)
    finally:
        agent.stop()
    assert got.keys() == final.keys()
    for k in final:
        assert torch.equal(got[k], final[k]), k
