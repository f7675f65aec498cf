"""How ``flashckpt run`` ends where the user's action leaves it nothing, or nothing it can mend
(issue 41):

- the same command run again after the job finished (its rendezvous closed in the shared etcd)
  refuses loudly with exit code 2 and names ``--rerun-finished``, starting no worker; with the
  flag (and more steps) it trains on from the committed state, bitwise equal to an uninterrupted
  run of the longer job (row 2);
- storage that fills up before the final commit at exit fails the launcher once, with the
  ``PersistError`` text on its terminal, and restarts nothing (row 5); a shared-memory directory
  too small for the snapshots fails once, with the ``ShmSpaceError`` text, and restarts nothing
  (row 12);
- the same command started again while the job runs on this machine is refused at once (exit
  code 2, naming the running launcher's pid), touching none of its files (row 12);
- Ctrl-C of ``flashckpt run ... | tee log``: the pipe is closed when the launcher prints its
  summary; the teardown completes anyway, exit code 130, no etcd data left (row 11).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from elasticcluster import Machine, SimCluster, assert_same_model, cluster_env
from fchelpers import private_shm

from flashckpt.format.storage import Storage
from flashckpt.format.storage_owner import claim_root

pytestmark = [pytest.mark.slow, pytest.mark.etcd]

WORKER_ARGS = ["--steps", "16", "--every", "4"]
"""The long job (the reference); the first run stops at 8 steps."""


def _starts(cluster: SimCluster) -> int:
    return sum(1 for e in cluster.events() if e["event"] == "start")


@pytest.mark.timeout(300)
def test_a_finished_job_run_again_refuses_and_rerun_finished_trains_on_bitwise(
    tmp_path: Path, etcd_server: str, reference_model: dict[str, torch.Tensor]
) -> None:
    cluster = SimCluster(tmp_path, etcd_server, nnodes="1", nproc=2, worker_args=WORKER_ARGS)
    try:
        cluster.start("n0", worker_args=["--steps", "8", "--step-sleep", "0"])
        assert cluster.wait_exit("n0", 150) == 0, cluster.logs()
        assert 8 in cluster.committed(), cluster.logs()
        starts = _starts(cluster)

        # The same command again, on the same etcd: the job is over; nothing silent.
        again = cluster.start("n0", worker_args=["--steps", "8"])
        assert cluster.wait_exit("n0", 60) == 2, cluster.logs()
        out = again.tail()
        assert "already ended (its workers finished" in out, out
        assert "--rerun-finished" in out and "new --rdzv-id" in out, out
        assert "without needing this standby" not in out, out
        assert _starts(cluster) == starts, "a worker started"

        # With the flag and more steps: trains on from step 8, equal to the 16-step job.
        cluster.start("n0", "--rerun-finished", worker_args=["--step-sleep", "0"])
        assert cluster.wait_exit("n0", 150) == 0, cluster.logs()
        restored = [e for e in cluster.events() if e["event"] == "restored"][-2:]
        assert [e["start_step"] for e in restored] == [8, 8], restored
        assert {e["restored_from"] for e in restored} == {"storage"}, restored
        assert_same_model(cluster.out, reference_model)
    finally:
        cluster.close()


def _fill(directory: Path) -> None:
    """Fills the file system of ``directory`` to the last page."""
    with open(directory / "filler", "wb", buffering=0) as f:
        for size in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * size)
    with pytest.raises(OSError) as full, open(directory / "probe", "wb", buffering=0) as f:
        f.write(b"\0" * 4096)
    assert full.value.errno == errno.ENOSPC, full.value


@pytest.mark.timeout(300)
@pytest.mark.timeout(420)
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs of its own size")
def test_errors_no_restart_can_mend_fail_the_launcher_once_with_their_text(tmp_path: Path) -> None:
    cluster = SimCluster(
        tmp_path,
        None,
        nnodes="1",
        nproc=2,
        worker_args=["--steps", "400", "--every", "4", "--persist-every", "1h"],
    )
    cluster.storage_path.mkdir()
    with private_shm(cluster.storage_path, size="512k"):
        try:
            # Storage full before the final commit at exit: once, with the PersistError.
            machine = cluster.start("n0", "--max-restarts", "3", worker_args=["--step-sleep", "0"])
            cluster.wait_for("4 steps", lambda: len(cluster.steps()) >= 8, 120)
            _fill(cluster.storage_path)
            code = cluster.wait_exit("n0", 150)
            out = machine.tail(30000)
            assert code == 1, out
            # The launcher's own line, once, with the worker's error (its type and text).
            assert out.count("no restart can mend") == 1, out
            assert "(local rank 0): PersistError: step 400 (the final snapshot)" in out, out
            assert "No space left on device" in out, out
            # Where the work is: in memory, for the same command once storage has room.
            assert "the same command run again resumes from them" in out, out
            events = machine.events()
            assert not [e for e in events if e["event"] == "workers_restart"], events
            assert _starts(cluster) == 2, "a worker was restarted"
        finally:
            cluster.close()
    # Shared memory too small for the snapshots: once, with the ShmSpaceError.
    shm = tmp_path / "tiny-shm"
    with private_shm(shm, size="8k"):
        small = SimCluster(tmp_path / "b", None, nnodes="1", nproc=2, worker_args=["--steps", "8"])
        try:
            cmd = small.command("n0", "--max-restarts", "3")
            cmd[cmd.index("--shm-dir") + 1] = str(shm)
            machine = _start(small, cmd)
            code = small.wait_exit("n0", 150)
            out = machine.tail(30000)
            assert code == 1, out
            assert out.count("no restart can mend") == 1, out
            assert "): ShmSpaceError: " in out, out
            assert not [e for e in machine.events() if e["event"] == "workers_restart"], out
            assert "its work is lost" not in out, out
        finally:
            small.close()
    # The script's own storage= belongs to another job: once, with the StorageRootRefused.
    other = SimCluster(tmp_path / "c", None, nnodes="1", nproc=2, worker_args=["--steps", "8"])
    other.launcher_storage = False  # the script's storage= only: the workers meet the owner
    assert claim_root(Storage(other.storage), "another-job") is None
    try:
        machine = other.start("n0", "--max-restarts", "3")
        code = other.wait_exit("n0", 150)
        out = machine.tail(30000)
        assert code == 1, out
        assert out.count("no restart can mend") == 1, out
        assert "): StorageRootRefused: storage " in out and "'another-job'" in out, out
        assert not [e for e in machine.events() if e["event"] == "workers_restart"], out
        assert _starts(other) == 2, "a worker was restarted"
    finally:
        other.close()


def _start(cluster: SimCluster, cmd: list[str], **popen: object) -> Machine:
    log = cluster.root / "launcher-n0.log"
    cluster.root.mkdir(parents=True, exist_ok=True)
    (cluster.shm_root / "n0").mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        # stdout elsewhere (a pipe): the log keeps stderr (the terminal of a `| tee`).
        kw: dict[str, object] = (
            {"stdout": popen["stdout"], "stderr": f}
            if "stdout" in popen
            else {"stdout": f, "stderr": subprocess.STDOUT}
        )
        proc = subprocess.Popen(
            cmd,
            env=cluster_env(),
            cwd=cluster.root,
            start_new_session=True,
            **kw,  # type: ignore[arg-type]
        )
    machine = Machine("n0", proc, log, cluster.root / "launcher-n0.jsonl")
    cluster.machines["n0"] = machine
    return machine


@pytest.mark.timeout(300)
def test_ctrl_c_of_the_launcher_piped_to_a_tee_that_died_completes_the_teardown(
    tmp_path: Path,
) -> None:
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=["--steps", "400"])
    try:
        read_end, write_end = os.pipe()
        machine = _start(cluster, cluster.command("n0"), stdout=write_end)
        os.close(write_end)
        # stdout is the pipe; the log (stderr) is the terminal.
        cluster.wait_for("4 steps", lambda: len(cluster.steps()) >= 8, 120)

        # The same command again while it runs (row 12): refused at once, nothing touched.
        def files() -> set[Path]:
            return {*Path(cluster.run_dir).rglob("*"), *cluster.shm_root.rglob("*")}

        before = files()
        second = subprocess.run(
            cluster.command("n0"),
            env=cluster_env(),
            cwd=cluster.root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr
        assert "already runs on this machine as node 'n0' (launcher pid " in second.stderr
        assert f"pid {machine.proc.pid}" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr and "agent" not in second.stderr.lower()
        assert before <= files(), before - files()
        steps = len(cluster.steps())
        cluster.wait_for("the first job going on", lambda: len(cluster.steps()) > steps + 4, 60)
        os.close(read_end)  # Ctrl-C killed tee: the pipe has no reader
        os.kill(machine.proc.pid, signal.SIGINT)
        code = cluster.wait_exit("n0", 120)
        out = machine.tail(30000)
        assert code == 130, out
        assert "Traceback" not in out and "BrokenPipe" not in out, out
        assert [e["event"] for e in machine.events()][-1] == "launcher_exit", out
        assert not list(Path(cluster.run_dir).glob("flashckpt-etcd-*")), out
    finally:
        cluster.close()
