"""A node agent that cannot start is the launcher's error at once, with the cause (issue 30):
not a wait until a timeout (or a crash loop) with the cause in a log file."""

from __future__ import annotations

import shutil
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from flashckpt import names
from flashckpt.elastic.launch.agent_runner import NodeAgentConfig, NodeAgentError, NodeAgentProcess

pytestmark = pytest.mark.slow


def test_an_agent_refused_its_run_directory_is_an_error_naming_the_cause(tmp_path: Path) -> None:
    shm = Path("/dev/shm") / f"fct-{uuid.uuid4().hex[:10]}"
    shm.mkdir()
    agent = NodeAgentProcess(
        NodeAgentConfig(job="j1", node="n0", storage=None, shm_dir=str(shm), run_dir=str(tmp_path))
    )
    run_dir = Path(names.generation_run_dir(str(tmp_path), "j1", "n0", 1))
    run_dir.mkdir()
    run_dir.chmod(0o777)  # other users could swap the agent's socket: refused
    try:
        agent.start()
        with pytest.raises(NodeAgentError) as err:
            agent.wait_ready(timedelta(seconds=30))
        assert f"{run_dir} has mode 0777" in str(err.value), err.value
        assert "did not answer within" not in str(err.value), err.value
    finally:
        agent.stop(timeout_s=10)
        shutil.rmtree(shm, ignore_errors=True)
