"""deploy/systemd: the node agent's unit passes ``systemd-analyze verify``, its ExecStart parses
with the agent's own parser and keeps what the unit promises (restart, runtime directory kept,
memlock, a stop timeout covering the agent's persist), and the agent really tells systemd when it
is ready (``Type=notify``: ``READY=1`` on ``$NOTIFY_SOCKET`` once it answers on its socket)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from deployhelpers import DEPLOY, parse_agent

from flashckpt.protocol.channel import AgentClient, socket_path

UNIT = DEPLOY / "systemd" / "flashckpt-agent@.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "flashckpt-agent.env"


def _unit() -> dict[str, str]:
    """The unit's ``key=value`` lines (the last value of a key wins, as for systemd)."""
    out = {}
    for line in UNIT.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def _example_env() -> dict[str, str]:
    lines = ENV_EXAMPLE.read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))


def _exec_start(job: str) -> list[str]:
    env = _example_env()
    words = shlex.split(_unit()["ExecStart"].replace("%i", job))
    for k, v in env.items():
        words = [w.replace("${" + k + "}", v) for w in words]
    assert not any("${" in w for w in words), f"a variable the example env lacks: {words}"
    return words


def test_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: systemd)")
    # The installed paths of a real machine, here: the agent of this checkout, the example env.
    flashckpt = Path(sys.executable).with_name("flashckpt")
    text = UNIT.read_text().replace("/opt/flashckpt/bin/flashckpt", str(flashckpt))
    text = text.replace("/etc/flashckpt/%i.env", str(tmp_path / "%i.env"))
    text = text.replace("User=flashckpt", "User=root").replace("Group=flashckpt", "Group=root")
    (tmp_path / "flashckpt-agent@tjob.service").write_text(text)
    shutil.copy(ENV_EXAMPLE, tmp_path / "tjob.env")
    done = subprocess.run(
        [analyze, "verify", str(tmp_path / "flashckpt-agent@tjob.service")],
        capture_output=True,
        text=True,
    )
    # verify only warns about an unknown key (exit 0): any output is a failure here.
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), (
        done.stdout + done.stderr
    )


def test_exec_start_parses_and_the_unit_keeps_its_promises() -> None:
    words = _exec_start("myjob")
    assert words[1] == "agent"
    a = parse_agent(words[2:])
    unit = _unit()
    assert a.job == "myjob"
    assert a.run_dir == "/run/flashckpt/myjob" and unit["RuntimeDirectory"] == "flashckpt/%i"
    assert a.shm_dir.startswith(a.run_dir + "/")
    assert a.shm_dir in unit["ExecStartPre"].replace("%i", "myjob")  # its tmpfs
    assert unit["RuntimeDirectoryPreserve"] == "yes"  # the slots survive an agent restart
    assert unit["RuntimeDirectoryMode"] == "0700"  # the agent refuses a shared run dir
    assert unit["Restart"] == "always"
    assert unit["LimitMEMLOCK"] == "infinity"
    assert unit["Type"] == "notify"
    assert float(unit["TimeoutStopSec"]) >= a.stop_timeout + a.commit_timeout
    assert a.idle_timeout >= 86400 * 365  # a daemon: no idle exit
    # Its trainers share the host's PID namespace: hung elastic workers are killed (one in
    # another namespace never is: tests/monitor/test_monitor_pidns.py).
    assert a.hang_kill == "auto"


def test_agent_notifies_systemd_when_ready(tmp_path: Path) -> None:
    """Type=notify: the agent sends READY=1 once it answers on its socket; a client of
    ``$NOTIFY_SOCKET`` sees it, then the agent answers a ping at once."""
    job = "sd" + uuid.uuid4().hex[:10]
    run_dir = f"/tmp/fct-{job}"
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    notify = tmp_path / "notify.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(notify))
    server.settimeout(60)
    env = {**os.environ, "NOTIFY_SOCKET": str(notify)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flashckpt",
            "agent",
            f"--job={job}",
            "--node=n0",
            f"--run-dir={run_dir}",
            f"--shm-dir={shm}",
            "--idle-timeout=600",
            "--no-monitor",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        try:
            message = server.recv(4096)
        except TimeoutError:
            proc.kill()
            pytest.fail(f"no READY=1 from the agent: {proc.communicate()[1].decode()}")
        assert message == b"READY=1"
        client = AgentClient(socket_path(run_dir, job, "n0"), timeout=0.0)
        try:
            assert int(client.request("ping", timeout=10)["pid"]) == proc.pid
        finally:
            client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.communicate()[1].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        server.close()
        shutil.rmtree(run_dir, ignore_errors=True)
