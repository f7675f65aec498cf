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

from agentproc import start_agent
from fchelpers import FcEnv
from waiting import wait_until

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
    # Not ready=True: its ping would be a conversation the idle count might still hold.
    proc = start_agent(fc_env, storage="", idle_timeout=None, ready=False)
    try:
        path = socket_path(fc_env.run_dir, fc_env.job, fc_env.node)

        def listening() -> bool:
            assert proc.poll() is None, proc.log_tail()
            return os.path.exists(path)

        wait_until(listening, f"the agent's socket {path}", interval=0.05)
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

        def closed() -> bool:
            assert proc.poll() is None, (proc.returncode, proc.log_tail(3000))
            return _sockets(proc.pid) <= idle

        wait_until(
            closed,
            "the agent to close the clients' sockets",
            interval=0.05,
            state=lambda: f"{_sockets(proc.pid)} sockets, {idle} when idle",
        )
        assert proc.poll() is None, (proc.returncode, proc.log_tail(3000))
        _ping(path, proc.pid)
    finally:
        code = proc.stop(timeout=60)
    assert code == 0, proc.log_tail()
