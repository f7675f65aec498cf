"""The one harness of the tests that start a node agent process (``python -m flashckpt agent``).

``start_agent(env, *flags)`` starts one for ``env``'s job and node, its stdout and stderr in a
log file, and returns once it answers on the job's socket (the event, never a duration); an
agent that exits first fails the test with its log's tail. The returned :class:`AgentProc` is a
``subprocess.Popen`` (``pid``, ``wait``, ``send_signal`` as usual) with ``stop()``, ``kill9()``
and ``log_tail()``. Every agent started here is killed and reaped by ``reap(job)``, which the
``fc_env`` fixture calls at its end even when the test failed.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from waiting import wait_until

from flashckpt.protocol.channel import AgentClient, AgentError, socket_path

__all__ = ["AgentProc", "agent_request", "agent_status", "reap", "start_agent", "wait_agent"]

# job -> the agents this harness started for it (reaped by ``reap``).
_STARTED: dict[str, list[AgentProc]] = {}


class AgentProc(subprocess.Popen[bytes]):
    """An agent process of a test, its output in ``log``."""

    env: Any
    log: Path

    def log_tail(self, chars: int = 6000) -> str:
        """The end of the agent's output (empty where it wrote nothing yet)."""
        try:
            return self.log.read_bytes()[-chars:].decode(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        """Sends ``sig`` (SIGTERM: the agent's orderly stop) and returns the exit code; an agent
        still running after ``timeout`` seconds is SIGKILLed and fails the test with its log."""
        if self.poll() is None:
            self.send_signal(sig)
        try:
            return self.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise AssertionError(
                f"agent {self.pid} still ran {timeout:.0f} s after signal {sig}; its log:\n"
                f"{self.log_tail()}"
            ) from None

    def kill9(self) -> None:
        """SIGKILL (a crash: nothing of the agent runs after it), then reaps the process."""
        if self.poll() is None:
            self.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout=30)


def agent_command(
    env: Any,
    *flags: str,
    idle_timeout: float | None = 120,
    storage: str | None = None,
    launcher: Sequence[str] = (sys.executable, "-m", "flashckpt"),
) -> list[str]:
    """The command line of ``env``'s agent: the job's flags (its storage replaced by
    ``storage`` where given; ``""`` for none: a memory-only agent), ``--idle-timeout``, then
    ``flags``."""
    job = list(env.cli_flags())
    i = job.index("--storage")
    if storage == "":
        del job[i : i + 2]
    elif storage is not None:
        job[i + 1] = storage
    idle = [] if idle_timeout is None else ["--idle-timeout", str(idle_timeout)]
    return [*launcher, "agent", *job, *idle, *flags]


def start_agent(
    env: Any,
    *flags: str,
    idle_timeout: float | None = 120,
    storage: str | None = None,
    log: Path | None = None,
    wrap: Sequence[str] = (),
    launcher: Sequence[str] = (sys.executable, "-m", "flashckpt"),
    ready: bool = True,
) -> AgentProc:
    """Starts ``env``'s agent (see :func:`agent_command`), ``wrap`` before its command line (an
    ``unshare``, a ``setpriv``: one that execs the agent, so its pid is the agent's), its output
    appended to ``log`` (a temporary file by default).

    Args:
        ready: wait until the agent answers on the job's socket (a dead agent's socket file
            stays behind: only an answer of this process counts).
    """
    if log is None:
        fd, name = tempfile.mkstemp(prefix=f"fct-{env.job}-agent-{env.node}-", suffix=".log")
        log = Path(name)
        with open(fd, "wb"):
            pass
    cmd = [
        *wrap,
        *agent_command(env, *flags, idle_timeout=idle_timeout, storage=storage, launcher=launcher),
    ]
    with open(log, "ab") as out:
        p = AgentProc(cmd, stdout=out, stderr=subprocess.STDOUT)
    p.env, p.log = env, log
    _STARTED.setdefault(env.job, []).append(p)
    if ready:
        wait_agent(env, p.pid, p)
    return p


def reap(job: str) -> None:
    """Kills and reaps every agent this harness started for ``job`` (the end of a test)."""
    for p in _STARTED.pop(job, []):
        p.kill9()
        with contextlib.suppress(OSError):
            if p.log.name.startswith(f"fct-{job}-agent-"):
                p.log.unlink()


def _ping(path: str) -> int:
    c = AgentClient(path, timeout=0.0)
    try:
        return int(c.request("ping", timeout=10)["pid"])
    finally:
        c.close()


def wait_agent(
    env: Any, pid: int | None = None, proc: subprocess.Popen[bytes] | None = None
) -> int:
    """Waits until an agent (process ``pid``, if given) answers on ``env``'s socket; its pid.

    ``proc`` (the agent or its wrapper) exiting first fails the test with its output."""
    path = socket_path(env.run_dir, env.job, env.node)

    def answered() -> int | None:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"agent exited ({proc.returncode}) before it answered: {_output(proc)}"
            )
        got = _ping(path)
        return got if pid is None or got == pid else None

    return wait_until(
        answered,
        f"the agent of {env.job}/{env.node} to answer on {path}",
        ignore=(AgentError, OSError),
        state=lambda: _output(proc) if proc is not None else "",
    )


def _output(proc: subprocess.Popen[bytes]) -> str:
    if isinstance(proc, AgentProc):
        return proc.log_tail()
    if proc.stderr is not None and proc.poll() is not None:
        return proc.stderr.read().decode(errors="replace")[-6000:]
    return ""


def agent_request(env: Any, op: str, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
    """The answer of ``env``'s agent to one request ``op`` with ``fields``."""
    c = AgentClient(socket_path(env.run_dir, env.job, env.node), timeout=10.0)
    try:
        return c.request(op, timeout=timeout, **fields)
    finally:
        c.close()


def agent_status(env: Any, timeout: float = 30.0) -> dict[str, Any]:
    """The ``status`` answer of ``env``'s agent."""
    return agent_request(env, "status", timeout)
