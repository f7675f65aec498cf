"""However a ``flashckpt run --standalone`` ends, the same command run again resumes from the
newest snapshot taken (issue 30).

- Ctrl-C in the terminal running the launcher: the tty driver sends SIGINT to the terminal's
  foreground process group. The private etcd, the node agent and the pre-warm zygote run in
  sessions of their own, so only the launcher gets it; it stops the workers, then the node agent
  (which writes what storage lacks, or keeps its segments), then etcd.
- ``kill -9`` of the launcher's pid alone: the node agent gets SIGTERM from the kernel
  (parent-death signal) and writes or keeps; nothing of the launcher's removes its segments.

Snapshots every 5 steps, storage written only when a stop forces it (``persist_every`` 1 h):
storage lags memory, as with the default ``persist_every`` of a real run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from elasticcluster import Machine, SimCluster, assert_same_model, cluster_env

from flashckpt.testing.elastic import process_tree

EVERY = 5
WORKER_ARGS = ["--steps", "40", "--every", str(EVERY), "--persist-every", "1h"]

pytestmark = [pytest.mark.slow, pytest.mark.etcd]


@pytest.fixture
def make_cluster() -> Iterator[list[SimCluster]]:
    clusters: list[SimCluster] = []
    yield clusters
    for cluster in clusters:
        cluster.close()


def _steps_done(cluster: SimCluster) -> int:
    """Steps every rank has finished so far."""
    return min(
        max(
            (e["step"] + 1 for e in cluster.events() if e["event"] == "step" and e["rank"] == r),
            default=0,
        )
        for r in (0, 1)
    )


def _command(cluster: SimCluster, node: str, storage: str) -> list[str]:
    """The cluster's launcher command; with ``storage`` "memory" no storage anywhere (memory is
    the only copy)."""
    cmd = cluster.command(node)
    if storage == "file":
        return cmd
    out: list[str] = []
    skip = False
    for arg in cmd:  # drops the launcher's and the worker's --storage and their values
        if skip:
            skip = False
        elif arg == "--storage":
            skip = True
        else:
            out.append(arg)
    return [*out, "--storage", ""]  # the worker's: memory only


def _start(cluster: SimCluster, node: str, cmd: list[str]) -> Machine:
    log = cluster.root / f"launcher-{node}.log"
    (cluster.shm_root / node).mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=cluster_env(),
            cwd=cluster.root,
            start_new_session=True,
        )
    machine = Machine(node, proc, log, cluster.root / f"launcher-{node}.jsonl")
    cluster.machines[node] = machine
    return machine


def _on_tty(cluster: SimCluster, node: str, cmd: list[str]) -> tuple[Machine, int]:
    """Starts the machine's launcher as a shell would in a terminal: its own session, a pseudo-
    terminal as its controlling terminal, its process group the terminal's foreground group.
    Returns the machine and the terminal's master side (what the user types into)."""
    master, slave = os.openpty()
    log = cluster.root / f"launcher-{node}.log"
    (cluster.shm_root / node).mkdir(parents=True, exist_ok=True)

    def on_tty() -> None:  # pragma: no cover - runs in the child between fork and exec
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # stdin is the slave

    try:
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                cmd,
                stdin=slave,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=cluster_env(),
                cwd=cluster.root,
                preexec_fn=on_tty,
            )
    finally:
        os.close(slave)
    machine = Machine(node, proc, log, cluster.root / f"launcher-{node}.jsonl")
    cluster.machines[node] = machine
    return machine, master


def _etcd_data(cluster: SimCluster) -> list[Path]:
    """The private etcd data directories under the launcher's run directory."""
    return sorted(Path(cluster.run_dir).glob("flashckpt-etcd-*"))


def _agent_pids(machine: Machine) -> list[psutil.Process]:
    return [
        p
        for p in process_tree(machine.proc.pid)
        if "agent" in p.cmdline() and "flashckpt" in " ".join(p.cmdline())
    ]


