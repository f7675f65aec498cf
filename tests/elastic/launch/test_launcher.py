"""``flashckpt run`` end to end: real launchers, real etcd, real ``kill -9``, real gloo.

Several machines are simulated on this host as separate launcher process trees with their own
node ids and shared-memory directories (see ``_cluster.py``). Training is deterministic on CPU,
so every interrupted run must end with the bitwise same model as the uninterrupted reference.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import safetensors.torch
import torch
from elasticcluster import SimCluster, assert_same_model, cluster_env

from flashckpt.elastic.etcd.server import EtcdV3Server
from flashckpt.elastic.membership import health
from flashckpt.format.storage import Storage
from flashckpt.testing.s3 import SeaweedS3

STEPS = 50
EVERY = 5
WORKER_ARGS = ["--steps", str(STEPS), "--every", str(EVERY)]
PACED = [*WORKER_ARGS, "--step-sleep", "0.1"]
SLOW = [*WORKER_ARGS, "--step-sleep", "0.3"]  # leaves time to start a standby before the kill
# Paced until a machine of two is killed (the kill needs training left); the survivor alone has
# nothing to wait for.
SHRINK = [*SLOW, "--sleep-world-size", "2"]
# Every worker stalls after step 10 (snapshotted) outside any collective, longer than a test
# waits: only a launcher can learn that a peer machine died meanwhile.
STALL = [*PACED, "--stall-at", "10", "--stall-s", "150"]

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[list[SimCluster]]:
    clusters: list[SimCluster] = []
    yield clusters
    for cluster in clusters:
        cluster.close()


@pytest.mark.timeout(240)
def test_standby_takes_the_place_of_a_killed_machine(
    etcd_server: str,
    tmp_path: Path,
    reference_model: dict[str, torch.Tensor],
    make_cluster: list[SimCluster],
) -> None:
    # No restart allowed for the workers' own failures: the survivor's, which fail with their
    # world when the machine dies, restart for the next round all the same.
    cluster = SimCluster(
        tmp_path, etcd_server, nnodes="2:2", worker_args=SLOW, launcher_args=["--max-restarts", "0"]
    )
    make_cluster.append(cluster)
    cluster.start("n0")
    cluster.start("n1")
    cluster.wait_for("training to start", lambda: len(cluster.steps()) >= 2, 120)
    standby = cluster.start("n2")
    cluster.wait_for(
        "the standby to join the rendezvous",
        lambda: any(e["event"] == "rendezvous_start" for e in standby.events()),
        60,
    )
    cluster.wait_for("a committed step", lambda: bool(cluster.committed()), 60)
    assert max(cluster.steps()) < STEPS - 10, "training ran out before the kill; slow it down"

    # Kill the machine that hosts rank 0 (it also commits the manifests): launcher, node agent
    # and worker at the same instant.
    rank0_node = cluster.rank0_node()
    survivor = "n1" if rank0_node == "n0" else "n0"
    committed_before = max(cluster.committed())
    last_step_before = max(cluster.steps())
    killed_at = time.time()
    victims = cluster.machines[rank0_node].kill()
    assert victims, "the machine had no processes"

    for node in (survivor, "n2"):
        assert cluster.wait_exit(node, 150) == 0, cluster.logs()
    assert_same_model(cluster.out, reference_model)

    resumed = cluster.restored_since(killed_at)
    assert {e["node"] for e in resumed} == {survivor, "n2"}, resumed
    start_steps = {e["start_step"] for e in resumed}
    assert len(start_steps) == 1, f"ranks resumed from different steps: {resumed}"
    start_step = start_steps.pop()
    # Nothing committed before the kill is lost, and at most one interval plus the steps in
    # flight is recomputed. The newest step reached is the later of the two reads: a worker logs
    # its step after ckpt.step() returns, so the commit of that step can be seen first.
    assert committed_before <= start_step <= max(last_step_before + 1, committed_before)
    assert all(e["world_size"] == 2 for e in resumed)
    # The survivor reloads from its node agent's memory (under whatever rank the new round gave
    # it); the replacement gets the state from the survivor's memory over gloo (a replica's
    # memory is preferred to storage; its RNG and extras come from the file written through).
    assert next(e for e in resumed if e["node"] == survivor)["restored_from"] == "memory", resumed
    assert next(e for e in resumed if e["node"] == "n2")["restored_from"] == "replica", resumed
    # The agents stayed across the round: no new agent generation.
    survivor_events = cluster.machines[survivor].events()
    assert not [e for e in survivor_events if e["event"] == "node_agent_restart"], survivor_events
    assert max(cluster.committed()) == STEPS
    # Both saw exactly the killed machine go (until the first of them finished and left).
    launchers = {node: cluster.machines[node].events() for node in (survivor, "n2")}
    done_at = min(e["t"] for ev in launchers.values() for e in ev if e["event"] == "succeeded")
    for events in launchers.values():
        lost = [e["peer"] for e in events if e["event"] == "peer_lost" and e["t"] < done_at]
        assert lost == [rank0_node], events
    # Every process of the killed machine is gone (the workers died with their launcher).
    assert not any(_alive(pid) for pid in victims)
    restarts = [e for e in launchers[survivor] if e["event"] == "workers_restart"]
    assert len(restarts) == 1 and restarts[0]["remaining_restarts"] == 0, restarts
    _assert_one_round_number_per_round(cluster, survivor, "n2")


def _assert_one_round_number_per_round(cluster: SimCluster, survivor: str, standby: str) -> None:
    """Every machine's log names a round with the number etcd keeps for it (issue 44: a
    machine that joined late numbered the rounds it saw from 1): each round's result (its
    digest) has one number in every log, and the survivor's restore line after the failover
    names the same round as the standby's only one (a count of starts said 2 and 1)."""
    joined: dict[str, dict[str, int]] = {}  # the round's result digest -> node -> number
    restored: dict[str, list[int]] = {}  # node -> the numbers of its restore lines
    for node, machine in cluster.machines.items():
        text = machine.log.read_text(errors="replace")
        for rnd, digest in re.findall(r"INFO round (\d+) of '[^']+': group rank \d+ of \d+ "
                                      r"\(result (\w+)\)", text):  # fmt: skip
            joined.setdefault(digest, {})[node] = int(rnd)
        restored[node] = [int(r) for r in re.findall(r"\] round (\d+): ", text)]
    assert all(len(set(by_node.values())) == 1 for by_node in joined.values()), joined
    (after,) = [by[survivor] for by in joined.values() if set(by) == {survivor, standby}]
    for node, numbers in restored.items():  # a restore line names a round the machine was in
        assert set(numbers) <= {by[node] for by in joined.values() if node in by}, restored
    assert restored[standby] == [after] and restored[survivor][-1] == after, restored
    starts = {
        node: [e["round"] for e in cluster.machines[node].events() if e["event"] == "workers_start"]
        for node in (survivor, standby)
    }
    assert starts[standby] == [after] and starts[survivor][-1] == after, starts


