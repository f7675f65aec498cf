"""A run whose final snapshot never reached storage fails its exit, whether storage came from the
script (``storage=``) or from the launcher only (``flashckpt run --storage``, which the trainer
sees in $FLASHCKPT_STORAGE) (issue 30)."""

from __future__ import annotations

import shutil

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_step

import flashckpt
from flashckpt.errors import PersistError


@pytest.mark.parametrize("given", ["script", "launcher"])
def test_a_final_persist_that_failed_raises_at_exit(
    fc_env: FcEnv, agent: RunningAgent, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    if given == "launcher":
        monkeypatch.setenv("FLASHCKPT_STORAGE", fc_env.storage)
        kw = fc_env.ckpt_kwargs(agent="connect", storage=None)
    else:
        kw = fc_env.ckpt_kwargs(agent="connect")
    model, opt, sched = make(0)
    ck = flashckpt.checkpointing(model, opt, scheduler=sched, every=2, persist_every=1, **kw)
    with pytest.raises(PersistError) as err, ck as ckpt:
        for step in range(2):
            train_step(model, opt, sched, step)
            ckpt.step()
        assert ckpt.flush() == 2
        # Storage breaks: its root becomes a file (root ignores permission bits).
        shutil.rmtree(fc_env.storage_path)
        fc_env.storage_path.write_bytes(b"not a directory")
        for step in range(2, 4):
            train_step(model, opt, sched, step)
            ckpt.step()
    text = str(err.value)
    assert "step 4 (the final snapshot) was not committed to storage" in text, text
    assert fc_env.storage in text, text
    assert "newest committed step is 2" in text, text
    assert "Fix the storage and run again to resume" in text, text
    if given == "launcher":
        assert "the launcher's --storage" in text, text
    # The final state is still in memory: it restores bitwise once storage is fixed.
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fc_env.storage_path.unlink()
    model2, opt2, sched2 = make(1)
    with flashckpt.checkpointing(model2, opt2, scheduler=sched2, **kw) as ck2:
        assert ck2.start_step == 4 and ck2.restored_from == "memory"
        for k, v in model2.state_dict().items():
            assert torch.equal(v, want[k]), k


def test_launcher_storage_unset_on_the_agent_is_no_error(
    fc_env: FcEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    # $FLASHCKPT_STORAGE set, but the agent this trainer talks to has no storage: nothing to
    # flush to, no error.
    monkeypatch.setenv("FLASHCKPT_STORAGE", fc_env.storage)
    a = RunningAgent(fc_env.agent_config(storage=None))
    try:
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model,
            opt,
            scheduler=sched,
            every=2,
            **fc_env.ckpt_kwargs(agent="connect", storage=None),
        ) as ckpt:
            for step in range(2):
                train_step(model, opt, sched, step)
                ckpt.step()
        assert ckpt.stats.last_snapshot_step == 2
        assert ckpt.stats.persist_errors == []
    finally:
        a.stop()
