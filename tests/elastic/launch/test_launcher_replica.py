"""``flashckpt run`` wires replication between the machines' node agents (issue 11), on machines
that really are separate (namespaces, see ``tests/support/nscluster.py``): nobody passes
replica flags.

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
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from nscluster import NsSimCluster

from flashckpt import names
from flashckpt.elastic.etcd.client import KeyValue
from flashckpt.elastic.etcd.server import find_etcd_binary
from flashckpt.elastic.launch.agent_runner import (
    NodeAgentConfig,
    NodeAgentProcess,
    world_replica_peers,
)
from flashckpt.elastic.launch.launcher import parse_args
from flashckpt.elastic.membership.nodes import NodeRecord
from flashckpt.errors import AgentError
from flashckpt.protocol.channel import AgentClient
from flashckpt.testing import netns

STEPS = 90
EVERY = 3

_REASON = netns.unavailable()


def _record(node: str, rdzv: str | None, replica: str, state: str = "active") -> NodeRecord:
    return NodeRecord(
        node_id=node, host=node, pid=1, token=node, probe="", state=state, rdzv_node=rdzv,
        replica=replica,
    )  # fmt: skip


def _kv(value: bytes) -> KeyValue:
    return KeyValue(key=b"k", value=value, mod_revision=1, create_revision=1, version=1, lease=0)


def test_world_replica_peers_are_the_rounds_other_machines() -> None:
    records = [
        _record("n0", "h0_1_0", "10.0.0.1:7000"),  # this machine
        _record("n1", "h1_1_0", "10.0.0.2:7001"),
        _record("n2", "h2_1_0", "10.0.0.3:7002", state="waiting"),  # a standby: not in it
        _record("n3", "h3_1_0", ""),  # replication off there
        _record("n4", None, "10.0.0.5:7004"),  # not in the rendezvous yet
    ]
    world = {"h0_1_0", "h1_1_0", "h3_1_0"}
    assert world_replica_peers(world, records, "n0") == {"n1": "10.0.0.2:7001"}
    assert world_replica_peers(world, records, "n1") == {"n0": "10.0.0.1:7000"}
    assert world_replica_peers(set(), records, "n0") == {}
    # A record from before this field existed (an older launcher) parses, with no address.
    old = _record("n5", "x", "").to_json().replace(b',"replica":""', b"")
    assert b"replica" not in old
    raw = NodeRecord.from_kv(_kv(old))
    assert raw is not None and raw.replica == ""
    assert NodeRecord.from_kv(_kv(records[1].to_json())) == records[1]


def test_replicas_flag() -> None:
    base = ["--nnodes", "2", "--rdzv-endpoint", "h:2379", "--rdzv-id", "j", "train.py"]
    assert parse_args(base)[0].replicas == 1
    assert parse_args(["--replicas", "0", *base])[0].replicas == 0
    with pytest.raises(SystemExit):
        parse_args(["--replicas", "-1", *base])
    with pytest.raises(ValueError, match="replicas"):
        NodeAgentConfig(job="j", node="n", storage=None, shm_dir="/x", run_dir="/y", replicas=-1)


@pytest.mark.timeout(300)
def test_agent_started_again_keeps_its_replica_port_and_gets_the_peers_again(
    tmp_path: Path,
) -> None:
    """The launcher's agent supervisor: the replica address is read back and published once; the
    peer list never names this machine; an agent that crashed is started again on the same
    port and given the newest peer list again."""
    shm = Path("/dev/shm") / f"fc-wire-{uuid.uuid4().hex[:8]}"
    published: list[str] = []
    proc = NodeAgentProcess(
        NodeAgentConfig(
            job="jw", node="me", storage=None, shm_dir=str(shm), run_dir=str(tmp_path / "run"),
            replicas=1, replica_bind="127.0.0.1", stop_timeout_s=30,
        )
    )  # fmt: skip
    proc.on_replica_address = published.append
    try:
        proc.start()
        gen = proc.wait_ready(timedelta(seconds=120))
        address = proc.replica_address
        assert address is not None and address.startswith("127.0.0.1:"), address
        assert published == [address]

        def status() -> dict[str, Any]:
            client = AgentClient(gen.socket_path, timeout=5.0)
            try:
                return client.request("status", timeout=30)["replication"]
            finally:
                client.close()

        assert status()["listen"] == address
        proc.set_replica_peers({"me": "127.0.0.1:1", "other": "127.0.0.1:2"})
        assert status()["peers"] == {"other": "127.0.0.1:2"}  # never its own machine
        proc.set_replica_peers({"b": "127.0.0.1:3"})
        assert status()["peers"] == {"b": "127.0.0.1:3"}

        client = AgentClient(gen.socket_path, timeout=5.0)
        try:
            pid = client.request("ping", timeout=30)["pid"]
        finally:
            client.close()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # the supervisor starts it again; the new one answers with another pid
            try:
                client = AgentClient(gen.socket_path, timeout=1.0)
                try:
                    if client.request("ping", timeout=5)["pid"] != pid:
                        break
                finally:
                    client.close()
            except AgentError:
                pass
            assert time.monotonic() < deadline, "the agent was not started again"
            time.sleep(0.1)
        proc.wait_ready(timedelta(seconds=120))
        rep = status()
        assert rep["listen"] == address and rep["peers"] == {"b": "127.0.0.1:3"}, rep
        assert published == [address]  # the same address: nothing to publish again
    finally:
        proc.stop()
        shutil.rmtree(shm, ignore_errors=True)


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
@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
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


# -- end to end: a sharded job loses a machine, memory only ------------------------------------

WORKER_ARGS = ["--steps", "36", "--every", "2", "--fsdp"]
"""The uninterrupted run (``reference_model``) and the sharded job of the test below."""


class _MemoryOnly(NsSimCluster):
    """Launchers and workers without storage: a lost machine's shards exist only in memory."""

    def command(self, node_id: str, *extra: str, worker_args: Any = ()) -> list[str]:
        cmd = super().command(node_id, *extra, worker_args=worker_args)
        i = cmd.index("--storage")  # the launcher's: its agent persists nothing
        del cmd[i : i + 2]
        cmd[cmd.index("--storage") + 1] = ""  # the worker's: checkpointing(storage=None)
        return cmd


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.timeout(420)
@pytest.mark.parametrize("victim_rank", [1, 0], ids=["kill-rank1", "kill-rank0"])
def test_standby_restores_a_killed_machines_shards_from_the_survivors_replica(
    tmp_path: Path,
    net: tuple[netns.Cluster, str],
    reference_model: dict[str, Any],
    victim_rank: int,
) -> None:
    """FSDP2 on 2 namespaced machines + 1 standby, memory only: the machine of rank
    ``victim_rank`` is killed (its memory gone); the survivor keeps its rank (the rendezvous
    keeps survivors' ranks stable: with torch's numbering, losing rank 0 renumbered the
    survivor to rank 0, whose shards no source held, and the job started over from step 0),
    and restores from its own memory; the standby takes the victim's rank and restores its
    shards from the survivor's replica (``peer-memory``), at the same step; the job ends with
    the bitwise same model as an uninterrupted run."""
    from elasticcluster import assert_same_model

    ns, etcd_url = net
    cluster = _MemoryOnly(
        tmp_path / "job", ns, etcd_url, nnodes="2:2",
        worker_args=[*WORKER_ARGS, "--step-sleep", "0.3"],
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
        rank0 = cluster.rank0_node()
        other = "n1" if rank0 == "n0" else "n0"
        victim, survivor = (rank0, other) if victim_rank == 0 else (other, rank0)
        cluster.wait_for(
            "the survivor to hold the victim's newest snapshot",
            lambda: _holds_newest(cluster, survivor, victim) and max(cluster.steps()) >= 6,
            120,
        )
        assert max(cluster.steps()) < 36 - 12, "training ran out before the kill"
        killed_at = time.time()
        assert cluster.machines[victim].kill(), "the machine had no processes"

        for node in (survivor, "n2"):
            assert cluster.wait_exit(node, 240) == 0, cluster.logs()
        resumed = cluster.restored_since(killed_at)
        by_node = {e["node"]: (e["restored_from"], e["start_step"]) for e in resumed}
        assert set(by_node) == {survivor, "n2"}, resumed
        assert len({s for _, s in by_node.values()}) == 1 and by_node[survivor][1] > 0, resumed
        assert by_node[survivor][0] == "memory" and by_node["n2"][0] == "peer-memory", resumed
        ranks = {e["node"]: e["rank"] for e in resumed}
        assert ranks == {survivor: 1 - victim_rank, "n2": victim_rank}, resumed
        assert_same_model(cluster.out, reference_model)
    finally:
        cluster.close()
