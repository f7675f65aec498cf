"""SIGSTOP of the machine that does not hold rank 0 (its launcher, node agent and workers, a
frozen VM), held until the job finished without it, then SIGCONT (issue 41, row 3): the job goes
on without it; the woken machine finds itself fenced, says so in one line, exits 0 and leaves no
file in its shared-memory directory (its snapshots are of a world the job went past: storage
holds newer committed steps)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from elasticcluster import SimCluster

from flashckpt.testing.elastic import process_tree

pytestmark = [pytest.mark.slow, pytest.mark.etcd]


@pytest.mark.timeout(300)
def test_a_frozen_machine_woken_after_the_job_finished_exits_0_fenced_and_leaves_no_file(
    tmp_path: Path, etcd_server: str
) -> None:
    cluster = SimCluster(
        tmp_path,
        etcd_server,
        nnodes="1:2",
        launcher_args=["--lease-ttl", "3", "--rdzv-conf", "last_call_timeout=1"],
        worker_args=["--steps", "36", "--every", "4", "--step-sleep", "0.15"],
    )
    try:
        cluster.start("n0")
        cluster.start("n1")
        cluster.wait_for(
            "both machines training",
            lambda: {e["node"] for e in cluster.events() if e["event"] == "step"} == {"n0", "n1"},
            150,
        )
        cluster.wait_for("a committed step", lambda: bool(cluster.committed()), 90)
        victim_id = "n1" if cluster.rank0_node() == "n0" else "n0"
        survivor_id = "n0" if victim_id == "n1" else "n1"
        victim = cluster.machines[victim_id]
        frozen = process_tree(victim.proc.pid)
        for p in frozen:
            p.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        try:
            assert cluster.wait_exit(survivor_id, 240) == 0, cluster.logs()
        finally:
            for p in frozen:
                p.send_signal(signal.SIGCONT)
        assert max(cluster.steps()) == 35, cluster.logs()
        assert [e for e in cluster.restored_since(stopped_at) if e["node"] == survivor_id]
        code = cluster.wait_exit(victim_id, 120)
        out = victim.tail(30000)
        assert code == 0, cluster.logs()
        assert out.count("this machine was fenced") == 1, out
        assert "Fix the storage" not in out and "kept" not in out, out
        assert not [p for p in (cluster.shm_root / victim_id).rglob("*")], out
        # Nothing of the woken machine's trained on.
        assert not [
            e
            for e in cluster.events()
            if e["node"] == victim_id and e["event"] == "restored" and e["t"] > stopped_at
        ]
    finally:
        cluster.close()
