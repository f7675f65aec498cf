"""A job keeps etcd healthy by construction (issue 31): the keys of finished rounds and of the
finished job are removed, so a job's keys stay bounded whatever its number of restarts; the
etcd that flashckpt starts compacts its history and has a space quota.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from elasticcluster import SimCluster
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from flashckpt.elastic.etcd.client import EtcdClient
from flashckpt.elastic.etcd.server import EtcdV3Server, etcd_command
from flashckpt.elastic.etcd.store import EtcdV3Store
from flashckpt.elastic.membership.jobkeys import remove_finished_job_keys
from flashckpt.elastic.membership.nodes import NodeRegistry
from flashckpt.elastic.rendezvous.backend import job_prefix

pytestmark = pytest.mark.etcd

RESTARTS = 3


@pytest.fixture
def make_cluster() -> Iterator[list[SimCluster]]:
    clusters: list[SimCluster] = []
    yield clusters
    for cluster in clusters:
        cluster.close()


def _keys(client: EtcdClient, prefix: str) -> list[str]:
    return sorted(kv.key.decode() for kv in client.get_prefix(prefix))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_through_several_restart_rounds_leaves_a_bounded_number_of_keys(
    etcd_server: str, tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=10))
    cluster = SimCluster(
        tmp_path,
        etcd_server,
        nnodes="1:1",
        worker_args=["--steps", "400", "--step-sleep", "0.05", "--every", "5"],
        launcher_args=["--max-restarts", str(RESTARTS + 1)],
    )
    make_cluster.append(cluster)
    prefix = job_prefix(cluster.run_id)
    cluster.start("solo")
    seen_rounds: list[int] = []
    for restart in range(RESTARTS + 1):
        # The worker of round `restart` runs (a start event of that restart, then a few steps).
        cluster.wait_for(
            f"steps of restart {restart}",
            lambda r=restart: any(
                e["event"] == "step" and e["restart"] == r for e in cluster.events()
            ),
            120,
        )
        seen_rounds.append(len(_keys(client, prefix + "store/")))
        if restart < RESTARTS:
            worker = next(
                e["pid"]
                for e in cluster.events()
                if e["event"] == "start" and e["restart"] == restart
            )
            os.kill(worker, signal.SIGKILL)
    # While the job runs, its rendezvous store's keys do not grow with its rounds.
    assert max(seen_rounds) == seen_rounds[1], seen_rounds
    assert cluster.wait_exit("solo", 240) == 0, cluster.logs()
    left = _keys(client, prefix)
    print(f"keys while running, per round: {seen_rounds}; after the job: {left}")
    assert len(left) <= 2, left


def _store_rounds(client: EtcdClient, prefix: str) -> list[int]:
    """The rounds of the keys ``<prefix>...<name>.<round>/...``."""
    names = {key[len(prefix) :].split("/")[0] for key in _keys(client, prefix)}
    rounds = {name.rsplit(".", 1)[1] for name in names}
    return sorted(int(r) for r in rounds)


def test_a_new_round_removes_the_store_keys_of_the_rounds_before_the_previous(
    etcd_client: EtcdClient, etcd_prefix: str
) -> None:
    store = EtcdV3Store(etcd_client, etcd_prefix + "store/")
    other = EtcdV3Store(etcd_client, etcd_prefix + "store/")  # another machine's store
    # Rounds as torch's handler names them, with a gap (round 3 never formed), past 9 -> 10
    # (the order of keys is not the order of rounds), and a key that is not a round's.
    etcd_client.put(etcd_prefix + "storf", b"a neighbour's key, not the store's")
    store.set("not-a-round/x", b"1")
    for number in (0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11):
        rnd = dist.PrefixStore(f"torch.rendezvous.job.{number}", store)
        # What torch's agents write: every machine its role, then group rank 0 the address.
        dist.PrefixStore(f"torch.rendezvous.job.{number}", other).set(
            "torchelastic/role_info/1", b"r1"
        )
        rnd.set("torchelastic/role_info/0", b"r0")
        RendezvousStoreInfo.build(rank=0, store=rnd, local_addr="127.0.0.1")
        rnd.set("torchelastic/assigned_ranks/0", b"a0")
        previous = {0: [0], 1: [0, 1], 2: [1, 2], 4: [2, 4]}.get(number)
        assert _store_rounds(etcd_client, etcd_prefix + "store/torch.") == (
            previous or [number - 1, number]
        ), number
    assert etcd_client.get(etcd_prefix + "store/not-a-round/x") is not None
    # 5 keys a round (two roles, the address, the port, one machine's ranks), two rounds,
    # however many rounds there were.
    assert len(_keys(etcd_client, etcd_prefix + "store/torch.")) == 2 * 5


def test_a_finished_job_leaves_only_its_closed_rendezvous_and_health_verdicts(
    etcd_client: EtcdClient, etcd_prefix: str, registries: Callable[..., NodeRegistry]
) -> None:
    for key in ("rdzv/state", "unhealthy/n9", "store/torch.rendezvous.j.3/MASTER_ADDR", "ranks/1"):
        etcd_client.put(etcd_prefix + key, b"x")
    last = registries(etcd_prefix, "n0")
    assert remove_finished_job_keys(etcd_client, etcd_prefix) is None, "a machine is still there"
    assert len(_keys(etcd_client, etcd_prefix)) == 5
    last.close()
    assert remove_finished_job_keys(etcd_client, etcd_prefix) == 2
    left = _keys(etcd_client, etcd_prefix)
    assert left == [etcd_prefix + "rdzv/state", etcd_prefix + "unhealthy/n9"]


def test_the_machine_with_the_lowest_node_id_compacts_the_jobs_history(
    etcd_instance: EtcdV3Server, etcd_prefix: str
) -> None:
    client = EtcdClient(etcd_instance.client_url, timeout=timedelta(seconds=5))
    start = client.revision()
    regs = []
    try:
        for node in ("n1", "n0", "n2"):
            reg = NodeRegistry(
                client,
                etcd_prefix,
                node,
                ttl=timedelta(seconds=10),
                advertise_host="127.0.0.1",
                bind_host="127.0.0.1",
                links=0,
                compact_every=timedelta(seconds=0.5),
            )
            reg.start(timedelta(seconds=10))
            regs.append(reg)
        chosen = regs[1]
        deadline = time.monotonic() + 60
        while chosen.compactions < 2 and time.monotonic() < deadline:
            client.put(etcd_prefix + "work", b"history to compact")  # the job's writes
            time.sleep(0.05)
        assert chosen.compactions >= 2
        assert [r.compactions for r in regs if r is not chosen] == [0, 0]
        # The history the job wrote before is gone: a watch from then is told so.
        gone = client.watch_events(
            etcd_prefix, after_revision=start, timeout=timedelta(seconds=5), prefix=True
        )
        assert gone.compacted > start
    finally:
        for reg in regs:
            reg.close()


def test_the_etcd_flashckpt_starts_compacts_its_history_and_has_a_quota() -> None:
    argv = etcd_command(
        "etcd", name="n", data_dir="/d", client_url="http://h:1", peer_url="http://h:2"
    )
    assert "--auto-compaction-mode=periodic" in argv
    assert "--auto-compaction-retention=10m" in argv
    assert f"--quota-backend-bytes={2 * 1024**3}" in argv