def _rerun_resumes_from(
    cluster: SimCluster,
    cmd: list[str],
    newest: int,
    t_stop: float,
    reference: dict[str, torch.Tensor],
) -> None:
    """The same command again finishes, resumed at ``newest`` or later on every rank, with the
    model of an uninterrupted run."""
    node = "n0"
    _start(cluster, node, cmd)
    assert cluster.wait_exit(node, 150) == 0, cluster.logs()
    restored = cluster.restored_since(t_stop)
    assert {e["rank"] for e in restored} == {0, 1}, restored
    for e in restored:
        assert e["start_step"] >= newest, (restored, newest, cluster.logs())
    assert_same_model(cluster.out, reference)


@pytest.mark.parametrize("storage", ["file", "memory"])
def test_ctrl_c_in_the_terminal_then_the_same_command_resumes_from_the_newest_snapshot(
    tmp_path: Path,
    reference_model: dict[str, torch.Tensor],
    make_cluster: list[SimCluster],
    storage: str,
) -> None:
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=WORKER_ARGS)
    make_cluster.append(cluster)
    cmd = _command(cluster, "n0", storage)
    machine, master = _on_tty(cluster, "n0", cmd)
    try:
        cluster.wait_for("12 steps", lambda: _steps_done(cluster) >= 12, 120)
        assert termios.tcgetattr(master)[3] & termios.ISIG  # the tty turns ^C into SIGINT
        os.write(master, b"\x03")  # Ctrl-C
        done = _steps_done(cluster)
        code = cluster.wait_exit("n0", 120)
    finally:
        with contextlib.suppress(OSError):
            os.close(master)
    out = machine.tail(20000)
    assert code == 130, out  # 128 + SIGINT
    assert "stopping on SIGINT" in out, out
    # Nothing below the launcher got the Ctrl-C: no zygote, etcd or agent died under it.
    assert "pre-warm process went away" not in out, out
    assert "lease" not in out.lower(), out
    assert "starting it again" not in out, out  # the node agent was not restarted
    assert _etcd_data(cluster) == [], out  # the private etcd's data went with it
    if storage == "memory":  # the agent kept its segments: the only copy
        assert "kept" in out, out
        # ... and `flashckpt clean` keeps them (exit 1, naming the step) unless --force.
        shm = cluster.shm_root / "n0"
        kept = sorted(p for p in shm.rglob("*") if p.is_file())
        clean = [sys.executable, "-m", "flashckpt", "clean", "--shm-dir", str(shm)]
        proc = subprocess.run(clean, capture_output=True, text=True, env=cluster_env(), timeout=60)
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert "(the job has no storage). Run the job's command again" in proc.stdout, proc.stdout
        assert sorted(p for p in shm.rglob("*") if p.is_file()) == kept
    _rerun_resumes_from(
        cluster, cmd, done // EVERY * EVERY, max(e["t"] for e in cluster.events()), reference_model
    )


def test_kill_9_of_the_launcher_alone_then_the_same_command_resumes_from_the_newest_snapshot(
    tmp_path: Path, reference_model: dict[str, torch.Tensor], make_cluster: list[SimCluster]
) -> None:
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=WORKER_ARGS)
    make_cluster.append(cluster)
    cmd = _command(cluster, "n0", "file")
    machine = _start(cluster, "n0", cmd)
    cluster.wait_for("12 steps", lambda: _steps_done(cluster) >= 12, 120)
    agents = _agent_pids(machine)
    assert len(agents) == 1, [p.cmdline() for p in process_tree(machine.proc.pid)]
    machine.proc.kill()  # the launcher's pid alone
    done = _steps_done(cluster)
    machine.proc.wait(timeout=30)
    # The agent writes what storage lacks (or keeps its segments) and exits on its own.
    _, alive = psutil.wait_procs(agents, timeout=90)
    assert not alive, alive
    left = _etcd_data(cluster)
    assert len(left) == 1, left  # the private etcd's data: the next start removes it
    _rerun_resumes_from(
        cluster, cmd, done // EVERY * EVERY, max(e["t"] for e in cluster.events()), reference_model
    )
    assert _etcd_data(cluster) == [], cluster.logs()
    # Nothing of either launcher's agents is left in shared memory: no slot, and no (empty)
    # generation directory of the killed launcher (issue 41: an empty .g1 stayed).
    shm = cluster.shm_root / "n0"
    assert sorted(str(p) for p in shm.rglob("*")) == [], cluster.logs()
