"""A launcher ``--storage`` that cannot keep the work is loud (issue 30).

- A root that cannot be written at start (here: a path under a regular file; the tests run as
  root, whom a read-only mode does not stop) fails at once, exit 2, with the error on the
  terminal: no agent crash loop, no workers trained for nothing.
- A root that fails mid-run (replaced by a file): the job trains to its end, but the launcher
  exits 1 saying the newest snapshot is not in storage and is kept in memory; once the storage
  is fixed the same command resumes from that snapshot, writes it, and exits 0.

The storage is the launcher's only (the script passes no ``storage=``), or (issue 41) the
script's only: the same failure, then ``flashckpt clean`` keeps the only copy of the step (exit
1, naming it) unless ``--force``, and the rerun writes the step to storage as the launcher's
``--storage`` does.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from elasticcluster import SimCluster, assert_same_model, cluster_env

from flashckpt.format.storage import Storage

WORKER_ARGS = ["--steps", "30", "--every", "5"]
LAUNCHER_ONLY = ["--storage", ""]  # the worker's storage= (memory); the launcher's --storage stays

pytestmark = [pytest.mark.slow, pytest.mark.etcd]


@pytest.fixture
def make_cluster() -> Iterator[list[SimCluster]]:
    clusters: list[SimCluster] = []
    yield clusters
    for cluster in clusters:
        cluster.close()


def test_a_storage_that_cannot_be_written_fails_at_once_with_its_error(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=WORKER_ARGS)
    make_cluster.append(cluster)
    (tmp_path / "afile").write_text("not a directory")
    bad = f"file://{tmp_path}/afile/ckpt"
    cmd = cluster.command("n0", "--storage", bad, worker_args=LAUNCHER_ONLY)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=cluster_env(), cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert (
        f"flashckpt run: error: --storage {bad} cannot keep checkpoints: writing, reading back "
        f"and deleting {tmp_path}/afile/ckpt/.flashckpt-launcher-probe-"
    ) in proc.stderr, proc.stderr
    assert "Not a directory" in proc.stderr and "Fix the URL" in proc.stderr, proc.stderr
    assert cluster.events() == []  # no worker ever started
    assert "node agent generation" not in proc.stderr, proc.stderr


def test_a_final_persist_that_failed_fails_the_launcher_and_the_rerun_writes_it(
    tmp_path: Path, reference_model: dict[str, torch.Tensor], make_cluster: list[SimCluster]
) -> None:
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=WORKER_ARGS)
    make_cluster.append(cluster)
    machine = cluster.start("n0", worker_args=LAUNCHER_ONLY)
    cluster.wait_for("step 5 committed", lambda: 5 in cluster.committed(), 120)
    # The storage fails: its root is a file from now on.
    moved = tmp_path / "ckpt-away"
    cluster.storage_path.rename(moved)
    cluster.storage_path.write_text("the storage is gone")
    assert cluster.wait_exit("n0", 150) == 1, cluster.logs()
    out = machine.tail(20000)
    assert f"the newest snapshot is not in storage {cluster.storage}" in out, out
    assert "it is kept in this machine's shared memory" in out, out
    assert "exit code 1" in out, out

    # Fixed: the same command resumes from the snapshot kept in memory and writes it.
    cluster.storage_path.unlink()
    moved.rename(cluster.storage_path)
    t_fix = max(e["t"] for e in cluster.events())
    cluster.start("n0", worker_args=LAUNCHER_ONLY)
    assert cluster.wait_exit("n0", 150) == 0, cluster.logs()
    restored = cluster.restored_since(t_fix)
    assert {e["rank"] for e in restored} == {0, 1}, restored
    assert all(e["start_step"] == 30 and e["restored_from"] == "memory" for e in restored), restored
    assert 30 in cluster.committed(), cluster.committed()
    assert_same_model(cluster.out, reference_model)


def test_the_scripts_storage_gets_the_kept_snapshot_when_it_comes_back_and_clean_keeps_it(
    tmp_path: Path, reference_model: dict[str, torch.Tensor], make_cluster: list[SimCluster]
) -> None:
    """Issue 41, row 10: with ``storage=`` in the script (no ``--storage`` on the launcher)
    every rerun restored the step from memory, wrote nothing and exited 1 again, and
    ``flashckpt clean`` deleted the only copy without a word."""
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=WORKER_ARGS)
    cluster.launcher_storage = False
    make_cluster.append(cluster)
    # No restarts: the failed final commit would only restart finished workers (row 5's).
    machine = cluster.start("n0", "--max-restarts", "0")
    cluster.wait_for("step 5 committed", lambda: 5 in cluster.committed(), 120)
    moved = tmp_path / "ckpt-away"
    cluster.storage_path.rename(moved)
    cluster.storage_path.write_text("the storage is gone")
    assert cluster.wait_exit("n0", 150) == 1, cluster.logs()
    out = machine.tail(20000)
    # (How the launcher words the failure is row 5's; the agent's line is this row's.)
    assert "kept its snapshots in" in out and "storage lacks the newest" in out, out

    # clean keeps the only copy of step 30 (exit 1, saying so); --force would delete it.
    shm = cluster.shm_root / "n0"
    kept = sorted(p for p in shm.rglob("*") if p.is_file())
    clean = [sys.executable, "-m", "flashckpt", "clean", "--shm-dir", str(shm)]
    proc = subprocess.run(clean, capture_output=True, text=True, env=cluster_env(), timeout=60)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert f"kept job {cluster.run_id} node n0 in " in proc.stdout, proc.stdout
    assert (
        f"the only copy of step 30, which storage {cluster.storage} lacks. Fix the storage"
    ) in proc.stdout, proc.stdout
    assert "or pass --force to delete them and lose that step" in proc.stdout, proc.stdout
    proc = subprocess.run(
        [*clean, "--force", "--dry-run"], capture_output=True, text=True, env=cluster_env()
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "the only copy of step 30, which storage" in proc.stdout, proc.stdout
    assert "lacks, deleted (--force)" in proc.stdout, proc.stdout
    assert sorted(p for p in shm.rglob("*") if p.is_file()) == kept  # nothing deleted

    # Fixed: the same command resumes from memory and writes the step to storage.
    cluster.storage_path.unlink()
    moved.rename(cluster.storage_path)
    t_fix = max(e["t"] for e in cluster.events())
    cluster.start("n0", "--max-restarts", "0")
    assert cluster.wait_exit("n0", 150) == 0, cluster.logs()
    restored = cluster.restored_since(t_fix)
    assert {e["rank"] for e in restored} == {0, 1}, restored
    assert all(e["start_step"] == 30 and e["restored_from"] == "memory" for e in restored), restored
    assert 30 in cluster.committed(), cluster.committed()
    assert Storage(cluster.storage).check_step(30).status == "ok"
    assert_same_model(cluster.out, reference_model)
