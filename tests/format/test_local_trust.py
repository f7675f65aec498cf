"""Local state of another user is never trusted (run dir, socket, slot files), a dead agent's
segments are kept for its own job, and only abandoned ones are cleaned (by age or on demand)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fchelpers import FcEnv, RunningAgent, agent_process
from tinytrain import make, trained_run
from waiting import wait_until

import flashckpt
from flashckpt.agent.daemon import AgentConfig, NodeAgent
from flashckpt.errors import UnsafeLocalStateError
from flashckpt.monitor.step_monitor import MonitorConfig
from flashckpt.protocol.channel import AgentClient, socket_path

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _run_dir_variants(base: Path) -> dict[str, Path]:
    foreign = base / "foreign"
    foreign.mkdir(mode=0o777)
    os.chmod(foreign, 0o777)
    os.chown(foreign, NOBODY, NOBODY)
    loose = base / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    target = base / "target"
    target.mkdir(mode=0o700)
    link = base / "link"
    link.symlink_to(target)
    foreign_private = base / "foreign-private"
    foreign_private.mkdir(mode=0o700)
    os.chown(foreign_private, NOBODY, NOBODY)
    return {
        "another user's, 0777": foreign,
        "another user's, 0700": foreign_private,
        "mode 0755": loose,
        "a symlink": link,
    }


def test_agent_refuses_a_run_dir_it_cannot_trust(fc_env: FcEnv, tmp_path: Path) -> None:
    for what, path in _run_dir_variants(tmp_path).items():
        agent = NodeAgent(fc_env.agent_config(run_dir=str(path)))
        with pytest.raises(UnsafeLocalStateError, match=str(path)) as e:
            agent.start()
        assert "remove it" in str(e.value), what
        assert not os.path.exists(os.path.join(path, f"{fc_env.job}.{fc_env.node}.lock")), what
    # Created by the agent: 0700.
    fresh = tmp_path / "fresh" / "run"
    ra = RunningAgent(fc_env.agent_config(run_dir=str(fresh)))
    try:
        assert (fresh.stat().st_mode & 0o777) == 0o700
    finally:
        ra.stop()


def test_trainer_refuses_a_run_dir_it_cannot_trust(fc_env: FcEnv, tmp_path: Path) -> None:
    """The trainer connects to the socket there and appends to the log: it checks too."""
    for what, path in _run_dir_variants(tmp_path).items():
        model, opt, sched = make(0)
        for mode in ("auto", "connect"):
            kw = fc_env.ckpt_kwargs(run_dir=str(path), agent=mode)
            with (
                pytest.raises(UnsafeLocalStateError, match="agent run dir"),
                flashckpt.checkpointing(model, opt, scheduler=sched, **kw),
            ):
                pass
        assert not any(n.endswith(".log") for n in os.listdir(path)), what


def test_trainer_refuses_a_socket_of_another_user(fc_env: FcEnv, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    path = socket_path(str(run_dir), fc_env.job, fc_env.node)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(path)
        srv.listen(1)
        os.chown(path, NOBODY, NOBODY)  # as if another user had swapped it in
        with pytest.raises(UnsafeLocalStateError, match="not a socket of this user"):
            AgentClient(path, timeout=0.5)
        srv.settimeout(0.2)
        with pytest.raises(TimeoutError):
            srv.accept()  # nothing was ever sent to it
    finally:
        srv.close()


def _crashed_agent_slots(env: FcEnv) -> list[Path]:
    """Runs a trainer (steps 2 and 4 snapshotted, 4 committed) under an agent that is then
    SIGKILLed: its slot files stay in ``env.shm_dir``."""
    a = agent_process(env)
    try:
        trained_run(env)  # its agent holds steps 2 and 4
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=30)
    slots = sorted(Path(env.shm_dir).glob(f"fc.{env.job}.{env.node}.r*.s?"))
    assert len(slots) == 2
    return slots


@pytest.mark.parametrize("how", ["another user's", "mode 0644"])
def test_slot_files_of_another_user_are_neither_adopted_nor_served(
    fc_env_private: FcEnv, how: str
) -> None:
    env = fc_env_private
    slots = _crashed_agent_slots(env)
    for p in slots:
        if how == "another user's":
            os.chown(p, NOBODY, NOBODY)
        else:
            os.chmod(p, 0o644)
    ra = RunningAgent(env.agent_config())
    try:
        st = ra.agent.status()
        assert st["ranks"] == {}, st["ranks"]
        assert sorted(st["refused_slots"]) == [str(p) for p in slots]
        assert all("not trusted" in why for why in st["refused_slots"].values())
        assert all(p.exists() for p in slots)  # not ours to delete
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, every=2, **env.ckpt_kwargs(agent="connect")
        ) as ck:
            assert (ck.start_step, ck.restored_from) == (4, "storage")
    finally:
        ra.stop()


def test_trainer_does_not_map_an_untrusted_slot(fc_env: FcEnv, agent: RunningAgent) -> None:
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(agent="connect")
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        ck.step()
        ck.save(mode="sync")
        path = ck._snap.slots[0].slot.path
        os.chmod(path, 0o666)
        with pytest.raises(ValueError, match="not trusted: mode 0666"):
            ck._snap.map(path)
        os.chmod(path, 0o600)


def test_metrics_bind_to_localhost_unless_asked() -> None:
    from flashckpt.cli import _agent_args

    assert MonitorConfig().metrics_addr == "127.0.0.1"
    p = argparse.ArgumentParser()
    _agent_args(p)
    assert p.parse_args(["--job", "j"]).metrics_addr == "127.0.0.1"
    args = p.parse_args(["--job", "j", "--metrics-host", "0.0.0.0"])
    assert args.metrics_addr == "0.0.0.0"


def test_metrics_endpoint_listens_on_loopback_only(fc_env: FcEnv) -> None:
    cfg = fc_env.agent_config(monitor=MonitorConfig(metrics_port=0))
    ra = RunningAgent(cfg)
    try:
        pid = os.getpid()
        import psutil

        listening = wait_until(
            lambda: [
                c.laddr
                for c in psutil.Process(pid).net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN
            ],
            "the metrics endpoint to listen",
            30,
            0.05,
        )
        assert all(a.ip == "127.0.0.1" for a in listening), listening
    finally:
        ra.stop()


# -- segments of dead agents -------------------------------------------------------------------
def _other_job(env: FcEnv, suffix: str) -> AgentConfig:
    return AgentConfig(
        job=env.job + suffix,
        node=env.node,
        storage=None,
        run_dir=env.run_dir,
        shm_dir=env.shm_dir,
    )


def test_another_jobs_agent_keeps_a_dead_agents_segments(fc_env_private: FcEnv) -> None:
    """Finding 3: job B's agent start removed dead job A's snapshots; A then resumed from an
    older storage step instead of its newer in-memory one."""
    env = fc_env_private
    slots = _crashed_agent_slots(env)
    b = RunningAgent(_other_job(env, "b"))
    try:
        assert all(p.exists() for p in slots)
    finally:
        b.stop()
    # A's next agent adopts them; its trainer resumes from memory.
    ra = RunningAgent(env.agent_config())
    try:
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, every=2, **env.ckpt_kwargs(agent="connect")
        ) as ck:
            assert (ck.start_step, ck.restored_from) == (4, "memory")
    finally:
        ra.stop()


def _age(paths: list[Path], seconds: float) -> None:
    t = time.time() - seconds
    for p in paths:
        os.utime(p, (t, t))


def test_abandoned_segments_go_by_age_only(fc_env_private: FcEnv) -> None:
    env = fc_env_private
    slots = _crashed_agent_slots(env)
    group = sorted(Path(env.shm_dir).glob(f"fc.{env.job}.{env.node}.*"))
    _age(group, 3600)  # younger than the threshold (a day): kept
    RunningAgent(_other_job(env, "c")).stop()
    assert all(p.exists() for p in slots)
    _age(group, 2 * 86400)
    RunningAgent(_other_job(env, "d")).stop()
    assert not any(p.exists() for p in group)


def _clean(env: FcEnv, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "flashckpt", "clean", "--shm-dir", env.shm_dir, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_clean_verb_lists_and_removes_only_dead_agents_segments(fc_env_private: FcEnv) -> None:
    env = fc_env_private
    slots = _crashed_agent_slots(env)
    live = RunningAgent(_other_job(env, "live"))
    try:
        model = torch.nn.Linear(4, 4)
        live_env = FcEnv(
            job=env.job + "live",
            node=env.node,
            run_dir=env.run_dir,
            storage=env.storage,
            storage_path=env.storage_path,
            shm_dir=env.shm_dir,
        )
        with flashckpt.checkpointing(
            model, None, **live_env.ckpt_kwargs(agent="connect", storage=None)
        ) as ck:
            ck.step()
            ck.save(mode="sync")
        live_files = live_env.segments()
        assert live_files
        out = _clean(env, "--dry-run")
        assert f"would remove job {env.job} node {env.node}" in out
        assert "its agent is dead" in out
        assert all(str(p) in out for p in slots)
        assert env.job + "live" not in out
        assert all(p.exists() for p in slots)
        assert "nothing to clean" in _clean(env, "--older-than", "86400")
        out = _clean(env)
        assert f"removed job {env.job} node {env.node}" in out
        assert not any(p.exists() for p in slots)
        assert live_env.segments() == live_files  # a live agent's segments are never touched
    finally:
        live.stop()


def test_clean_leaves_other_users_files(fc_env_private: FcEnv) -> None:
    env = fc_env_private
    slots = _crashed_agent_slots(env)
    for p in slots:
        os.chown(p, NOBODY, NOBODY)
    _clean(env)
    assert all(p.exists() for p in slots)
    shutil.rmtree(env.run_dir, ignore_errors=True)


@pytest.mark.parametrize("detach", [False, True])
def test_agent_command_refuses_a_loose_run_dir_with_a_clear_message(
    fc_env: FcEnv, tmp_path: Path, detach: bool
) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o755)
    cmd = [sys.executable, "-m", "flashckpt", "agent", "--job", fc_env.job]
    cmd += ["--run-dir", str(loose), "--shm-dir", str(tmp_path)]
    out = subprocess.run(
        cmd + (["--detach"] if detach else []),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out
    assert f"agent run dir {loose} has mode 0755" in out.stderr
    assert "Traceback" not in out.stderr
    assert os.listdir(loose) == []


def test_status_lists_a_foreign_socket_as_an_error(tmp_path: Path) -> None:
    from flashckpt.monitor.statusview import collect_status

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    path = str(run_dir / "j.n0.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(path)
        srv.listen(1)
        os.chown(path, NOBODY, NOBODY)
        (got,) = collect_status(str(run_dir))
        assert got["socket"] == path and "not a socket of this user" in got["error"]
    finally:
        srv.close()
