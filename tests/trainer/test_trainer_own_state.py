"""A job's state is its own (issue 30): a storage root holding another job's committed steps is
refused at entry unless takeover=True, and a second live process of the same job, node and rank
is refused, naming the first one's pid."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fchelpers import FcEnv, RunningAgent, kill_job_processes
from tinytrain import make, train_step

import flashckpt


def _train(kw: dict, steps: int) -> dict[str, torch.Tensor]:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(model, opt, scheduler=sched, every=2, **kw) as ckpt:
        for step in range(ckpt.start_step, steps):
            train_step(model, opt, sched, step)
            ckpt.step()
    assert ckpt.stats.last_committed_step == steps
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_another_jobs_storage_root_is_refused_unless_taken_over(fc_env: FcEnv) -> None:
    want = _train(fc_env.ckpt_kwargs(), 4)  # job A commits step 4 (its own auto agent)
    other = fc_env.job + "b"
    kw = fc_env.ckpt_kwargs(job=other)
    model, opt, sched = make(1)
    try:
        with (
            pytest.raises(ValueError) as err,
            flashckpt.checkpointing(model, opt, scheduler=sched, **kw),
        ):
            pass
        text = str(err.value)
        assert f"storage {fc_env.storage} holds committed steps of job {fc_env.job!r}" in text
        assert "newest: step 4" in text and f"this is job {other!r}" in text, text
        assert "takeover=True" in text, text
        # Taken over: job B resumes A's step 4 bitwise, and its commits are its own after.
        with flashckpt.checkpointing(model, opt, scheduler=sched, takeover=True, **kw) as ck:
            assert ck.start_step == 4 and ck.restored_from == "storage"
            for k, v in model.state_dict().items():
                assert torch.equal(v, want[k]), k
            train_step(model, opt, sched, 4)
            ck.step()
        assert ck.stats.last_committed_step == 5
        # Now the root is B's: job A is refused in its turn.
        with (
            pytest.raises(ValueError, match=f"holds committed steps of job {other!r}"),
            flashckpt.checkpointing(model, opt, scheduler=sched, **fc_env.ckpt_kwargs()),
        ):
            pass
    finally:
        kill_job_processes(other)


HOLDER = textwrap.dedent(
    """
    import sys, torch, flashckpt
    model = torch.nn.Linear(2, 2)
    kw = dict(job=sys.argv[1], node="n0", run_dir=sys.argv[2], agent="connect")
    with flashckpt.checkpointing(model, None, **kw) as ckpt:
        print("entered", flush=True)
        sys.stdin.readline()
    """
)


@pytest.mark.slow
def test_a_second_live_process_of_the_same_job_and_rank_is_refused(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, fc_env.job, fc_env.run_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert first.stdout is not None and first.stdin is not None
        assert first.stdout.readline().strip() == "entered"
        model = torch.nn.Linear(2, 2)
        kw = fc_env.ckpt_kwargs(agent="connect", storage=None)
        with (
            pytest.raises(RuntimeError) as err,
            flashckpt.checkpointing(model, None, **kw),
        ):
            pass
        text = str(err.value)
        assert f"already running in process {first.pid}" in text, text
        assert f"job {fc_env.job!r} rank 0 on node 'n0'" in text, text
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.wait(timeout=60) == 0
        # The first one gone, the same job enters.
        with flashckpt.checkpointing(model, None, **kw) as ck:
            assert ck.job == fc_env.job
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
