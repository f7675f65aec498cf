"""``flashckpt run`` on machines that really are separate (namespaces, see
``tests/support/nscluster.py``).

Each machine has its own network, hostname and ``/dev/shm``: a standby can only get the killed
machine's state over the network (a survivor's memory) or from storage, never from a segment
left on a shared ``/dev/shm`` by accident, and the killed machine's memory is really gone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from elasticcluster import assert_same_model
from nscluster import NsSimCluster

from flashckpt.elastic.etcd.server import find_etcd_binary
from flashckpt.testing import netns

STEPS = 40
EVERY = 5
WORKER_ARGS = ["--steps", str(STEPS), "--every", str(EVERY)]

_REASON = netns.unavailable()
pytestmark = [
    pytest.mark.etcd,
    pytest.mark.slow,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]


@pytest.fixture
def net(tmp_path: Path) -> Iterator[tuple[netns.Cluster, str]]:
    cluster = netns.Cluster(shm_size="1g")
    try:
        url = cluster.start_etcd(str(tmp_path / "etcd"), binary=find_etcd_binary())
        yield cluster, url
    finally:
        cluster.close()


@pytest.mark.timeout(300)
def test_standby_replaces_a_killed_machine_across_namespaces(
    tmp_path: Path, net: tuple[netns.Cluster, str], reference_model: dict[str, torch.Tensor]
) -> None:
    ns, etcd_url = net
    cluster = NsSimCluster(
        tmp_path / "job", ns, etcd_url, nnodes="2:2",
        worker_args=[*WORKER_ARGS, "--step-sleep", "0.4"],
    )  # fmt: skip
    try:
        cluster.start("n0")
        cluster.start("n1")
        cluster.wait_for("training to start", lambda: len(cluster.steps()) >= 2, 150)
        standby = cluster.start("n2")
        cluster.wait_for(
            "the standby to join the rendezvous",
            lambda: any(e["event"] == "rendezvous_start" for e in standby.events()),
            90,
        )
        cluster.wait_for("a committed step", lambda: bool(cluster.committed()), 90)
        assert max(cluster.steps()) < STEPS - 10, "training ran out before the kill"
        rank0_node = cluster.rank0_node()
        survivor = "n1" if rank0_node == "n0" else "n0"
        killed_at = time.time()
        victim = ns.machines[rank0_node]
        assert cluster.machines[rank0_node].kill(), "the machine had no processes"
        assert victim.pids() == [] and not victim.up

        for node in (survivor, "n2"):
            assert cluster.wait_exit(node, 180) == 0, cluster.logs()
        assert_same_model(cluster.out, reference_model)

        resumed = cluster.restored_since(killed_at)
        assert {e["node"] for e in resumed} == {survivor, "n2"}, resumed
        assert len({e["start_step"] for e in resumed}) == 1, resumed
        by_node = {e["node"]: e["restored_from"] for e in resumed}
        # The survivor from its own memory; the standby from the survivor's memory, over the
        # private network (its own /dev/shm never held the job's segments).
        assert by_node == {survivor: "memory", "n2": "replica"}, resumed
        assert max(cluster.committed()) == STEPS
        # The killed machine's memory is gone: booted again, its /dev/shm is empty.
        victim.boot()
        left = victim.run(["ls", "-A", "/dev/shm"], capture_output=True, text=True).stdout
        assert left.strip() == ""
    finally:
        cluster.close()
