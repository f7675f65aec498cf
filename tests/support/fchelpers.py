"""Test helpers shared by the flashckpt tests: job names, an in-process node agent, and cleanup of
every process and shared-memory segment a test creates (even on failure).

A module of its own (not conftest) so test files can import it by a unique name."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from agentproc import AgentProc, reap, start_agent

from flashckpt.agent.daemon import AgentConfig, NodeAgent


@dataclass
class FcEnv:
    """Names and places of one test's flashckpt job."""

    job: str
    node: str
    run_dir: str
    storage: str
    storage_path: Path
    shm_dir: str = "/dev/shm"

    def ckpt_kwargs(self, **over: Any) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "storage": self.storage,
            "job": self.job,
            "node": self.node,
            "run_dir": self.run_dir,
            "shm_dir": self.shm_dir,
        }
        kw.update(over)
        return kw

    def agent_config(self, **over: Any) -> AgentConfig:
        kw: dict[str, Any] = {
            "job": self.job,
            "node": self.node,
            "storage": self.storage,
            "run_dir": self.run_dir,
            "shm_dir": self.shm_dir,
            # poll_interval: the product's default (5 s), so a missing wake-up fails a test
            # rather than hiding behind a fast poll.
            "retry_interval": 0.2,
        }
        kw.update(over)
        return AgentConfig(**kw)

    def cli_flags(self) -> list[str]:
        """The job's flags as ``flashckpt agent`` and ``tests/tinytrain.py`` take them."""
        return [
            "--storage",
            self.storage,
            "--job",
            self.job,
            "--node",
            self.node,
            "--run-dir",
            self.run_dir,
            "--shm-dir",
            self.shm_dir,
        ]

    def reference(self, tmp: Path, name: str = "ref", **over: Any) -> FcEnv:
        """A job beside this one for an uninterrupted reference run: job ``<job>ref`` (so the
        fixture's cleanup finds its processes), storage ``<tmp>/<name>``; ``over`` replaces
        more fields (``shm_dir``)."""
        return dataclasses.replace(
            self,
            job=self.job + "ref",
            storage=f"file://{tmp}/{name}",
            storage_path=tmp / name,
            **over,
        )

    def segments(self) -> list[str]:
        return sorted(n for n in os.listdir(self.shm_dir) if n.startswith(f"fc.{self.job}."))

    def remove_segments(self) -> None:
        """Removes the job's segments from its shared-memory directory (a machine's memory
        lost, or the end of a test)."""
        with contextlib.suppress(FileNotFoundError):
            for n in self.segments():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.shm_dir, n))


def kill_job_processes(job: str) -> None:
    """SIGKILLs every process whose command line names the job id."""
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["pid"] != me and job in " ".join(p.info["cmdline"] or []):
                p.send_signal(signal.SIGKILL)
        except (psutil.Error, TypeError):
            pass


