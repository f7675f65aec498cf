"""The node agent outlives trainers that vanish mid-conversation.

A trainer killed while the agent writes to its socket (a reply, a "committed" event) makes the
agent's next write fail with EPIPE. A process with the default SIGPIPE action dies of that
silently, with its segments left behind: the agent must never.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from fchelpers import FcEnv

from flashckpt.protocol.channel import AgentClient, socket_path


def _sockets(pid: int) -> int:
    """How many sockets the process ``pid`` has open (its listener and its conversations)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed while we looked
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


def _ping(path: str, pid: int) -> None:
    client = AgentClient(path, on_event=None, timeout=5)
    try:
        assert client.request("ping", timeout=10)["pid"] == pid
    finally:
        client.close()


def test_agent_survives_a_client_that_vanishes_while_it_writes(fc_env: FcEnv) -> None:
    os.makedirs(fc_env.run_dir, mode=0o700, exist_ok=True)
    cmd = [sys.executable, "-m", "flashckpt", "agent", "--job", fc_env.job, "--node", fc_env.node]
    cmd += ["--run-dir", fc_env.run_dir, "--shm-dir", fc_env.shm_dir]
    log = open(os.path.join(fc_env.run_dir, "agent.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    try:
        path = socket_path(fc_env.run_dir, fc_env.job, fc_env.node)
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            assert proc.poll() is None, Path(log.name).read_text()
            time.sleep(0.05)
        idle = _sockets(proc.pid)
        # Clients that ask for many replies and hang up at once: the agent's writes after the
        # peer's reset fail with EPIPE.
        reqs = b"".join(json.dumps({"op": "status", "id": i}).encode() + b"\n" for i in range(200))
        for _ in range(20):
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                s.sendall(reqs)
        # A connection behind them is accepted after theirs (one listen queue, in order); once
        # the agent holds no more sockets than when idle it has written every reply it would
        # (a write into a dead peer is what kills a process with the default SIGPIPE action).
        _ping(path, proc.pid)
        deadline = time.monotonic() + 60
        while _sockets(proc.pid) > idle:
            assert proc.poll() is None, (proc.returncode, Path(log.name).read_text()[-3000:])
            assert time.monotonic() < deadline, "the agent still holds the clients' sockets"
            time.sleep(0.05)
        assert proc.poll() is None, (proc.returncode, Path(log.name).read_text()[-3000:])
        _ping(path, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    assert proc.returncode == 0
