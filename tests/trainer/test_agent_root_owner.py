"""A trainer without ``storage=`` of its own checks the root its node agent persists to (issue 30:
a job's state is its own): an agent given ``--storage`` on its own (by hand, deploy/'s DaemonSet
or systemd unit) on a root another job owns (its owner file, its committed steps) is refused at
entry, naming the job, the root and the fix, unless the trainer says ``takeover=True`` (and,
over committed steps it cannot read back, ``overwrite=True``, which deletes them); a run that
would start from step 0 over the job's own committed steps is refused the same way. The agent
looks at the root for the trainer, which may not be able to open it: here the agent runs in a
mount namespace of its own where the root is another directory than the trainer sees."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from agentproc import AgentProc, start_agent
from fchelpers import FcEnv, agent_process
from tinytrain import make, train_steps

import flashckpt
from flashckpt.errors import AgentError
from flashckpt.format.storage import Storage
from flashckpt.format.storage_owner import OWNER_FILE, write_owner


def _kw(fc_env: FcEnv, **over: Any) -> dict[str, Any]:
    """A trainer of the job with no storage= (its agent's root is the only one)."""
    kw = {"storage": None, "agent": "connect", "every": 1, "persist_every": 1, **over}
    return fc_env.ckpt_kwargs(**kw)


def _refusal(kw: dict[str, Any]) -> str:
    model, opt, sched = make(0)
    with (
        pytest.raises(ValueError) as err,
        flashckpt.checkpointing(model, opt, scheduler=sched, **kw),
    ):
        pass
    return str(err.value)


def _train(kw: dict[str, Any], steps: int) -> dict[str, torch.Tensor]:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        assert ck.start_step == 0 and ck.restored_from is None
        train_steps(ck, model, opt, sched, 0, steps)
    assert ck.stats.last_committed_step == steps
    return {k: v.clone() for k, v in model.state_dict().items()}


def _resumes(kw: dict[str, Any], step: int, want: dict[str, torch.Tensor]) -> None:
    """The job's own root: the same trainer again resumes, from its agent's memory, bitwise."""
    model, opt, sched = make(1)
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        assert ck.start_step == step and ck.restored_from == "memory"
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k]), k


def _stop(agent: AgentProc, kill: bool = False) -> None:
    agent.kill9() if kill else agent.stop()


def _namespaced_agent(fc_env: FcEnv, hidden: Path) -> AgentProc | None:
    """The job's agent in a mount namespace of its own, where the storage root's path shows
    ``hidden`` (the trainer sees the directory under it); None where namespaces are refused."""
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        return None
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
    return start_agent(fc_env, wrap=[*wrap, str(hidden), str(fc_env.storage_path)])