@pytest.mark.timeout(240)
def test_a_machine_killed_while_the_survivors_workers_stall_is_found_by_the_links(
    etcd_server: str,
    tmp_path: Path,
    reference_model: dict[str, torch.Tensor],
    make_cluster: list[SimCluster],
) -> None:
    # Every worker stalls outside any collective after step 10 (a data loader stall, a long
    # step): no worker can learn of the kill, and the leases outlive the stall. Only the links
    # the launchers hold to each other's probe ports see the killed launcher's sockets close.
    ttl = "60"
    cluster = SimCluster(
        tmp_path,
        etcd_server,
        nnodes="2:2",
        worker_args=STALL,
        launcher_args=["--lease-ttl", ttl],
    )
    make_cluster.append(cluster)
    cluster.start("n0")
    cluster.start("n1")
    cluster.wait_for("training to start", lambda: len(cluster.steps()) >= 2, 120)
    standby = cluster.start("n2")
    cluster.wait_for("both machines to stall", lambda: _stalled(cluster) == {"n0", "n1"}, 150)
    cluster.wait_for(
        "the standby to join the rendezvous",
        lambda: any(e["event"] == "rendezvous_start" for e in standby.events()),
        60,
    )
    victim = cluster.rank0_node()
    survivor = "n1" if victim == "n0" else "n0"
    killed_at = time.time()
    assert cluster.machines[victim].kill(), "the machine had no processes"
    for node in (survivor, "n2"):
        assert cluster.wait_exit(node, 150) == 0, cluster.logs()
    assert_same_model(cluster.out, reference_model)

    launchers = {node: cluster.machines[node].events() for node in (survivor, "n2")}
    # (until the first of them finished and left)
    done_at = min(e["t"] for ev in launchers.values() for e in ev if e["event"] == "succeeded")
    lost = [
        e
        for ev in launchers.values()
        for e in ev
        if e["event"] == "peer_lost" and killed_at < e["t"] < done_at
    ]
    assert sorted(e["peer"] for e in lost) == [victim, victim], lost
    # Both found it dead before its lease could lapse: its last renewal was at most one
    # renewal interval (ttl/5) before the kill, so etcd kept its key until at least
    # ttl - ttl/5 after it. A launcher whose link broke probed it and revoked its lease, and
    # reports "link" (its own watch sees the deletion too, and leaves it to the prober); the
    # other reports "link" as well, or "watch" when the deletion reached it before its own
    # probe finished. (Without the links a launcher learns it when torch drops the silent
    # machine from its rendezvous state after 15 s without a heartbeat, and probes before the
    # next round: "probe", 12 s after the kill when tried.)
    assert all(e["t"] - killed_at < float(ttl) * 4 / 5 for e in lost), (killed_at, lost)
    assert "link" in {e["via"] for e in lost}, lost
    # The survivor's workers were still running (stalled) when its launcher restarted them.
    restarts = [e for e in launchers[survivor] if e["event"] == "workers_restart"]
    assert restarts and restarts[0]["state"] == "HEALTHY", launchers[survivor]
    resumed = cluster.restored_since(killed_at)
    assert {e["node"] for e in resumed} == {survivor, "n2"}, resumed
    assert {e["start_step"] for e in resumed} == {10}, resumed


