"""A machine cut off from the job (a network partition) fences itself (issue 11).

Fast tests: the fence deadline arithmetic, and :class:`NodeRegistry`'s renew loop against a real
etcd whose renewals a wrapper cuts (fenced only when no peer answers either; registered again
with a fresh token, lease and generation). The end-to-end test runs ``flashckpt run`` on
machines in their own namespaces (``tests/support/nscluster.py``) and takes one machine's link down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_until

from flashckpt.elastic.etcd.client import EtcdClient, EtcdUnavailable
from flashckpt.elastic.membership.nodes import (
    FenceNotice,
    NodeRegistry,
    ProbeResult,
    fence_deadline,
    lease_expiry,
    peer_etcd_age,
    probe,
)
from flashckpt.testing import netns

TTL = timedelta(seconds=2)


def test_the_fence_comes_a_fifth_of_the_ttl_before_the_lease_can_lapse() -> None:
    assert fence_deadline(100.0, 5.0) == pytest.approx(104.0)
    assert lease_expiry(100.0, 5.0) == pytest.approx(105.0)
    assert fence_deadline(0.0, 2.0) == pytest.approx(1.6)
    for ttl in (2.0, 5.0, 30.0):
        margin = lease_expiry(7.0, ttl) - fence_deadline(7.0, ttl)
        assert margin == pytest.approx(ttl / 5), "the workers get ttl/5 to stop"


class _Cuttable:
    """An etcd client that cannot reach etcd while :attr:`cut` is set."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self.cut = threading.Event()

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._client, name)
        if name == "transport":  # the watch streams' own connections are cut off too
            cut = _Cuttable(real)
            cut.cut = self.cut
            return cut

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.cut.is_set():
                time.sleep(0.05)
                raise EtcdUnavailable("cut off (test)")
            return real(*args, **kwargs)

        return call


@pytest.fixture
def make_registry(
    etcd_client: EtcdClient, etcd_prefix: str
) -> Iterator[Callable[..., tuple[NodeRegistry, _Cuttable]]]:
    made: list[NodeRegistry] = []

    def make(node: str, **kwargs: Any) -> tuple[NodeRegistry, _Cuttable]:
        client = _Cuttable(etcd_client)
        reg = NodeRegistry(
            client,  # type: ignore[arg-type]
            etcd_prefix,
            node,
            ttl=TTL,
            advertise_host="127.0.0.1",
            bind_host="127.0.0.1",
            **kwargs,
        )
        reg.start(timedelta(seconds=10))
        made.append(reg)
        return reg, client

    yield make
    for reg in made:
        reg.close()


@pytest.mark.etcd
def test_a_machine_that_reaches_neither_etcd_nor_a_peer_is_fenced(
    make_registry: Callable[..., tuple[NodeRegistry, _Cuttable]], etcd_client: EtcdClient
) -> None:
    notices: list[tuple[FenceNotice, float]] = []
    reg, client = make_registry("a", on_fenced=lambda n: notices.append((n, time.monotonic())))
    peer, _ = make_registry("b")
    wait_until(lambda: "b" in reg.peers(), "the peer to be seen", timeout=30.0)
    old_token, old_lease = reg.record.token, etcd_client.get_kv(reg.key)
    assert old_lease is not None
    client.cut.set()
    cut_at = time.monotonic()
    # Cut off from the others too: the peer's probe port no longer answers (its key stays: the
    # watch cannot see anything either).
    peer.close(revoke=False)
    notice, called_at = wait_until(lambda: notices and notices[0], "the fence", timeout=30.0)
    assert reg.fenced and notice.generation == 1
    assert notice.expiry == pytest.approx(notice.last_ok + TTL.total_seconds())
    assert notice.last_ok <= cut_at, "the last renewal that succeeded was before the cut"
    assert called_at >= fence_deadline(notice.last_ok, TTL.total_seconds())
    assert "no other machine of the job answers" in notice.reason
    # Nothing is written under the fenced registration any more.
    assert reg.publish(reg.key + "-summary", b"x") is False
    time.sleep(TTL.total_seconds() / 5 * 2)
    assert len(notices) == 1, "fenced more than once"
    # The link comes back: registered afresh, never under the stale token or lease.
    client.cut.clear()
    assert reg.rejoin(timedelta(seconds=10)) == 2
    assert not reg.fenced and reg.generation == 2
    kv = etcd_client.get_kv(reg.key)
    assert kv is not None and kv.lease != old_lease.lease
    record = json.loads(kv.value)
    assert record["token"] != old_token and record["state"] == "waiting"
    # ... and renewed from then on: the key outlives several TTLs.
    time.sleep(TTL.total_seconds() * 1.5)
    assert etcd_client.get_kv(reg.key) is not None and not reg.fenced


