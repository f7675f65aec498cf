"""The kill/resume harness of the framework adapters' tests (``tests/integrations``): a training
script run as a subprocess (``hftrain.py``, ``pltrain.py``, ``tttrain.py``) that appends one line
per step to ``<out>.log`` and writes ``final.safetensors`` and ``final.json`` into ``<out>``; it
is SIGKILLed once enough steps are logged and started again with the same command."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import safetensors.torch
import torch
from fchelpers import FcEnv, kill_job_processes
from waiting import wait_until


def command(script: Path, env: FcEnv, out: Path, steps: int, *extra: str) -> list[str]:
    """The command line of ``script`` as a trainer of ``env``'s job, writing into ``out`` and
    logging its steps to ``<out>.log``."""
    cli = [sys.executable, str(script), *env.cli_flags(), "--out", str(out)]
    return [*cli, "--log", str(out) + ".log", "--steps", str(steps), *extra]


def torchrun_command(script: Path, env: FcEnv, out: Path, steps: int, *extra: str) -> list[str]:
    """The command line of a 2-rank DDP run (gloo) of ``script`` under ``torchrun
    --standalone`` (no --node or --log: torchrun's own parser would take them for its
    --node-rank and --log-dir)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        str(script),
        "--storage",
        env.storage,
        "--job",
        env.job,
        "--run-dir",
        env.run_dir,
        "--shm-dir",
        env.shm_dir,
        "--out",
        str(out),
        "--steps-log",
        str(out) + ".log",
        "--steps",
        str(steps),
        *extra,
    ]


@dataclass(frozen=True)
class TrainScript:
    """A training script of ``tests/support`` as a test module kills and resumes it: ``steps``
    steps in one process, ``ddp_steps`` under ``torchrun`` (2 ranks)."""

    name: str
    steps: int
    ddp_steps: int = 12

    @property
    def path(self) -> Path:
        return Path(__file__).resolve().parent / self.name

    def command(self, env: FcEnv, out: Path, *extra: str) -> list[str]:
        """The one-process command line (see :func:`command`)."""
        return command(self.path, env, out, self.steps, *extra)

    def torchrun_command(self, env: FcEnv, out: Path, *extra: str) -> list[str]:
        """The 2-rank torchrun command line (see :func:`torchrun_command`)."""
        return torchrun_command(self.path, env, out, self.ddp_steps, *extra)

    def kill_torchrun_at(
        self, cmd: list[str], out: Path, step: int, ranks: tuple[int, ...], launcher: bool
    ) -> int:
        """:func:`kill_torchrun_at` for this script's training processes."""
        return kill_torchrun_at(cmd, out, step, self.path, ranks, launcher)


def reference_env(env: FcEnv) -> FcEnv:
    """``env``'s machine with a job and a storage root of their own, for an uninterrupted run
    beside the test's."""
    return FcEnv(**{**vars(env), "job": env.job + "r", "storage": env.storage + "-r"})


def starts(out: Path) -> list[list[str]]:
    """The lines of ``<out>/starts.txt``, split: one per start of the command (rank 0's), the
    step restored and where from (``memory``, ``storage``; ``None None`` for a fresh start)."""
    return [line.split() for line in (out / "starts.txt").read_text().splitlines()]


def run(cmd: list[str], code: int = 0) -> str:
    """Runs the command to its end; it must exit with ``code``. Returns its stderr."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == code, p.stderr[-4000:]
    return p.stderr


def log_lines(out: Path) -> list[str]:
    """The lines of ``<out>.log`` (one per step, from every run of the command)."""
    with contextlib.suppress(FileNotFoundError):
        return Path(str(out) + ".log").read_text().splitlines()
    return []


def kill_at(cmd: list[str], out: Path, step: int) -> None:
    """Starts the run and SIGKILLs it once ``step`` steps are logged."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: len(log_lines(out)) >= step or p.poll() is not None, f"step {step}", 240)
        assert p.poll() is None, p.stderr.read().decode()[-4000:] if p.stderr else ""
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGKILL


def kill_torchrun_at(
    cmd: list[str], out: Path, step: int, script: Path, ranks: tuple[int, ...], launcher: bool
) -> int:
    """Starts the torchrun command and, once ``step`` steps are logged, SIGKILLs the training
    processes of ``ranks`` (in that order), then torchrun itself if ``launcher``; returns
    torchrun's exit status once it has ended."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: len(log_lines(out)) >= step or p.poll() is not None, f"step {step}", 240)
        assert p.poll() is None, p.stderr.read().decode()[-4000:] if p.stderr else ""
        procs = {
            int(c.environ().get("RANK", -1)): c
            for c in psutil.Process(p.pid).children(recursive=True)
            if str(script) in " ".join(c.cmdline())
        }
        for rank in ranks:
            procs[rank].send_signal(signal.SIGKILL)
        if launcher:
            p.send_signal(signal.SIGKILL)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode


def lose_machine(env: FcEnv) -> None:
    """The machine is lost: every process of the job (its node agent too) is SIGKILLed and its
    shared memory is gone; a restart can resume from storage only."""
    kill_job_processes(env.job)
    for name in os.listdir(env.shm_dir):
        if name.startswith(f"fc.{env.job}."):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(env.shm_dir, name))


def final(out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The run's ``final.safetensors`` and ``final.json``."""
    tensors = safetensors.torch.load_file(str(out / "final.safetensors"))
    return tensors, json.loads((out / "final.json").read_text())


def different(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors are not ``torch.equal`` (the names must be the same)."""
    assert a.keys() == b.keys()
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


@contextlib.contextmanager
def reference_job(tmp: Path) -> Iterator[FcEnv]:
    """A job of its own for the uninterrupted runs (a module fixture's, so not ``fc_env``);
    its processes, shared memory and run directory are removed afterwards."""
    job = "t" + uuid.uuid4().hex[:12] + "ref"
    env = FcEnv(
        job=job,
        node="n0",
        run_dir=f"/tmp/fct-{job}",
        storage=f"file://{tmp}/ckpt",
        storage_path=tmp / "ckpt",
    )
    try:
        yield env
    finally:
        lose_machine(env)
        shutil.rmtree(env.run_dir, ignore_errors=True)