def _stalled(cluster: SimCluster) -> set[str]:
    """The machines whose workers reported the stall of ``STALL``."""
    return {e["node"] for e in cluster.events() if e["event"] == "stalled"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(180)
def test_worker_crash_restarts_workers_from_memory(
    tmp_path: Path, reference_model: dict[str, torch.Tensor], make_cluster: list[SimCluster]
) -> None:
    # One machine (--standalone: its own etcd), two workers; one worker is killed with SIGKILL.
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=PACED)
    make_cluster.append(cluster)
    with socket.socket() as s:  # a free port for the node agent's Prometheus endpoint
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    machine = cluster.start("solo", "--metrics-port", str(port))
    cluster.wait_for("a few snapshots", lambda: len(cluster.steps()) >= 2 * 12, 120)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert re.search(r"^flashckpt_last_snapshot_step\S* [1-9]", metrics, re.M), metrics[-2000:]
    victim = next(e["pid"] for e in cluster.events() if e["event"] == "start" and e["rank"] == 1)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)

    assert cluster.wait_exit("solo", 120) == 0, cluster.logs()
    assert_same_model(cluster.out, reference_model)
    resumed = cluster.restored_since(killed_at)
    assert sorted(e["rank"] for e in resumed) == [0, 1], resumed
    assert all(e["restored_from"] == "memory" for e in resumed), resumed
    assert len({e["start_step"] for e in resumed}) == 1
    assert resumed[0]["start_step"] >= 10
    # The node agent (and its snapshots in memory) survived the restart of the workers.
    events = machine.events()
    assert not [e for e in events if e["event"] == "node_agent_restart"], events
    assert {e["agent_gen"] for e in events if e["event"] == "workers_start"} == {1}


@pytest.mark.timeout(60)
def test_unreachable_etcd_at_start_fails_fast_with_the_fix(
    tmp_path: Path, dead_endpoint: str, make_cluster: list[SimCluster]
) -> None:
    cluster = SimCluster(tmp_path, dead_endpoint, launcher_args=["--rdzv-conf", "read_timeout=3"])
    make_cluster.append(cluster)
    started = time.monotonic()
    cluster.start("n0")
    code = cluster.wait_exit("n0", 45)
    elapsed = time.monotonic() - started
    output = cluster.machines["n0"].tail()
    assert code == 2, output
    assert elapsed < 30, f"took {elapsed:.1f} s"
    assert "cannot reach etcd at " + dead_endpoint in output, output
    assert "--rdzv-endpoint" in output and "--standalone" in output, output
    assert "Traceback" not in output, output


@pytest.mark.timeout(240)
def test_job_survives_an_etcd_restart(
    tmp_path: Path,
    etcd_instance: EtcdV3Server,
    reference_model: dict[str, torch.Tensor],
    make_cluster: list[SimCluster],
) -> None:
    cluster = SimCluster(tmp_path, etcd_instance.client_url, nnodes="2:2", worker_args=PACED)
    make_cluster.append(cluster)
    cluster.start("n0")
    cluster.start("n1")
    cluster.wait_for("training", lambda: len(cluster.steps()) >= 2 * 8, 120)
    etcd_instance.restart(down_for=timedelta(seconds=2))
    steps_after_restart = len(cluster.steps())
    for node in ("n0", "n1"):
        assert cluster.wait_exit(node, 150) == 0, cluster.logs()
    assert len(cluster.steps()) > steps_after_restart
    assert_same_model(cluster.out, reference_model)