@pytest.mark.etcd
def test_an_etcd_outage_every_machine_sees_is_no_fence(
    make_registry: Callable[..., tuple[NodeRegistry, _Cuttable]],
) -> None:
    notices: list[FenceNotice] = []
    reg, client = make_registry("a", on_fenced=notices.append)
    peer, peer_client = make_registry("b", on_fenced=notices.append)  # its probe port answers
    wait_until(lambda: "b" in reg.peers(), "the peer to be seen", timeout=30.0)
    client.cut.set()
    peer_client.cut.set()  # etcd is down for both: no lease lapses, no new world forms
    time.sleep(TTL.total_seconds() * 1.5)
    assert notices == [] and not reg.fenced and not peer.fenced, "an etcd outage fenced them"
    client.cut.clear()
    peer_client.cut.clear()


@pytest.mark.etcd
def test_a_machine_cut_off_from_etcd_alone_is_fenced_before_its_lease_lapses(
    make_registry: Callable[..., tuple[NodeRegistry, _Cuttable]], etcd_client: EtcdClient
) -> None:
    """Its peers reach etcd (and say so on their probe ports): its lease will lapse and the
    others form a new world without it, so it fences, as one cut off from everyone does."""
    notices: list[tuple[FenceNotice, float]] = []
    reg, client = make_registry("a", on_fenced=lambda n: notices.append((n, time.monotonic())))
    peer, _ = make_registry("b")
    wait_until(lambda: "b" in reg.peers(), "the peer to be seen", timeout=30.0)
    b = reg.peers()["b"]
    age = peer_etcd_age(b, 1.0)
    assert age is not None and 0.0 <= age < TTL.total_seconds(), age
    assert peer_etcd_age(dataclasses.replace(b, token="another"), 1.0) is None
    assert probe(b) is ProbeResult.ALIVE  # the plain probe is unchanged
    client.cut.set()
    cut_at = time.monotonic()
    notice, called_at = wait_until(lambda: notices and notices[0], "the fence", timeout=30.0)
    assert reg.fenced and not peer.fenced
    assert "alone is cut off from etcd" in notice.reason and "b" in notice.reason, notice.reason
    assert notice.last_ok <= cut_at
    assert called_at >= fence_deadline(notice.last_ok, TTL.total_seconds())
    assert called_at < lease_expiry(notice.last_ok, TTL.total_seconds()), "fenced too late"
    # A fenced launcher says it holds no lease.
    assert peer_etcd_age(reg.record, 1.0) is None
    client.cut.clear()
    assert reg.rejoin(timedelta(seconds=10)) == 2 and not reg.fenced


@pytest.mark.etcd
def test_a_machine_without_peers_is_not_fenced(
    make_registry: Callable[..., tuple[NodeRegistry, _Cuttable]],
) -> None:
    notices: list[FenceNotice] = []
    reg, client = make_registry("solo", on_fenced=notices.append)
    client.cut.set()
    time.sleep(TTL.total_seconds() * 1.5)
    assert notices == [] and not reg.fenced, "nobody could take its place"
    client.cut.clear()


