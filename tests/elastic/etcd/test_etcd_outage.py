"""An etcd outage is not a job failure (issue 31): a 3-member etcd cluster started by the test
loses its quorum (2 members down) for longer than the machines' lease TTL while a job trains
with a standby waiting; training goes on, nobody is fenced, and once the job succeeds every
launcher exits 0, the idle standby's included.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from elasticcluster import SimCluster

from flashckpt.testing.etcd_cluster import EtcdCluster

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

OUTAGE_S = 20.0


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd", size=3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def make_cluster() -> Iterator[list[SimCluster]]:
    clusters: list[SimCluster] = []
    yield clusters
    for cluster in clusters:
        cluster.close()


@pytest.mark.timeout(420)
def test_after_a_quorum_loss_the_idle_standby_of_a_successful_job_exits_0(
    etcd_cluster: EtcdCluster, tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    cluster = SimCluster(
        tmp_path,
        etcd_cluster.endpoints,
        nnodes="2:2",
        worker_args=["--steps", "300", "--every", "5", "--step-sleep", "0.1"],
        launcher_args=["--lease-ttl", "5"],
    )
    make_cluster.append(cluster)
    cluster.start("n0")
    cluster.start("n1")
    cluster.wait_for("training", lambda: len(cluster.steps()) >= 2 * 5, 120)
    standby = cluster.start("n2")
    cluster.wait_for(
        "the standby to wait in the rendezvous",
        lambda: any(e["event"] == "rendezvous_start" for e in standby.events()),
        60,
    )
    etcd_cluster.kill(1, 2)  # no quorum: nothing is read or written
    lost_at = time.monotonic()
    steps_then = len(cluster.steps())
    cluster.wait_for(
        "the outage to outlast the lease TTL, training on",
        lambda: time.monotonic() - lost_at >= OUTAGE_S,
        OUTAGE_S + 30,
    )
    assert len(cluster.steps()) > steps_then, "training stopped during the etcd outage"
    etcd_cluster.revive(1, 2)
    codes = {node: cluster.wait_exit(node, 240) for node in ("n0", "n1", "n2")}
    assert codes == {"n0": 0, "n1": 0, "n2": 0}, cluster.logs()
    events = {node: cluster.machines[node].events() for node in ("n0", "n1", "n2")}
    assert not [e for ev in events.values() for e in ev if e["event"] == "fenced"], events
    assert [e for e in events["n2"] if e["event"] == "standby_released"], events["n2"]
