"""``flashckpt run`` stops promptly on SIGTERM/SIGINT in every state, and leaves nothing behind.

States: waiting in the rendezvous (a machine of a 2-machine job started alone), workers running
(the whole process group signalled, as a scheduler or a terminal's Ctrl-C does), and etcd gone
for good (signalled while the workers train, and exiting on its own after they finished).

"Promptly" is torchrun's shutdown deadline (``--shutdown-timeout``, 30 s by default) plus the
launcher's bounded clean-up; the waits below are generous bounds on that, not measurements.
After the exit no process of the machine is left, no shared-memory segment, no socket in the run
directory, no etcd key of the machine, and the node agent was never started a second time.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from elasticcluster import SimCluster

from flashckpt.elastic.etcd.client import EtcdClient
from flashckpt.elastic.etcd.server import EtcdV3Server
from flashckpt.elastic.rendezvous.backend import DEFAULT_KEY_PREFIX, job_prefix
from flashckpt.testing.elastic import job_processes

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

LONG_RUN = ["--steps", "100000", "--every", "5", "--step-sleep", "0.1"]
# torchrun's default shutdown deadline (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) plus room for a loaded
# machine; the old launcher stayed 150 s in a rendezvous after a SIGTERM.
EXIT_BOUND_S = 60


@pytest.fixture
def cluster_box(tmp_path: Path) -> Iterator[list[SimCluster]]:
    clusters: list[SimCluster] = []
    yield clusters
    for cluster in clusters:
        cluster.close()


def _leftovers(cluster: SimCluster, node: str, client: EtcdClient | None) -> list[str]:
    """Everything of ``node`` still there after its launcher exited."""
    found = []
    machine = cluster.machines[node]
    for p in job_processes([machine.proc.pid], cluster.run_id):
        try:
            found.append(f"process {p.pid}: {' '.join(p.cmdline())}")
        except Exception:  # exited while we looked
            continue
    shm = cluster.shm_root / node
    found += [f"segment {p}" for p in shm.rglob("*") if p.is_file()] if shm.exists() else []
    run_dir = Path(cluster.run_dir)
    if run_dir.exists():
        for p in run_dir.rglob("*"):
            if p.is_socket() or p.name.endswith((".sock", ".prewarm")):
                found.append(f"socket {p}")
    if client is not None:
        prefix = job_prefix(cluster.run_id, DEFAULT_KEY_PREFIX)
        for kv in client.get_prefix(prefix):
            key = kv.key.decode()
            if key.rsplit("/", 1)[-1] == node:
                found.append(f"etcd key {key}")
    return found


def _agent_starts(cluster: SimCluster, node: str) -> int:
    return cluster.machines[node].tail(10**6).count("node agent generation 1 started")


def _wait_signalled_exit(cluster: SimCluster, node: str, sig: signal.Signals) -> int:
    code = cluster.wait_exit(node, EXIT_BOUND_S)
    assert code == 128 + int(sig), cluster.logs()
    return code


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_waiting_in_the_rendezvous(
    etcd_server: str, tmp_path: Path, cluster_box: list[SimCluster], sig: signal.Signals
) -> None:
    cluster = SimCluster(tmp_path, etcd_server, nnodes="2:2", worker_args=LONG_RUN)
    cluster_box.append(cluster)
    machine = cluster.start("n0")  # its peer never comes: it waits in the rendezvous
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=5))
    rounds = job_prefix(cluster.run_id, DEFAULT_KEY_PREFIX) + "rdzv/r/"

    def joins() -> list[str]:
        return [kv.key.decode() for kv in client.get_prefix(rounds) if b"/a/" in kv.key]

    # Its join key of round 0 is there: it waits for the peer, which never comes.
    cluster.wait_for("the launcher to wait in the rendezvous", lambda: bool(joins()), 90)
    os.kill(machine.proc.pid, sig)
    _wait_signalled_exit(cluster, "n0", sig)
    assert not _leftovers(cluster, "n0", client), cluster.logs()
    # Its place in the rendezvous is given up at once (its rendezvous lease revoked), so the
    # other machines do not count it as waiting until the lease would lapse.
    assert joins() == [], cluster.logs()
    assert _agent_starts(cluster, "n0") == 1, cluster.logs()


@pytest.mark.timeout(180)
def test_sigterm_to_the_process_group_while_workers_run(
    etcd_server: str, tmp_path: Path, cluster_box: list[SimCluster]
) -> None:
    # The scheduler's way (and Ctrl-C's): every process of the group gets the signal, the node
    # agent included. The launcher must not start a new agent while it shuts down.
    cluster = SimCluster(tmp_path, etcd_server, nnodes="1", nproc=2, worker_args=LONG_RUN)
    cluster_box.append(cluster)
    machine = cluster.start("n0")
    cluster.wait_for("training", lambda: len(cluster.steps()) >= 2 * 8, 120)
    os.killpg(machine.proc.pid, signal.SIGTERM)
    _wait_signalled_exit(cluster, "n0", signal.SIGTERM)
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=5))
    assert not _leftovers(cluster, "n0", client), cluster.logs()
    assert _agent_starts(cluster, "n0") == 1, cluster.logs()
    assert "starting it again" not in machine.tail(10**6), cluster.logs()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["sigterm", "finish"])
def test_etcd_gone_for_good(
    tmp_path: Path, etcd_instance: EtcdV3Server, cluster_box: list[SimCluster], how: str
) -> None:
    short = ["--steps", "40", "--every", "5", "--step-sleep", "0.1"]
    steps = LONG_RUN if how == "sigterm" else short
    cluster = SimCluster(tmp_path, etcd_instance.client_url, nnodes="1", nproc=1, worker_args=steps)
    cluster_box.append(cluster)
    machine = cluster.start("n0")
    cluster.wait_for("training", lambda: len(cluster.steps()) >= 5, 120)
    etcd_instance.kill()
    if how == "sigterm":
        cluster.wait_for("training without etcd", lambda: len(cluster.steps()) >= 15, 60)
        os.kill(machine.proc.pid, signal.SIGTERM)
        _wait_signalled_exit(cluster, "n0", signal.SIGTERM)
    else:
        cluster.wait_for(
            "the workers to finish",
            lambda: any(e["event"] == "done" for e in cluster.events()),
            120,
        )
        # The old launcher spent 138 s on etcd calls that could not succeed (exit barrier,
        # closing the rendezvous, publishing 'leaving') before it exited.
        assert cluster.wait_exit("n0", EXIT_BOUND_S) == 0, cluster.logs()
    assert not _leftovers(cluster, "n0", None), cluster.logs()
    assert _agent_starts(cluster, "n0") == 1, cluster.logs()


@pytest.mark.timeout(120)
def test_sigterm_while_connecting_to_etcd(
    tmp_path: Path, dead_endpoint: str, cluster_box: list[SimCluster]
) -> None:
    # Before the rendezvous: the launcher retries an etcd that does not answer (read_timeout).
    cluster = SimCluster(tmp_path, dead_endpoint, launcher_args=["--rdzv-conf", "read_timeout=300"])
    cluster_box.append(cluster)
    machine = cluster.start("n0")
    cluster.wait_for(
        "the launcher to start",
        lambda: any(e["event"] == "launcher_start" for e in machine.events()),
        60,
    )
    time.sleep(1)  # inside the etcd client's retries
    os.kill(machine.proc.pid, signal.SIGTERM)
    _wait_signalled_exit(cluster, "n0", signal.SIGTERM)
    assert "Traceback" not in machine.tail(), cluster.logs()
    assert not _leftovers(cluster, "n0", None), cluster.logs()
