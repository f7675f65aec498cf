"""The launcher's ``--storage`` belongs to its job (issue 30), checked as the trainer checks its
own ``storage=``: a root whose committed steps, or (nothing committed yet) whose owner file,
name another job fails at once, exit 2, with the error on the terminal and no worker started,
unless ``--takeover``. The script passes no ``storage=``: the root is the launcher's only."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from elasticcluster import SimCluster, cluster_env
from fchelpers import FcEnv
from tinytrain import make, train_step

import flashckpt
from flashckpt.elastic.launch.storage_check import check_storage
from flashckpt.format.storage import Storage
from flashckpt.format.storage_owner import OWNER_FILE, write_owner

WORKER_ARGS = ["--steps", "4", "--every", "2"]
LAUNCHER_ONLY = ["--storage", ""]  # the worker's storage= (memory); the launcher's --storage stays


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SimCluster]:
    c = SimCluster(tmp_path, None, nnodes="1", nproc=1, worker_args=WORKER_ARGS)
    yield c
    c.close()


def _launch(cluster: SimCluster, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = cluster.command("n0", *extra, worker_args=LAUNCHER_ONLY)
    return subprocess.run(
        cmd, capture_output=True, text=True, env=cluster_env(), cwd=tmp_path, timeout=120
    )


def test_a_launcher_storage_of_another_live_job_fails_at_once(
    tmp_path: Path, cluster: SimCluster
) -> None:
    cluster.storage_path.mkdir(parents=True)
    write_owner(Storage(cluster.storage), "jobA")  # job A runs there, nothing committed yet
    proc = _launch(cluster, tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = proc.stderr
    assert (
        f"flashckpt run: error: --storage {cluster.storage} is in use by job 'jobA': its owner "
        f"file {cluster.storage_path}/{OWNER_FILE} names it"
    ) in err, err
    assert f"this is job {cluster.run_id!r}" in err and "nothing committed yet" in err, err
    assert "--rdzv-id jobA" in err and "pass --takeover" in err, err
    assert cluster.events() == []  # no worker ever started
    owner = json.loads((cluster.storage_path / OWNER_FILE).read_text())
    assert owner["job"] == "jobA"  # untouched


def test_a_launcher_storage_with_another_jobs_steps_fails_unless_taken_over(
    tmp_path: Path, cluster: SimCluster, fc_env: FcEnv
) -> None:
    assert fc_env.storage == cluster.storage  # both under tmp_path/ckpt
    model, opt, sched = make(0)
    with flashckpt.checkpointing(model, opt, scheduler=sched, **fc_env.ckpt_kwargs()) as ck:
        train_step(model, opt, sched, 0)
        ck.step()
    assert ck.stats.last_committed_step == 1  # job fc_env.job committed step 1
    proc = _launch(cluster, tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert (
        f"flashckpt run: error: --storage {cluster.storage} holds committed steps of job "
        f"{fc_env.job!r} (newest: step 1)"
    ) in proc.stderr, proc.stderr
    assert cluster.events() == []
    # The check itself: the job's own root passes, another's passes with takeover and is
    # recorded as the taker's.
    assert check_storage(cluster.storage, fc_env.job) is None
    problem = check_storage(cluster.storage, cluster.run_id)
    assert problem is not None and "pass --takeover" in problem, problem
    assert check_storage(cluster.storage, cluster.run_id, takeover=True) is None
    owner = json.loads((cluster.storage_path / OWNER_FILE).read_text())
    assert owner["job"] == cluster.run_id