def test_a_root_another_live_job_owns_is_refused_until_taken_over(
    fc_env: FcEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As deploy/'s JobSet sets it for torchrun's workers (no launcher checked that root).
    monkeypatch.setenv("FLASHCKPT_STORAGE", fc_env.storage)
    monkeypatch.delenv("FLASHCKPT_LAUNCHER_PID", raising=False)
    # The agent's root: a directory only the agent sees at that path, where job A's owner file
    # says it runs there (nothing committed yet). The trainer's view of the path is empty.
    hidden = tmp_path / "agent-view"
    hidden.mkdir()
    write_owner(Storage(f"file://{hidden}"), "jobA")
    fc_env.storage_path.mkdir()
    agent = _namespaced_agent(fc_env, hidden)
    if agent is None:  # no mount namespace here: the agent and the trainer share the root
        hidden = fc_env.storage_path
        write_owner(Storage(fc_env.storage), "jobA")
        agent = agent_process(fc_env)
    kw = _kw(fc_env)
    try:
        text = _refusal(kw)
        assert f"its node agent (pid {agent.pid}) persists this job" in text, text
        assert f"storage {fc_env.storage} is in use by job 'jobA'" in text, text
        assert f"{fc_env.storage_path}/{OWNER_FILE} names it" in text, text
        assert f"this is job {fc_env.job!r}" in text and "pass takeover=True" in text, text
        assert json.loads((hidden / OWNER_FILE).read_text())["job"] == "jobA"  # untouched
        # Taken over: the agent records the job as the root's owner, and the job trains there.
        want = _train(_kw(fc_env, takeover=True), 2)
        assert json.loads((hidden / OWNER_FILE).read_text())["job"] == fc_env.job
        assert Storage(f"file://{hidden}").manifest(2).job == fc_env.job
        if hidden != fc_env.storage_path:  # the agent did it all: the trainer saw nothing
            assert not any(fc_env.storage_path.iterdir())
        _resumes(kw, 2, want)
        # A storage= of its own that is not the agent's root: refused at hello, naming both.
        model, opt, sched = make(0)
        elsewhere = f"file://{tmp_path}/elsewhere"
        with (
            pytest.raises(AgentError) as err,
            flashckpt.checkpointing(model, opt, scheduler=sched, **_kw(fc_env, storage=elsewhere)),
        ):
            pass
        text = str(err.value)
        assert f"persists job {fc_env.job!r} to {fc_env.storage}" in text, text
        assert f"asked for {elsewhere}: use one storage URL per job id" in text, text
    finally:
        _stop(agent)


def test_a_root_with_another_jobs_steps_is_refused_and_overwritten_only_when_told(
    fc_env: FcEnv,
) -> None:
    other = fc_env.job + "a"  # job A committed step 1 there (with storage= of its own)
    model, opt, sched = make(0)
    kw_a = fc_env.ckpt_kwargs(job=other, every=1, persist_every=1)
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw_a) as ck:
        train_steps(ck, model, opt, sched, 0, 1)
    assert ck.stats.last_committed_step == 1
    st = Storage(fc_env.storage)
    agent = agent_process(fc_env)  # job B's agent, given that root by hand
    kw = _kw(fc_env)
    try:
        text = _refusal(kw)
        assert f"storage {fc_env.storage} holds committed steps of job {other!r} (newest: " in text
        assert f"this is job {fc_env.job!r}" in text, text
        assert "pass takeover=True with overwrite=True to delete them" in text, text
        # takeover=True alone: this trainer cannot resume job A's steps (no storage= of its
        # own), and would start from step 0 among them.
        text = _refusal(_kw(fc_env, takeover=True))
        assert f"storage {fc_env.storage}, where this job's node agent persists" in text, text
        assert "holds committed steps [1] of an earlier run" in text, text
        assert "overwrite=True to delete them" in text, text
        assert st.committed_steps() == [1] and st.manifest(1).job == other  # untouched
        want = _train(_kw(fc_env, takeover=True, overwrite=True), 2)
        ours = st.committed_steps()  # [1, 2], or [2] where step 2's persist superseded 1's
        assert ours[-1] == 2 and set(ours) <= {1, 2}, ours
        assert {st.manifest(s).job for s in ours} == {fc_env.job}  # job A's step 1 is gone
        assert json.loads((fc_env.storage_path / OWNER_FILE).read_text())["job"] == fc_env.job
        # Its own steps are not overwritten silently either: starting over needs overwrite.
        text = _refusal(_kw(fc_env, restore=False))
        assert f"holds committed steps {ours} of an earlier run" in text, text
        assert "(restore=False)" in text, text
        _resumes(kw, 2, want)
        # Mid-run, the agent dies and another is started on another root: said loudly (entry
        # checked the first one only).
        elsewhere = f"file://{fc_env.storage_path.parent}/elsewhere"
        model, opt, sched = make(1)
        with (
            pytest.warns(UserWarning, match="the node agent found again") as seen,
            flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck,
        ):
            assert ck.start_step == 2
            _stop(agent, kill=True)
            agent = _agent_on(fc_env, elsewhere)
            train_steps(ck, model, opt, sched, 2, 3)
        text = next(str(w.message) for w in seen if "found again" in str(w.message))
        assert f"persists this job to {elsewhere}, not to {fc_env.storage}" in text, text
    finally:
        _stop(agent)


def _agent_on(fc_env: FcEnv, storage: str) -> AgentProc:
    """The job's agent, by hand, on ``storage``."""
    return start_agent(fc_env, storage=storage)
