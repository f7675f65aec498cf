"""The `flashckpt` command: agent daemon (detached, pid file, 0600 socket), ls, verify."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_step

import flashckpt


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flashckpt", *args], capture_output=True, text=True, timeout=120
    )


def _make_steps(env: FcEnv, steps: int = 4) -> None:
    a = RunningAgent(env.agent_config())
    try:
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, **env.ckpt_kwargs(agent="connect", every=2)
        ) as ck:
            for step in range(steps):
                train_step(model, opt, sched, step)
                if ck.step() is not None:
                    ck.flush()
    finally:
        a.stop()


def test_ls_and_verify(fc_env: FcEnv) -> None:
    _make_steps(fc_env)
    r = _cli("ls", fc_env.storage, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["step"] for row in rows] == [2, 4]
    assert all(row["bytes"] > 10_000 and row["files"] == 2 for row in rows)
    r = _cli("ls", fc_env.storage)
    assert r.returncode == 0 and "step" in r.stdout and "KiB" in r.stdout
    r = _cli("verify", fc_env.storage)
    assert r.returncode == 0 and r.stdout.count(": ok") == 2
    # Truncate a shard: verify names the file and fails.
    shard = fc_env.storage_path / "step-000000004" / "shard-00000-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    r = _cli("verify", fc_env.storage)
    assert r.returncode == 1
    assert "step 4: CORRUPT" in r.stdout and "shard-00000-of-00001.safetensors" in r.stdout
    assert "step 2: ok" in r.stdout
    r = _cli("verify", fc_env.storage + "-nothing-here")
    assert r.returncode == 1 and "no committed steps" in r.stderr


def test_load_reads_newest_intact_step(fc_env: FcEnv) -> None:
    _make_steps(fc_env)
    shard = fc_env.storage_path / "step-000000004" / "shard-00000-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[200] ^= 0xFF
    shard.write_bytes(bytes(raw))
    import pytest

    with pytest.warns(UserWarning, match="skipping step 4.*checksum"):
        ck = flashckpt.load(fc_env.storage)
    assert ck.step == 2
    assert isinstance(ck.state["model"]["0.weight"], torch.Tensor)
    with pytest.raises(flashckpt.CorruptCheckpointError, match="step-000000004"):
        flashckpt.load(fc_env.storage, step=4)


def test_detached_agent_with_pid_file_and_private_socket(fc_env: FcEnv, tmp_path: Path) -> None:
    pid_file = tmp_path / "agent.pid"
    r = _cli(
        "agent",
        "--job",
        fc_env.job,
        "--node",
        fc_env.node,
        "--run-dir",
        fc_env.run_dir,
        "--storage",
        fc_env.storage,
        "--detach",
        "--pid-file",
        str(pid_file),
    )
    assert r.returncode == 0, r.stderr
    pid = int(pid_file.read_text())
    proc = psutil.Process(pid)
    assert proc.is_running() and os.getsid(pid) != os.getsid(0)  # its own session
    sock = Path(fc_env.run_dir) / f"{fc_env.job}.{fc_env.node}.sock"
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(fc_env.run_dir).stat().st_mode) == 0o700
    # A second agent for the same job and node refuses to start (exit code 3).
    r2 = _cli("agent", "--job", fc_env.job, "--node", fc_env.node, "--run-dir", fc_env.run_dir)
    assert r2.returncode == 3
    # Trainers use it (agent="connect" requires it to be there).
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect", every=2)
    ) as ck:
        assert ck.status()["agent"]["pid"] == pid
        for step in range(2):
            train_step(model, opt, sched, step)
            ck.step()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert not sock.exists()
    assert fc_env.segments() == []
    assert flashckpt.load(fc_env.storage).step == 2


def test_connect_without_agent_is_a_clear_error(fc_env: FcEnv) -> None:
    import pytest

    from flashckpt.protocol import AgentError

    model, opt, sched = make(0)
    t0 = time.monotonic()
    with pytest.raises(AgentError, match=r"no flashckpt node agent.*flashckpt agent --job"):
        flashckpt.checkpointing(
            model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect")
        ).__enter__()
    assert time.monotonic() - t0 < 30


def test_bad_options_are_clear_errors() -> None:
    import pytest

    model, opt, _ = make(0)
    with pytest.raises(TypeError, match=r"unknown keyword.*'evry' \(did you mean 'every'\?\)"):
        flashckpt.checkpointing(model, opt, evry=3)
    with pytest.raises(ValueError, match="every=-1"):
        flashckpt.checkpointing(model, opt, every=-1)
    with pytest.raises(ValueError, match="when_busy='maybe'"):
        flashckpt.checkpointing(model, opt, when_busy="maybe")
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module"):
        flashckpt.checkpointing(opt)  # type: ignore[arg-type]
