"""A mirror (``mirror=``) that failed during the run fails the run's exit when the final step
never reached it, as the storage tier's failure does (issue 30); one that recovered does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from mirrorruns import train_with_a_broken_mirror
from tinytrain import make

import flashckpt
from flashckpt.errors import PersistError
from flashckpt.format.storage import Storage


def _train_with_a_broken_mirror(
    env: FcEnv, remote: Path, out: dict[str, torch.Tensor], *, recover: bool
) -> None:
    """The mirror breaks after step 1 (``recover``: is put back before the final step 4);
    ``out`` gets the final model state."""
    kw = {"agent": "connect", "flush_timeout": 60}
    train_with_a_broken_mirror(env, remote, recover=recover, timeout=60.0, state=out, **kw)


def _restored(env: FcEnv, remote: Path) -> tuple[int, dict[str, torch.Tensor]]:
    model, opt, sched = make(1)  # other initial weights: only a restore makes them equal
    kw = env.ckpt_kwargs(every=0, persist_every=1, mirror=f"file://{remote}", agent="connect")
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        return ck.start_step, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_final_step_that_never_reached_a_failing_mirror_fails_the_exit(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    want: dict[str, torch.Tensor] = {}
    with pytest.raises(PersistError) as err:
        _train_with_a_broken_mirror(fc_env, remote, want, recover=False)
    text = str(err.value)
    url = f"file://{remote}"
    assert f"step 4 (the final snapshot) did not reach the mirror {url} (the mirror's " in text
    assert f"error: mirror {url}: " in text, text
    assert f"It is committed in storage {fc_env.storage}" in text, text
    assert "Fix the mirror" in text and "mirror=None" in text, text
    assert err.value.step == 4 and err.value.errors, err.value.errors
    assert Storage(fc_env.storage).committed_steps()[-1] == 4
    # The final step is safe: a rerun (the mirror fixed) restores it bitwise.
    remote.unlink()
    remote.with_name("remote-away").rename(remote)
    step, got = _restored(fc_env, remote)
    assert step == 4 and got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_mirror_that_recovered_before_the_final_step_exits_normally(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    want: dict[str, torch.Tensor] = {}
    _train_with_a_broken_mirror(fc_env, remote, want, recover=True)  # no PersistError
    mirror = Storage(f"file://{remote}")
    assert mirror.committed_steps()[-1] == 4
    assert mirror.check_step(4).status == "ok"
    step, got = _restored(fc_env, remote)
    assert step == 4 and got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
