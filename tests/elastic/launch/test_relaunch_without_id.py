"""A relaunch of the same ``flashckpt run`` command without ``--rdzv-id`` finds its job (issue 30).

Each launch used to draw a random job id, so the same command run again after a ``kill -9``
could not see the snapshot its node agent left in memory, and ``flashckpt clean`` could not see
that agent's segment directory either. Both runs here go without ``--rdzv-id`` and without
storage (docs/elastic.md's example): memory is the only copy.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from elasticcluster import Machine, SimCluster, assert_same_model, cluster_env

from flashckpt.testing.elastic import kill_processes, process_tree

WORKER_ARGS = ["--steps", "40", "--every", "5"]

pytestmark = [pytest.mark.slow, pytest.mark.etcd]


@pytest.fixture
def make_cluster() -> Iterator[list[SimCluster]]:
    clusters: list[SimCluster] = []
    yield clusters
    for cluster in clusters:
        cluster.close()


def _without(cmd: list[str], *flags: str) -> list[str]:
    """``cmd`` without each of ``flags`` and its value."""
    out: list[str] = []
    skip = False
    for arg in cmd:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    return out


def _start(cluster: SimCluster, node: str) -> Machine:
    """The cluster's launcher command with no --rdzv-id and no storage, started as is."""
    cmd = _without(cluster.command(node), "--rdzv-id", "--storage")
    cmd += ["--storage", ""]  # the worker's: memory only
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


def _job_ids(log: Path) -> list[str]:
    return re.findall(r"job id: (\S+) \(derived from ", log.read_text(errors="replace"))


def _clean(shm_dir: Path, *extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "flashckpt", "clean", "--shm-dir", str(shm_dir), *extra],
        capture_output=True,
        text=True,
        env=cluster_env(),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _kill_after(cluster: SimCluster, machine: Machine, steps_done: int) -> int:
    """SIGKILLs the whole machine (launcher, etcd, node agent, workers) once every rank has
    finished ``steps_done`` steps; returns the steps every rank had finished by then."""
    done = lambda: [  # noqa: E731
        max(
            (e["step"] + 1 for e in cluster.events() if e["event"] == "step" and e["rank"] == r),
            default=0,
        )
        for r in (0, 1)
    ]
    cluster.wait_for(f"{steps_done} steps", lambda: min(done()) >= steps_done, 120)
    victims = process_tree(machine.proc.pid)
    kill_processes(victims)
    machine.proc.wait(timeout=30)
    # Gone, not just signalled: a dying agent still counts as the owner of its segments.
    _, alive = psutil.wait_procs(victims, timeout=30)
    assert not alive, alive
    return min(done())


def test_a_relaunch_without_an_id_resumes_from_memory(
    tmp_path: Path, reference_model: dict[str, torch.Tensor], make_cluster: list[SimCluster]
) -> None:
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=WORKER_ARGS)
    make_cluster.append(cluster)
    first = _start(cluster, "n0")
    done = _kill_after(cluster, first, 12)
    (job,) = _job_ids(first.log)
    # The killed agent's segments are an orphan `flashckpt clean` sees, whatever the job id.
    listed = _clean(cluster.shm_root / "n0", "--dry-run")
    assert f"would remove job {job} node n0 in " in listed, listed
    assert f"flashckpt.{job}.n0.g1" in listed, listed

    t_kill = max(e["t"] for e in cluster.events())
    second = _start(cluster, "n0")
    assert cluster.wait_exit("n0", 150) == 0, cluster.logs()
    assert _job_ids(second.log) == [job, job], second.tail()  # both launches: the same id
    restored = cluster.restored_since(t_kill)
    assert {e["rank"] for e in restored} == {0, 1}, restored
    newest = done // 5 * 5  # the newest snapshot every rank had taken (every=5) at the kill
    for e in restored:
        assert e["restored_from"] == "memory", restored
        assert e["start_step"] >= newest, (restored, done)
    assert_same_model(cluster.out, reference_model)


def test_clean_removes_the_segment_directory_of_a_killed_launchers_agent(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=WORKER_ARGS)
    make_cluster.append(cluster)
    machine = _start(cluster, "n0")
    _kill_after(cluster, machine, 6)
    (job,) = _job_ids(machine.log)
    shm = cluster.shm_root / "n0"
    gen = shm / f"flashckpt.{job}.n0.g1"
    assert any(gen.iterdir())  # the snapshots the killed agent left
    out = _clean(shm)
    assert f"removed job {job} node n0 in {gen}" in out, out
    assert f"removed directory {gen}" in out, out
    assert not gen.exists() and list(shm.iterdir()) == []
    assert "nothing to clean" in _clean(shm)