@pytest.mark.timeout(240)
def test_late_machine_scales_the_job_up(
    etcd_server: str, tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    cluster = SimCluster(
        tmp_path,
        etcd_server,
        nnodes="1:2",
        # Room for the late start under load; once both machines train nothing is waited for.
        worker_args=[*WORKER_ARGS, "--step-sleep", "0.5", "--sleep-world-size", "1"],
        launcher_args=["--rdzv-conf", "last_call_timeout=1"],
    )
    make_cluster.append(cluster)
    cluster.start("n0")
    cluster.wait_for("training on one machine", lambda: len(cluster.steps()) >= 8, 120)
    joined_at = time.time()
    cluster.start("n1")
    for node in ("n0", "n1"):
        assert cluster.wait_exit(node, 150) == 0, cluster.logs()
    resumed = cluster.restored_since(joined_at)
    assert {(e["node"], e["world_size"]) for e in resumed} == {("n0", 2), ("n1", 2)}, resumed
    assert len({e["start_step"] for e in resumed}) == 1
    assert resumed[0]["start_step"] >= EVERY
    assert max(cluster.committed()) == STEPS


@pytest.mark.timeout(240)
def test_machine_loss_without_standby_shrinks_the_job(
    etcd_server: str, tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    # MIN:MAX = 1:2 and no standby: when a machine dies the job goes on at the smaller size.
    cluster = SimCluster(
        tmp_path,
        etcd_server,
        nnodes="1:2",
        worker_args=SHRINK,
        launcher_args=["--rdzv-conf", "last_call_timeout=1"],
    )
    make_cluster.append(cluster)
    cluster.start("n0")
    cluster.start("n1")
    cluster.wait_for("training on two machines", lambda: len(cluster.steps()) >= 2 * 8, 120)
    cluster.wait_for("a committed step", lambda: bool(cluster.committed()), 60)
    assert max(cluster.steps()) < STEPS - 10, "training ran out before the kill; slow it down"
    committed_before = max(cluster.committed())
    last_step_before = max(cluster.steps())
    # Kill the machine that does not host rank 0: the survivor keeps its rank.
    rank0_node = cluster.rank0_node()
    victim = "n1" if rank0_node == "n0" else "n0"
    survivor = rank0_node
    killed_at = time.time()
    assert cluster.machines[victim].kill(), "the machine had no processes"

    assert cluster.wait_exit(survivor, 150) == 0, cluster.logs()
    resumed = cluster.restored_since(killed_at)
    assert [(e["node"], e["world_size"]) for e in resumed] == [(survivor, 1)], resumed
    # The survivor reloads the replicated state from its node agent's memory and goes on alone.
    # (the step's commit can be seen before its log line: see the test above)
    assert (
        committed_before <= resumed[0]["start_step"] <= max(last_step_before + 1, committed_before)
    )
    assert resumed[0]["restored_from"] == "memory", resumed
    assert max(cluster.committed()) == STEPS


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["kill", "sigterm"])
def test_a_survivor_without_standby_restarts_its_stalled_workers_when_its_peer_dies(
    etcd_server: str, tmp_path: Path, make_cluster: list[SimCluster], how: str
) -> None:
    # 1:2 and no standby, every worker stalled outside any collective: no machine waits to
    # join, so torch's agent would leave the survivor's healthy workers alone until their next
    # collective fails (after the stall). The launcher restarts them when the link reports
    # the death, and the job goes on alone. A machine stopped by SIGTERM (preempted) leaves
    # in order, its key marked "leaving" but not done: its workers left the round too (before
    # NodeRecord.done, a leaving machine counted as one whose workers finished, and the
    # survivor's stalled workers waited out the stall).
    cluster = SimCluster(
        tmp_path,
        etcd_server,
        nnodes="1:2",
        worker_args=STALL,
        launcher_args=["--rdzv-conf", "last_call_timeout=1", "--max-restarts", "0"],
    )
    make_cluster.append(cluster)
    cluster.start("n0")
    cluster.start("n1")
    cluster.wait_for("both machines to stall", lambda: _stalled(cluster) == {"n0", "n1"}, 120)
    survivor = cluster.rank0_node()
    victim = "n1" if survivor == "n0" else "n0"
    killed_at = time.time()
    if how == "kill":
        assert cluster.machines[victim].kill(), "the machine had no processes"
    else:
        cluster.machines[victim].proc.send_signal(signal.SIGTERM)
        assert cluster.wait_exit(victim, 60) == 128 + signal.SIGTERM, cluster.logs()
    assert cluster.wait_exit(survivor, 120) == 0, cluster.logs()
    events = cluster.machines[survivor].events()
    # (A SIGTERMed machine is reported "leaving" when the survivor's watch read its last
    # state before its key went, else "active"; either way its workers left the round.)
    lost = [e for e in events if e["event"] == "peer_lost" and e["t"] > killed_at]
    assert [e["peer"] for e in lost][:1] == [victim], lost
    restarts = [e for e in events if e["event"] == "workers_restart" and e["t"] > killed_at]
    assert len(restarts) == 1 and restarts[0]["state"] == "HEALTHY", events
    assert restarts[0]["remaining_restarts"] == 0
    resumed = cluster.restored_since(killed_at)
    assert [(e["node"], e["world_size"], e["start_step"]) for e in resumed] == [
        (survivor, 1, 10)
    ], resumed
    assert max(cluster.committed()) == STEPS


@pytest.mark.timeout(240)
def test_sharded_job_shrinks_by_resharding(
    etcd_server: str, tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    # FSDP2 on 2 machines, MIN:MAX = 1:2, no standby: the survivor goes on alone, its state
    # resharded from the 2-rank pieces in storage to the whole model on 1 rank. Replicas off:
    # with them the survivor reshards from its agent's replica of the lost machine's snapshot
    # instead ("peer-reshard", tests/elastic/launch/test_launcher_reshard.py); this test is
    # storage's.
    cluster = SimCluster(
        tmp_path,
        etcd_server,
        nnodes="1:2",
        worker_args=[*SHRINK, "--fsdp"],
        launcher_args=["--rdzv-conf", "last_call_timeout=1", "--replicas", "0"],
    )
    make_cluster.append(cluster)
    cluster.start("n0")
    cluster.start("n1")
    cluster.wait_for("training on two machines", lambda: len(cluster.steps()) >= 2 * 8, 120)
    cluster.wait_for("a committed step", lambda: bool(cluster.committed()), 60)
    assert max(cluster.steps()) < STEPS - 10, "training ran out before the kill; slow it down"
    committed_before = max(cluster.committed())
    assert Storage(cluster.storage).manifest(committed_before).num_shards == 2
    killed_at = time.time()
    assert cluster.machines["n1"].kill(), "the machine had no processes"

    assert cluster.wait_exit("n0", 150) == 0, cluster.logs()
    resumed = cluster.restored_since(killed_at)
    assert [(e["node"], e["world_size"]) for e in resumed] == [("n0", 1)], resumed
    assert resumed[0]["restored_from"] == "storage", resumed
    assert resumed[0]["start_step"] >= committed_before
    assert max(cluster.committed()) == STEPS
    assert Storage(cluster.storage).manifest(STEPS).num_shards == 1
    final = safetensors.torch.load_file(cluster.out / "final.safetensors")
    assert sorted(final) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert final["0.weight"].shape == (32, 16)


@pytest.mark.timeout(240)
def test_health_check_keeps_a_faulty_machine_out_of_the_job(
    etcd_server: str,
    tmp_path: Path,
    reference_model: dict[str, torch.Tensor],
    make_cluster: list[SimCluster],
) -> None:
    cluster = SimCluster(
        tmp_path,
        etcd_server,
        nnodes="2:2",
        worker_args=[*WORKER_ARGS, "--step-sleep", "0"],
        launcher_args=["--health-check"],
    )
    make_cluster.append(cluster)
    faulty = {**cluster_env(), health.FAULT_ENV: "1"}
    cluster.start("n0")
    cluster.start("n1", env=faulty)
    # n1's compute probe gives a wrong checksum: it is recorded and its launcher gives up.
    assert cluster.wait_exit("n1", 120) == 1, cluster.logs()
    assert "failed the health check" in cluster.machines["n1"].tail()
    # A healthy machine takes its place and the job runs as if nothing happened.
    cluster.start("n2")
    for node in ("n0", "n2"):
        assert cluster.wait_exit(node, 150) == 0, cluster.logs()
    assert_same_model(cluster.out, reference_model)
    assert {e["node"] for e in cluster.events() if e["event"] == "restored"} == {"n0", "n2"}
    # The faulty machine is not admitted to this job again, even once "repaired".
    cluster.start("n1")
    assert cluster.wait_exit("n1", 60) == 2, cluster.logs()
    assert "failed a health check earlier" in cluster.machines["n1"].tail()


@pytest.mark.timeout(120)
def test_killing_the_launcher_alone_takes_its_whole_machine_down(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=PACED)
    make_cluster.append(cluster)
    machine = cluster.start("solo")
    cluster.wait_for("training", lambda: len(cluster.steps()) >= 2 * 5, 120)
    assert len(_job_processes(cluster)) >= 5  # launcher, etcd, agents, pre-warm, workers
    os.kill(machine.proc.pid, signal.SIGKILL)
    machine.proc.wait(timeout=10)
    # Workers, node agents, the pre-warm process and the private etcd die with the launcher.
    deadline = time.monotonic() + 20
    while _job_processes(cluster) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _job_processes(cluster), [p.info["cmdline"] for p in _job_processes(cluster)]
    # The node agents got SIGTERM, not SIGKILL: they removed their shared-memory segments.
    left = [p for p in cluster.shm_root.rglob("fc.*") if p.is_file()]
    assert not left, (left, cluster.logs())


def _job_processes(cluster: SimCluster) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["pid"] != os.getpid() and cluster.run_id in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except (psutil.Error, TypeError):
            continue
    return found


@pytest.mark.timeout(120)
def test_a_second_launcher_with_the_same_node_id_is_refused(
    etcd_server: str, tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    cluster = SimCluster(tmp_path, etcd_server, nnodes="2:2", worker_args=PACED)
    make_cluster.append(cluster)
    first = cluster.start("n0")
    cluster.wait_for(
        "the first launcher to register",
        lambda: any(e["event"] == "registered" for e in first.events()),
        60,
    )
    second = SimCluster(tmp_path / "second", etcd_server, nnodes="2:2")
    second.run_id = cluster.run_id  # same job, same node id
    make_cluster.append(second)
    second.start("n0")
    assert second.wait_exit("n0", 60) == 2, second.logs()
    assert "already used in this job" in second.machines["n0"].tail()
    assert first.proc.poll() is None, "the first launcher must keep running"


@pytest.mark.timeout(300)
def test_launcher_storage_s3_resumes_a_wiped_machine_from_s3_bitwise(
    s3_server: SeaweedS3,
    s3_prefix: str,
    s3_env: dict,
    reference_model: dict[str, torch.Tensor],
    make_cluster: list[SimCluster],
    tmp_path: Path,
) -> None:
    """Standalone launcher, 2 ranks, ``--storage s3://ckpts/<test>/run`` on a real S3 server
    (SeaweedFS, tests/support/s3fixtures.py): once S3 holds a
    committed step the whole machine is SIGKILLed (a rank among its processes) and its shm
    directory deleted; a new launcher of the same job resumes both ranks from S3 at the newest
    committed step (not memory, not 0), runs to the end, and the final model is bitwise the
    uninterrupted run's; ``latest`` names a committed step that is the job's last."""
    cluster = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=PACED)
    make_cluster.append(cluster)
    url = f"{s3_prefix}/run"
    cluster.storage = url
    st = Storage(url)
    cluster.start("solo")
    cluster.wait_for("a step committed in S3", lambda: bool(cluster.committed()), 180)
    assert max(cluster.steps()) < STEPS - 2 * EVERY, "training ran out before the kill"
    killed_at = time.time()
    assert len(cluster.machines["solo"].kill()) >= 4  # launcher, agent, 2 ranks (+ etcd)
    newest = st.committed_steps()[-1]
    shm = cluster.shm_root / "solo"
    assert any(shm.iterdir()), "the machine kept no snapshot in memory: nothing to wipe"
    shutil.rmtree(shm)

    cluster.start("solo")
    assert cluster.wait_exit("solo", 240) == 0, cluster.logs()
    resumed = cluster.restored_since(killed_at)
    assert sorted(e["rank"] for e in resumed) == [0, 1], resumed
    assert {(e["restored_from"], e["start_step"]) for e in resumed} == {("storage", newest)}, (
        resumed,
        newest,
    )
    assert_same_model(cluster.out, reference_model)
    committed = st.committed_steps()
    assert committed[-1] == STEPS
    assert st.manifest(STEPS).ranks and sorted(st.manifest(STEPS).ranks) == [0, 1]