def test_the_fence_stops_workers_with_sigterm_then_sigkill_by_the_deadline() -> None:
    import signal
    import subprocess
    import sys

    from flashckpt.elastic.launch.session import stop_processes

    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == b"ready"
        killed = stop_processes([polite.pid, stubborn.pid], time.monotonic() + 1.0)
        # Not reaped yet (zombies): counted as gone all the same.
        assert killed == [stubborn.pid]
        assert polite.wait(timeout=30) == -signal.SIGTERM
        assert stubborn.wait(timeout=30) == -signal.SIGKILL
    finally:
        for p in (polite, stubborn):
            if p.poll() is None:
                p.kill()
                p.wait()
        if stubborn.stdout is not None:
            stubborn.stdout.close()


def test_the_fence_never_signals_a_process_that_is_not_its_child() -> None:
    """A worker's pid may be reused once it exited: only the launcher's children are stopped."""
    import os
    import signal
    import subprocess
    import sys

    from flashckpt.elastic.launch.session import stop_processes

    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "code = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            'print("ready", flush=True); time.sleep(600)\'\n'
            "c = subprocess.Popen([sys.executable, '-c', code])\n"
            "print(c.pid, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
    )
    grandchild = 0
    try:
        assert parent.stdout is not None
        lines = {parent.stdout.readline().strip() for _ in range(2)}
        assert b"ready" in lines, lines
        grandchild = int(next(x for x in lines if x.isdigit()))
        assert stop_processes([grandchild], time.monotonic() + 0.5) == []
        with open(f"/proc/{grandchild}/stat", "rb") as f:  # still running: never signalled
            assert f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    finally:
        if grandchild:
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


# -- end to end: machines in their own namespaces, one machine's link taken down -----------------

_NETNS = netns.unavailable()
STEPS = 60
EVERY = 5
WORKER_ARGS = ["--steps", str(STEPS), "--every", str(EVERY)]  # the reference run's


