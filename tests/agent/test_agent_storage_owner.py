"""A node agent given ``--storage`` (by hand, a deploy kit's DaemonSet or systemd unit: no
trainer's ``storage=`` and no launcher checked the root) refuses a root another job owns, as the
trainer's entry and ``flashckpt run`` do (issue 30: a job's state is its own), unless told to
take it over."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fchelpers import FcEnv

from flashckpt.agent.config import AgentConfig
from flashckpt.agent.daemon import NodeAgent
from flashckpt.errors import AgentError
from flashckpt.format.storage import Storage
from flashckpt.format.storage_owner import write_owner


def _owned_by(fc_env: FcEnv, job: str) -> None:
    fc_env.storage_path.mkdir(parents=True, exist_ok=True)
    write_owner(Storage(fc_env.storage), job)


def _agent(fc_env: FcEnv, **over: object) -> NodeAgent:
    cfg = AgentConfig(
        job=fc_env.job,
        node="n0",
        storage=fc_env.storage,
        run_dir=fc_env.run_dir,
        shm_dir=fc_env.shm_dir,
        **over,  # type: ignore[arg-type]
    )
    return NodeAgent(cfg)


def test_an_agent_refuses_a_root_another_live_job_owns(fc_env: FcEnv) -> None:
    _owned_by(fc_env, "someone-else")
    agent = _agent(fc_env)
    with pytest.raises(AgentError, match="in use by job 'someone-else'") as e:
        agent.start()
    assert "--takeover" in str(e.value) and fc_env.job in str(e.value)
    assert not fc_env.segments()  # it refused before adopting or allocating anything


def test_takeover_and_its_own_root_start(fc_env: FcEnv) -> None:
    _owned_by(fc_env, "someone-else")
    agent = _agent(fc_env, takeover=True)
    agent.start()
    agent.shutdown(final_persist=False)
    _owned_by(fc_env, fc_env.job)  # its own job's root: no question
    agent = _agent(fc_env)
    agent.start()
    agent.shutdown(final_persist=False)


def test_the_agent_command_says_why_it_refuses(fc_env: FcEnv) -> None:
    _owned_by(fc_env, "someone-else")
    done = subprocess.run(
        [sys.executable, "-m", "flashckpt", "agent", *fc_env.cli_flags(), "--idle-timeout", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "in use by job 'someone-else'" in done.stderr and "--takeover" in done.stderr
