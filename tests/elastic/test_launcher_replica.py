"""``flashckpt run`` wires replication between the machines' node agents (issue 11), on machines
that really are separate (namespaces, see ``_nscluster.py``): nobody passes replica flags.

Each launcher starts its agent's replica server on the machine's cluster address (port 0: the
OS picks; the launcher reads it back and publishes it in the machine's etcd record) and, at
every rendezvous round, gives its agent the replica servers of the round's other machines. So
with two machines training, each machine's memory (its own ``/dev/shm``) ends up holding the
other's newest snapshot; after a standby replaces a killed machine, the survivor's peers name
the standby and replicas flow both ways between them, and the dead machine's replica is dropped
once the new world snapshotted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _nscluster import NsSimCluster

from elastic import netns
from elastic.etcd_server import find_etcd_binary
from flashckpt import names
from flashckpt.errors import AgentError
from flashckpt.protocol import AgentClient

STEPS = 90
EVERY = 3

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


def _status(cluster: NsSimCluster, node: str) -> dict[str, Any] | None:
    """The status reply of ``node``'s node agent (its socket is in the machine's run dir, on
    the shared file system); None while it does not answer."""
    run_dir = names.generation_run_dir(f"{cluster.run_dir}/{node}", cluster.run_id, node, 1)
    try:
        client = AgentClient(names.socket_path(run_dir, cluster.run_id, node), timeout=2.0)
    except AgentError:
        return None
    try:
        return client.request("status", timeout=20)
    except AgentError:
        return None
    finally:
        client.close()


def _replication(cluster: NsSimCluster, node: str) -> dict[str, Any]:
    st = _status(cluster, node)
    rep = st.get("replication") if st else None
    return rep if isinstance(rep, dict) else {}


def _newest_step(st: dict[str, Any]) -> int | None:
    steps = [s for r in st["ranks"].values() for s in r["slots"] if s is not None]
    return max(steps) if steps else None


def _holds_newest(cluster: NsSimCluster, holder: str, sender: str) -> bool:
    """Whether ``holder``'s agent holds ``sender``'s newest complete snapshot (every rank)."""
    held, own = _status(cluster, holder), _status(cluster, sender)
    if not held or not own or not held.get("replication"):
        return False
    newest = _newest_step(own)
    got = {h["rank"]: h["step"] for h in held["replication"]["held"] if h["sender"] == sender}
    ranks = {r["rank"] for r in own["ranks"].values() if r["world_id"] == own["world_id"]}
    return newest is not None and bool(ranks) and all(got.get(r) == newest for r in ranks)


def _replica_files(cluster: NsSimCluster, node: str) -> list[str]:
    """The replica files in ``node``'s own ``/dev/shm`` (listed inside the machine)."""
    shm = names.generation_shm_dir(f"/dev/shm/{cluster.run_id}", cluster.run_id, node, 1)
    out = cluster.net.machines[node].run(["ls", "-A", shm], capture_output=True, text=True)
    prefix = names.slot_prefix(cluster.run_id, node) + "rep."
    return sorted(n for n in out.stdout.split() if n.startswith(prefix))


@pytest.mark.timeout(420)
def test_launchers_replicate_to_the_ring_and_follow_a_standby_replacing_a_machine(
    tmp_path: Path, net: tuple[netns.Cluster, str]
) -> None:
    ns, etcd_url = net
    cluster = NsSimCluster(
        tmp_path / "job", ns, etcd_url, nnodes="2:2",
        worker_args=["--steps", str(STEPS), "--every", str(EVERY), "--step-sleep", "0.25"],
    )  # fmt: skip
    try:
        cluster.start("n0")
        cluster.start("n1")
        cluster.wait_for("training to start", lambda: len(cluster.steps()) >= 2, 150)
        addr = {n: ns.machines[n].addr for n in ("n0", "n1")}

        # Each agent's replica server is on its machine's own address, and each knows the
        # other as its peer (the launcher's list: nobody passed a flag).
        def peers_are(node: str, want: dict[str, str]) -> bool:
            rep = _replication(cluster, node)
            got = rep.get("peers")
            return got is not None and {n: a.rsplit(":", 1)[0] for n, a in got.items()} == want

        cluster.wait_for("n0's peers", lambda: peers_are("n0", {"n1": addr["n1"]}), 60)
        cluster.wait_for("n1's peers", lambda: peers_are("n1", {"n0": addr["n0"]}), 60)
        for node in ("n0", "n1"):
            rep = _replication(cluster, node)
            assert rep["listen"].rsplit(":", 1)[0] == addr[node], rep
            assert rep["targets"] == ["n1" if node == "n0" else "n0"], rep

        # Each machine's memory holds the other's newest snapshot.
        cluster.wait_for("n0 to hold n1's newest", lambda: _holds_newest(cluster, "n0", "n1"), 90)
        cluster.wait_for("n1 to hold n0's newest", lambda: _holds_newest(cluster, "n1", "n0"), 90)
        assert _replica_files(cluster, "n0") == [
            os.path.basename(names.replica_path("/", cluster.run_id, "n0", "n1", r))
            for r in sorted(h["rank"] for h in _replication(cluster, "n0")["held"])
        ]
        assert _replica_files(cluster, "n1"), "n1's /dev/shm holds no replica"

        standby = cluster.start("n2")
        cluster.wait_for(
            "the standby to join the rendezvous",
            lambda: any(e["event"] == "rendezvous_start" for e in standby.events()),
            90,
        )
        assert max(cluster.steps()) < STEPS - 30, "training ran out before the kill"
        victim, survivor = "n1", "n0"
        killed_at = time.time()
        assert cluster.machines[victim].kill(), "the machine had no processes"
        addr["n2"] = ns.machines["n2"].addr

        # The next round: the survivor's peers name the standby, the standby's the survivor.
        cluster.wait_for(
            "the survivor's peers to name the standby",
            lambda: peers_are(survivor, {"n2": addr["n2"]}),
            120,
        )
        cluster.wait_for(
            "the standby's peers", lambda: peers_are("n2", {survivor: addr[survivor]}), 60
        )
        cluster.wait_for("training to resume", lambda: bool(cluster.restored_since(killed_at)), 120)
        # Replicas flow both ways between the survivor and the new machine ...
        cluster.wait_for(
            "the standby to hold the survivor's newest",
            lambda: _holds_newest(cluster, "n2", survivor),
            120,
        )
        cluster.wait_for(
            "the survivor to hold the standby's newest",
            lambda: _holds_newest(cluster, survivor, "n2"),
            120,
        )
        # ... and the killed machine's replica is dropped (the new world snapshotted).
        cluster.wait_for(
            "the survivor to drop the killed machine's replica",
            lambda: {h["sender"] for h in _replication(cluster, survivor)["held"]} == {"n2"},
            60,
        )
        assert all(".rep.n2." in n for n in _replica_files(cluster, survivor)), _replica_files(
            cluster, survivor
        )
        sent = _replication(cluster, survivor)["sent"]
        assert {s["target"] for s in sent} == {"n2"}, sent

        for node in (survivor, "n2"):
            assert cluster.wait_exit(node, 240) == 0, cluster.logs()
        events = [e for e in cluster.machines[survivor].events() if e["event"] == "replica_peers"]
        assert [sorted(e["peers"]) for e in events][-2:] == [["n1"], ["n2"]], events
    finally:
        cluster.close()