class _LatestRecorder:
    """Reads storage's ``latest`` pointer every 20 ms, from a thread, until closed."""

    def __init__(self, storage: Path) -> None:
        self._path = storage / "latest"
        self.seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            try:
                step = json.loads(self._path.read_text())["step"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not there yet, or replaced under the read
            if not self.seen or self.seen[-1] != step:
                self.seen.append(step)

    def close(self) -> list[int]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.seen


@pytest.fixture
def net(tmp_path: Path) -> Iterator[tuple[netns.Cluster, str]]:
    from flashckpt.elastic.etcd.server import find_etcd_binary

    cluster = netns.Cluster(shm_size="1g")
    try:
        url = cluster.start_etcd(str(tmp_path / "etcd"), binary=find_etcd_binary())
        yield cluster, url
    finally:
        cluster.close()


def _events(machine: Any, name: str) -> list[dict[str, Any]]:
    return [e for e in machine.events() if e["event"] == name]


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.skipif(_NETNS is not None, reason=_NETNS or "")
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("cut", "heal"), [("link", "while_training"), ("etcd", "after_the_job")]
)  # fmt: skip
def test_a_partitioned_machine_fences_itself_and_rejoins_as_a_standby(
    tmp_path: Path,
    net: tuple[netns.Cluster, str],
    reference_model: dict[str, Any],
    cut: str,
    heal: str,
) -> None:
    """The rank-0 machine (its agent commits) loses its link while training (or only its route
    to etcd: it still reaches its peers, which still reach etcd): it fences itself, the survivor
    and the standby finish the job, ``latest`` never moves backwards; healed while the job
    trains, it waits as a standby; healed after the job ended, it leaves."""
    from elasticcluster import assert_same_model
    from nscluster import NsSimCluster

    from flashckpt.format.storage import Storage

    ns, etcd_url = net
    cluster = NsSimCluster(
        tmp_path / "job", ns, etcd_url, nnodes="2:2",
        worker_args=[*WORKER_ARGS, "--step-sleep", "0.4"],
    )  # fmt: skip
    latest = _LatestRecorder(cluster.storage_path)
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
        assert max(cluster.steps()) < STEPS - 30, "training ran out before the partition"
        # The machine of rank 0: its agent is the one that commits.
        victim_id = cluster.rank0_node()
        survivor = "n1" if victim_id == "n0" else "n0"
        victim = cluster.machines[victim_id]
        cut_at = time.time()
        if cut == "link":
            ns.machines[victim_id].partition()
        else:
            ns.machines[victim_id].cut_from(ns.hub_addr)  # where etcd runs

        cluster.wait_for("the fence", lambda: _events(victim, "fence_workers_stopped"), 90)
        fenced = _events(victim, "fenced")[0]
        stopped = _events(victim, "fence_workers_stopped")[0]
        assert fenced["pids"] and stopped["pids"] == fenced["pids"], victim.events()
        if cut == "etcd":  # its peers answered and said they reach etcd
            assert "alone is cut off from etcd" in fenced["reason"], fenced
        assert _events(victim, "agent_fenced"), "the node agent was not fenced"
        # The workers stopped because of the fence, not because a collective failed: torch saw
        # no failure of theirs (no restart counted), and they left no gloo error.
        assert not _events(victim, "workers_restart"), victim.events()
        # The workers' output goes to the launcher's (and torch's log directory, if any).
        worker_logs = "\n".join(
            [victim.tail(10**7)]
            + [
                p.read_text(errors="replace")
                for p in (cluster.root / f"torchlogs-{victim_id}").rglob("*")
                if p.is_file()
            ]
        )
        failure_words = ("error", "timed out", "exception", "failed", "closed by peer")
        gloo_errors = [
            line
            for line in worker_logs.lower().splitlines()
            if "gloo" in line and any(w in line for w in failure_words)
        ]
        assert not gloo_errors and "Traceback" not in worker_logs, worker_logs[-3000:]
        assert "FENCED" in victim.tail(10**6)

        # The rest of the job goes on with the standby.
        cluster.wait_for(
            "the new world to restore",
            lambda: {e["node"] for e in cluster.restored_since(cut_at)} == {survivor, "n2"},
            180,
        )
        if heal == "after_the_job":
            for node in (survivor, "n2"):
                assert cluster.wait_exit(node, 240) == 0, cluster.logs()
            assert victim.proc.poll() is None, "the cut-off machine did not wait for its link"
        healed_at = time.time()
        if cut == "link":
            ns.machines[victim_id].heal()
        else:
            ns.machines[victim_id].reconnect_to(ns.hub_addr)
        cluster.wait_for("the machine to register again", lambda: _events(victim, "rejoined"), 120)
        assert _events(victim, "rejoined")[0]["generation"] == 2
        for node in (survivor, "n2"):
            assert cluster.wait_exit(node, 240) == 0, cluster.logs()
        assert cluster.wait_exit(victim_id, 120) == 0, cluster.logs()
        if heal == "after_the_job":
            left = _events(victim, "left")
            assert left and "finished while this machine was cut off" in left[0]["reason"]
        else:  # it waited in the rendezvous as a standby until the job ended
            assert _events(victim, "standby_released"), victim.events()
        assert_same_model(cluster.out, reference_model)
        # The healed machine trained nothing more: it waited as a standby, or left.
        assert not [e for e in cluster.restored_since(cut_at) if e["node"] == victim_id]
        assert not [e for e in cluster.events() if e["node"] == victim_id and e["t"] > healed_at]

        seen = latest.close()
        assert seen == sorted(seen), f"latest moved backwards: {seen}"
        st = Storage(cluster.storage)
        committed = st.committed_steps()
        assert max(committed) == STEPS
        for step in committed:
            assert st.check_step(step).status == "ok", st.check_step(step)
            manifest = json.loads(st.fs.cat_file(st.step_path(step, "manifest.json")))
            if manifest["created"] > stopped["t"]:
                assert victim_id not in manifest["nodes"], (step, manifest["nodes"])
    finally:
        latest.close()
        cluster.close()
