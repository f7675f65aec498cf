"""``flashckpt run`` with a machine lost and no standby (``--nnodes 1:2``): the job goes on
smaller and reshards the lost machine's pieces from the replica its snapshot left in the
survivor's memory (issue 11: "resharding to a new world size may use replica pieces too"), on
machines that really are separate (namespaces, see ``tests/support/nscluster.py``), memory only.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_launcher_replica import _REASON, WORKER_ARGS, _holds_newest, _MemoryOnly, net

from flashckpt.testing import netns

__all__ = ["net"]  # the fixture, imported for the test here


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.timeout(420)
def test_the_survivor_goes_on_alone_resharding_from_its_memory_and_the_lost_machines_replica(
    tmp_path: Path, net: tuple[netns.Cluster, str]
) -> None:
    """FSDP2 on 2 namespaced machines, no standby, memory only: the machine of rank 1 is killed
    (its memory gone); the survivor restarts its workers as a world of 1 and resumes at a step
    of the run before (not 0) from its own snapshot and the victim's replica
    (``peer-reshard``); its restart line says so; the job runs to its end."""
    ns, etcd_url = net
    cluster = _MemoryOnly(
        tmp_path / "job", ns, etcd_url, nnodes="1:2",
        # Paced while both machines train (the kill needs a replica in place first); the
        # survivor alone has nothing to wait for.
        worker_args=[*WORKER_ARGS, "--step-sleep", "0.3", "--sleep-world-size", "2"],
    )  # fmt: skip
    try:
        cluster.start("n0")
        cluster.start("n1")
        cluster.wait_for(
            "both machines to train",
            lambda: (
                any(e["event"] == "restored" and e["world_size"] == 2 for e in cluster.events())
                and len(cluster.steps()) >= 2
            ),
            150,
        )
        survivor = cluster.rank0_node()
        victim = "n1" if survivor == "n0" else "n0"
        cluster.wait_for(
            "the survivor to hold the victim's newest snapshot",
            lambda: _holds_newest(cluster, survivor, victim) and max(cluster.steps()) >= 6,
            120,
        )
        assert max(cluster.steps()) < 36 - 12, "training ran out before the kill"
        killed_at = time.time()
        assert cluster.machines[victim].kill(), "the machine had no processes"

        assert cluster.wait_exit(survivor, 300) == 0, cluster.logs()
        resumed = cluster.restored_since(killed_at)
        assert [(e["node"], e["world_size"]) for e in resumed] == [(survivor, 1)], resumed
        assert resumed[0]["restored_from"] == "peer-reshard", (resumed, cluster.logs())
        step = resumed[0]["start_step"]
        assert step >= 6, resumed  # the run before's work, not a fresh start
        out = cluster.machines[survivor].tail(200_000)
        assert f"rank 0 restored step {step} from peer-reshard" in out, out[-4000:]
        assert "another machine's replica" in out, out[-4000:]
        assert max(cluster.steps()) == 35, "the job did not run to its end"
    finally:
        cluster.close()