@pytest.fixture
def fc_env(tmp_path: Path) -> Iterator[FcEnv]:
    job = "t" + uuid.uuid4().hex[:12]
    run_dir = f"/tmp/fct-{job}"
    env = FcEnv(
        job=job,
        node="n0",
        run_dir=run_dir,
        storage=f"file://{tmp_path}/ckpt",
        storage_path=tmp_path / "ckpt",
    )
    yield env
    reap(job)
    kill_job_processes(job)
    for n in os.listdir("/dev/shm"):
        if n.startswith(f"fc.{job}"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", n))
    shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def private_shm(path: Path, size: str = "1g") -> Iterator[str]:
    """A tmpfs of this test's own at ``path`` (root), else a plain 0700 directory.

    Tests that leave a dead agent's segments behind use one: an agent of another job (another
    test, possibly of older code) must not see them."""
    path.mkdir(mode=0o700, exist_ok=True)
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield str(path)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def machines(
    env: FcEnv, tmp: Path, nodes: Sequence[str], shm_size: str = "256m"
) -> Iterator[list[FcEnv]]:
    """``env``'s job on simulated machines named ``nodes``: each its node id and a shared-memory
    directory of its own (:func:`private_shm`, ``<tmp>/shm-<node>``); the job's segments there
    are removed at the end (stop their agents first)."""
    with contextlib.ExitStack() as stack:
        envs = [
            dataclasses.replace(
                env, node=n, shm_dir=stack.enter_context(private_shm(tmp / f"shm-{n}", shm_size))
            )
            for n in nodes
        ]
        try:
            yield envs
        finally:
            for e in envs:
                e.remove_segments()


@contextlib.contextmanager
def sized_tmpfs(path: Path, size: str, required: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (a new directory), unmounted at the end: a
    small disk or shared-memory directory that really fills up. Where the mount is refused the
    test is skipped (``required``: it fails)."""
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if r.returncode != 0:
        why = f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}"
        assert not required, why
        pytest.skip(why)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def fc_env_private(fc_env: FcEnv, tmp_path: Path) -> Iterator[FcEnv]:
    """``fc_env`` with a shared-memory directory of its own (see :func:`private_shm`)."""
    with private_shm(tmp_path / "shm") as shm:
        fc_env.shm_dir = shm
        try:
            yield fc_env
        finally:
            kill_job_processes(fc_env.job)


class RunningAgent:
    """A node agent served from a thread of the test process."""

    def __init__(self, config: AgentConfig) -> None:
        self.agent = NodeAgent(config)
        self.agent.start()
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.agent.request_stop()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "agent did not stop"


@pytest.fixture
def agent(fc_env: FcEnv) -> Iterator[RunningAgent]:
    a = RunningAgent(fc_env.agent_config())
    yield a
    if a.thread.is_alive():
        a.stop()


def tinytrain_command(env: FcEnv, log: Path, *extra: str) -> list[str]:
    """The command line of ``tests/tinytrain.py`` as a trainer of ``env``'s job, logging its
    steps to ``log``; ``extra`` are more of its flags (see its ``--help``)."""
    script = Path(__file__).with_name("tinytrain.py")
    return [sys.executable, str(script), *env.cli_flags(), "--log", str(log), *extra]


def start_tinytrain(
    env: FcEnv, log: Path, *extra: str, wrap: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    """Starts ``tests/tinytrain.py`` as a trainer of ``env``'s job (:func:`tinytrain_command`),
    ``wrap`` before it, its stderr appended to ``<log>.err``."""
    with open(f"{log}.err", "ab") as err:
        return subprocess.Popen(
            [*wrap, *tinytrain_command(env, log, *extra)], stdout=subprocess.DEVNULL, stderr=err
        )


def finish_tinytrain(p: subprocess.Popen[bytes], log: Path, timeout: float = 300.0) -> None:
    """Waits for a trainer of :func:`start_tinytrain` to exit 0 (its stderr's tail otherwise)."""
    assert p.wait(timeout=timeout) == 0, Path(f"{log}.err").read_text()[-4000:]


def run_ranks(script: str, env: FcEnv, tmp: Path, tag: str, *args: str, code: int = 0) -> None:
    """Runs a multi-rank trainer of ``tests/`` (``shardtrain.py``, ``tptrain.py``: its ranks are
    forked from one launcher process and die with it) for ``env``'s job to the end; it must exit
    with ``code``. It logs to ``<tmp>/<tag>.log`` and reports to ``<tmp>/report.txt``; ``args``
    are more of its flags. Its stderr is shown on failure."""
    cmd = [
        sys.executable,
        str(Path(__file__).with_name(script)),
        "--storage",
        env.storage,
        "--job",
        env.job,
        "--run-dir",
        env.run_dir,
        "--log",
        str(tmp / f"{tag}.log"),
        "--init-file",
        str(tmp / f"init-{tag}-{time.monotonic_ns()}"),
        "--report",
        str(tmp / "report.txt"),
        *args,
    ]
    err = tmp / f"{tag}-{time.monotonic_ns()}.stderr"
    with open(err, "wb") as f:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
    try:
        p.wait(timeout=240)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)  # its ranks die with it (PR_SET_PDEATHSIG)
        p.wait(timeout=30)
    assert p.returncode == code, err.read_text()[-6000:]


def agent_process(env: FcEnv) -> AgentProc:
    """A hand-started agent process of the job (``python -m flashckpt agent``, so no
    exit_when_done), answering on the job's socket when this returns (see ``agentproc``)."""
    return start_agent(env)
