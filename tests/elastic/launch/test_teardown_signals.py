"""SIGTERM or SIGHUP to a ``flashckpt run --standalone`` launcher's whole process group (``kill
-TERM -<pgid>``, a closed terminal, a batch system stopping the job): the launcher stops the
workers, then the node agent (it writes what storage lacks), then its private etcd, and removes
the etcd's data; nothing it started is left running; the same command run again resumes from the
newest snapshot taken, bitwise equal to an uninterrupted run (issue 30). Also ``kill -9`` of the
launcher alone with no storage anywhere: the agent keeps its segments (the only copy), the rerun
resumes from memory and removes the killed launcher's etcd data. Ctrl-C through a terminal and
``kill -9`` with storage are in test_teardown.py, whose harness this reuses."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import termios
import threading
from pathlib import Path

import psutil
import pytest
import torch
from elasticcluster import Machine, SimCluster, cluster_env
from test_teardown import (
    EVERY,
    WORKER_ARGS,
    _agent_pids,
    _command,
    _rerun_resumes_from,
    _start,
    _steps_done,
)

from flashckpt.testing.elastic import process_tree

pytestmark = [pytest.mark.slow, pytest.mark.etcd]

assert WORKER_ARGS  # the module's reference_model runs these (conftest reads WORKER_ARGS)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_to_the_launchers_process_group_then_the_same_command_resumes_from_the_newest(
    tmp_path: Path, reference_model: dict[str, torch.Tensor], sig: signal.Signals
) -> None:
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=WORKER_ARGS)
    try:
        cmd = _command(cluster, "n0", "file")
        machine = _start(cluster, "n0", cmd)  # its own session: its pid is the group's id
        cluster.wait_for("12 steps", lambda: _steps_done(cluster) >= 12, 120)
        started = process_tree(machine.proc.pid)
        assert any("etcd" in " ".join(p.cmdline()) for p in started), started
        assert list(Path(cluster.run_dir).glob("flashckpt-etcd-*"))
        os.killpg(machine.proc.pid, sig)
        done = _steps_done(cluster)
        code = cluster.wait_exit("n0", 120)
        out = machine.tail(20000)
        assert code == 128 + sig, out
        assert f"stopping on {sig.name}" in out, out
        # Nothing it started got the signal before the launcher stopped it in order.
        assert "pre-warm process went away" not in out, out
        assert "lease" not in out.lower(), out
        assert "starting it again" not in out, out
        # No orphans: the workers, torch's agent, the node agent, the zygote and etcd are gone.
        _, alive = psutil.wait_procs(started, timeout=60)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        # The private etcd's data went with it.
        assert not list(Path(cluster.run_dir).glob("flashckpt-etcd-*")), out
        _rerun_resumes_from(
            cluster,
            cmd,
            done // EVERY * EVERY,
            max(e["t"] for e in cluster.events()),
            reference_model,
        )
    finally:
        cluster.close()


@pytest.mark.timeout(400)
def test_kill_9_of_the_launcher_with_memory_only_then_the_same_command_resumes_from_memory(
    tmp_path: Path, reference_model: dict[str, torch.Tensor]
) -> None:
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=WORKER_ARGS)
    try:
        cmd = _command(cluster, "n0", "memory")
        machine = _start(cluster, "n0", cmd)
        cluster.wait_for("12 steps", lambda: _steps_done(cluster) >= 12, 120)
        started = process_tree(machine.proc.pid)
        agents = _agent_pids(machine)
        assert len(agents) == 1, [p.cmdline() for p in started]
        machine.proc.kill()  # the launcher's pid alone
        done = _steps_done(cluster)
        machine.proc.wait(timeout=30)
        # Everything it started goes (parent-death signals); the agent, on its SIGTERM with no
        # storage, keeps its segments and exits with its "kept" code.
        _, alive = psutil.wait_procs(started, timeout=90)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        assert list(cluster.shm_root.rglob("*")), "the agent's segments are gone"
        leftover = list(Path(cluster.run_dir).glob("flashckpt-etcd-*"))
        assert len(leftover) == 1, leftover  # the killed launcher could not remove it
        t_stop = max(e["t"] for e in cluster.events())
        _rerun_resumes_from(cluster, cmd, done // EVERY * EVERY, t_stop, reference_model)
        restored = cluster.restored_since(t_stop)
        assert {e["restored_from"] for e in restored} == {"memory"}, restored
        # The rerun removed the killed launcher's etcd data at its start, its own at its end.
        assert not list(Path(cluster.run_dir).glob("flashckpt-etcd-*"))
    finally:
        cluster.close()


@pytest.mark.timeout(400)
def test_the_terminal_closed_under_the_launcher_then_the_same_command_resumes_from_the_newest(
    tmp_path: Path, reference_model: dict[str, torch.Tensor]
) -> None:
    """The launcher's terminal hung up (the window closed, ssh gone): its stdin, stdout and
    stderr are the terminal, which refuses every write after the hangup (EIO); the kernel
    SIGHUPs the session. The launcher still stops the workers, the agent persists, and the rerun
    resumes from the newest snapshot."""
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=WORKER_ARGS)
    master, slave = os.openpty()
    shown: list[bytes] = []
    stop = threading.Event()

    def read_terminal() -> None:  # what the user's terminal shows; never lets it fill up
        while not stop.is_set():
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    shown.append(os.read(master, 65536))
                except OSError:
                    return

    def on_tty() -> None:  # pragma: no cover - runs in the child between fork and exec
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        cmd = _command(cluster, "n0", "file")
        (cluster.shm_root / "n0").mkdir(parents=True, exist_ok=True)
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                env=cluster_env(),
                cwd=cluster.root,
                preexec_fn=on_tty,
            )
        finally:
            os.close(slave)
        log = cluster.root / "launcher-n0.log"
        cluster.machines["n0"] = Machine("n0", proc, log, cluster.root / "launcher-n0.jsonl")
        cluster.wait_for("12 steps", lambda: _steps_done(cluster) >= 12, 120)
        started = process_tree(proc.pid)
        stop.set()
        reader.join()
        os.close(master)  # the last reference: the terminal hangs up
        master = -1
        done = _steps_done(cluster)
        code = proc.wait(timeout=120)
        screen = b"".join(shown).decode(errors="replace")
        assert code == 128 + signal.SIGHUP, (code, screen, cluster.logs())
        _, alive = psutil.wait_procs(started, timeout=60)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        # The agent was stopped by the launcher, once, and wrote what storage lacked.
        assert max(cluster.committed(), default=0) >= done // EVERY * EVERY, cluster.logs()
        assert not list(Path(cluster.run_dir).glob("flashckpt-etcd-*"))
        log.write_text("")  # the rerun's output goes to the log file
        _rerun_resumes_from(
            cluster,
            cmd,
            done // EVERY * EVERY,
            max(e["t"] for e in cluster.events()),
            reference_model,
        )
    finally:
        stop.set()
        if master >= 0:
            os.close(master)
        cluster.close()
