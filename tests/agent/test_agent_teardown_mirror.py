"""A failing mirror (``mirror=``) is as loud as the disk tier (issue 30): its errors reach the
trainers' ``persist_errors``, and at its stop the agent tries the final step again until
``commit_timeout`` (it gets there once the mirror recovers) and exits with
``EXIT_MIRROR_FAILED`` when it never does. Real agent processes, real files."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from agentproc import AgentProc, start_agent
from fchelpers import FcEnv, kill_job_processes
from mirrorruns import train_with_a_broken_mirror
from waiting import wait_until

from flashckpt.agent.daemon import EXIT_MIRROR_FAILED
from flashckpt.format.storage import Storage

pytestmark = pytest.mark.slow


def _agent(env: FcEnv, log: Path, commit_timeout: int) -> AgentProc:
    flags = ("--commit-timeout", str(commit_timeout), "--retry-interval", "0.5")
    return start_agent(env, *flags, log=log)


def _run_with_a_mirror_that_breaks(env: FcEnv, remote: Path) -> tuple[int, list]:  # type: ignore[type-arg]
    """Trains with the mirror working for the first step, then broken (its root becomes a
    file); returns the final step and the trainer's persist_errors."""
    errors: list = []  # type: ignore[type-arg]
    # on_persist_failure="warn": the trainer's exit fails on a final step that never reached a
    # failing mirror (tests/test_trainer_mirror_final.py); here the agent's stop is tested.
    final = train_with_a_broken_mirror(env, remote, errors=errors, on_persist_failure="warn")
    return final, errors


def test_a_broken_mirror_reaches_persist_errors_and_fails_the_agents_exit(
    tmp_path: Path, fc_env: FcEnv
) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    log = tmp_path / "agent.log"
    a = _agent(fc_env, log, commit_timeout=4)
    try:
        final, errors = _run_with_a_mirror_that_breaks(fc_env, remote)
        assert final == 4
        assert any(e["error"].startswith(f"mirror file://{remote}: ") for e in errors), errors
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=120) == EXIT_MIRROR_FAILED
    finally:
        kill_job_processes(fc_env.job)
    text = log.read_text()
    assert "the final step 4 failed to copy (try 1)" in text, text[-4000:]
    assert "the final step 4 never reached the mirror within 4 s" in text, text[-4000:]
    assert Storage(fc_env.storage).committed_steps()[-1] == 4


def test_the_final_mirror_copy_is_retried_until_the_mirror_recovers(
    tmp_path: Path, fc_env: FcEnv
) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    log = tmp_path / "agent.log"
    a = _agent(fc_env, log, commit_timeout=120)
    try:
        final, _ = _run_with_a_mirror_that_breaks(fc_env, remote)
        a.send_signal(signal.SIGTERM)
        wait_until(
            lambda: "failed to copy (try 2)" in log.read_text(), "a second try", timeout=120.0
        )
        remote.unlink()
        remote.with_name("remote-away").rename(remote)
        assert a.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        kill_job_processes(fc_env.job)
    assert Storage(f"file://{remote}").committed_steps()[-1] == final
