"""The node agents replicate snapshots between machines (issue 11, agent side): two real agents
(separate processes, each with its own tmpfs and node id, one job), a real trainer on node ``a``;
node ``b`` holds ``a``'s newest snapshot, bitwise, hash-verified, newer replacing older.

Ports: ``b``'s replica server binds port 0 (the OS picks) and the test reads the actual port from
its ``status`` reply, then passes it to ``a`` in ``--replica-peers``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
from agentproc import AgentProc, agent_request, agent_status, start_agent
from fchelpers import FcEnv, machines, tinytrain_command
from waiting import wait_until

from flashckpt import names
from flashckpt.agent.daemon import AgentConfig, abandoned_segments
from flashckpt.format.shm import Slot

pytestmark = pytest.mark.timeout(600)


def _wait(cond: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    return wait_until(cond, what, timeout=timeout, interval=0.05)


_status = agent_status


class Agents:
    """Agent processes of one test, each of its own node; all killed at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[AgentProc] = []

    def start(self, env: FcEnv, *extra: str) -> tuple[AgentProc, Path]:
        log = self.tmp / f"agent-{env.node}-{time.monotonic_ns()}.log"
        p = start_agent(
            env, "--poll-interval", "0.05", "--log-file", str(log), *extra, idle_timeout=300
        )
        self.procs.append(p)
        return p, log

    def close(self) -> None:
        for p in self.procs:
            p.kill9()


@pytest.fixture
def two_nodes(fc_env: FcEnv, tmp_path: Path) -> Iterator[tuple[FcEnv, FcEnv, Agents]]:
    with machines(fc_env, tmp_path, ["a", "b"]) as (a, b):
        agents = Agents(tmp_path)
        try:
            yield a, b, agents
        finally:
            agents.close()


def _start_pair(
    a: FcEnv, b: FcEnv, agents: Agents, *a_extra: str
) -> tuple[AgentProc, Path, AgentProc, Path]:
    pb, log_b = agents.start(
        b, "--replica-listen", "127.0.0.1:0", "--replica-limit-bytes", str(64 * 2**20)
    )
    listen = _status(b)["replication"]["listen"]
    host, port = listen.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0, listen
    pa, log_a = agents.start(a, "--replica-peers", f"b={listen}", *a_extra)
    return pa, log_a, pb, log_b


def _train(env: FcEnv, tmp: Path, tag: str, *extra: str, background: bool = False) -> Any:
    cmd = tinytrain_command(env, tmp / f"{tag}.log", "--every", "3", "--quiet", *extra)
    err = open(tmp / f"{tag}.stderr", "wb")  # noqa: SIM115 (closed by the caller's wait)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    if background:
        return p
    try:
        rc = p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
        err.close()
    return rc, (tmp / f"{tag}.stderr").read_text()


def _newest_step(env: FcEnv) -> int:
    steps = [s for r in _status(env)["ranks"].values() for s in r["slots"] if s is not None]
    return max(steps)


def _replica_files(env: FcEnv) -> list[str]:
    prefix = names.slot_prefix(env.job, env.node) + "rep."
    return sorted(n for n in os.listdir(env.shm_dir) if n.startswith(prefix))


def _check_replica_equals_slot(a: FcEnv, b: FcEnv, step: int) -> None:
    """``b``'s replica of ``a``'s rank 0 is ``a``'s snapshot of ``step``, bitwise, hash-checked."""
    rep = Slot(names.replica_path(b.shm_dir, b.job, "b", "a", 0))
    try:
        rinfo = rep.header()
        assert rinfo is not None and rinfo.complete and rinfo.step == step
        rdata = bytes(rep.data(rinfo.data_len))
        rmeta = bytes(rep.buf[rep.meta_off : rep.meta_off + rinfo.meta_len])
        rhash = rep.recorded_hash(rinfo)
    finally:
        rep.close()
    found = False
    for i in range(2):
        s = Slot(names.slot_path(a.shm_dir, a.job, "a", 0, i))
        try:
            info = s.header()
            if info is None or not info.complete or info.step != step:
                continue
            found = True
            assert bytes(s.data(info.data_len)) == rdata
            assert bytes(s.buf[s.meta_off : s.meta_off + info.meta_len]) == rmeta
            assert rhash is not None and rhash == s.recorded_hash(info)
            assert xxhash.xxh3_64_intdigest(rdata) == rhash
        finally:
            s.close()
    assert found, f"node a holds no snapshot of step {step}"


def test_holder_keeps_the_newest_snapshot_bitwise(two_nodes: Any, tmp_path: Path) -> None:
    a, b, agents = two_nodes
    _, log_a, pb, _ = _start_pair(a, b, agents)
    rc, err = _train(a, tmp_path, "t1", "--steps", "12")
    assert rc == 0, err[-4000:]
    newest = _newest_step(a)

    def held() -> list[dict[str, Any]]:
        return [
            h for h in _status(b)["replication"]["held"] if h["sender"] == "a" and h["rank"] == 0
        ]

    _wait(lambda: any(h["step"] == newest for h in held()), f"b to hold a's step {newest}")
    _check_replica_equals_slot(a, b, newest)
    rep = os.path.basename(names.replica_path(b.shm_dir, b.job, "b", "a", 0))
    # the held replica, and the file it replaced kept as the next push's target
    assert rep in _replica_files(b) and set(_replica_files(b)) <= {rep, rep + ".spare"}
    sent = _status(a)["replication"]["sent"]
    assert [(s["target"], s["rank"], s["step"]) for s in sent] == [("b", 0, newest)]
    assert "replica of rank 0 step" in log_a.read_text()

    # A newer snapshot (the trainer resumes and trains on) replaces the older one: never two.
    rc, err = _train(a, tmp_path, "t2", "--steps", "21")
    assert rc == 0, err[-4000:]
    newer = _newest_step(a)
    assert newer > newest
    _wait(lambda: any(h["step"] == newer for h in held()), f"b to hold a's step {newer}")
    _check_replica_equals_slot(a, b, newer)
    assert len(held()) == 1 and _replica_files(b) == [rep, rep + ".spare"], _replica_files(b)
    assert _status(b)["replication"]["spare_bytes"] > 0

    # The holder's agent stopping (SIGTERM) removes every replica file it holds.
    pb.send_signal(signal.SIGTERM)
    assert pb.wait(timeout=120) == 0
    assert _replica_files(b) == []


def test_replicas_zero_pushes_nothing(two_nodes: Any, tmp_path: Path) -> None:
    a, b, agents = two_nodes
    _start_pair(a, b, agents, "--replicas", "0")
    rc, err = _train(a, tmp_path, "t", "--steps", "9")
    assert rc == 0, err[-4000:]
    # The newest snapshot is hashed (a trainer asks for it on a memory restore; the hash
    # thread records it on its own): by then a sender would have pushed it.
    step = _newest_step(a)
    slot_paths = [names.slot_path(a.shm_dir, a.job, "a", 0, i) for i in range(2)]

    def hashed() -> bool:
        for p in slot_paths:
            s = Slot(p)
            try:
                info = s.header()
                if info is not None and info.step == step and s.recorded_hash(info) is not None:
                    return True
            finally:
                s.close()
        return False

    _wait(hashed, "a's newest snapshot to be hashed")
    time.sleep(2.0)  # the window in which a push would have happened
    assert _status(b)["replication"]["held"] == []
    assert _replica_files(b) == []
    assert _status(a)["replication"] is None or _status(a)["replication"]["sent"] == []


def test_holder_killed_does_not_disturb_training(two_nodes: Any, tmp_path: Path) -> None:
    a, b, agents = two_nodes
    _, log_a, pb, _ = _start_pair(a, b, agents)
    trainer = _train(a, tmp_path, "t", "--steps", "60", "--step-sleep", "0.15", background=True)
    try:
        _wait(lambda: _status(b)["replication"]["held"], "b to hold a replica")
        pb.send_signal(signal.SIGKILL)
        pb.wait(timeout=30)
        rc = trainer.wait(timeout=300)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(timeout=30)
    assert rc == 0, (tmp_path / "t.stderr").read_text()[-4000:]
    st = _status(a)
    # Persistence went on: the final step is committed.
    lines = (tmp_path / "t.log").read_text().split()
    assert max(st["committed"]) >= 57, st["committed"]
    assert lines
    rep = st["replication"]
    _wait(lambda: _status(a)["replication"]["failures"] >= 1, "a to count the failed push")
    rep = _status(a)["replication"]
    assert all(e["target"] == "b" for e in rep["errors"]) and rep["errors"]
    assert "to b failed" in log_a.read_text()

    # The dead holder's replica files are found by the orphan sweep (the holder's prefix) and
    # removed by `flashckpt clean`.
    left = _replica_files(b)
    assert left, "b's replica file should be left by its SIGKILLed agent"
    groups = abandoned_segments(b.shm_dir, 0.0)
    mine = [g for g in groups if g.key == (b.job, "b")]
    assert mine and all(os.path.join(b.shm_dir, n) in mine[0].paths for n in left)
    clean = ["clean", "--shm-dir", b.shm_dir, "--job", b.job, "--older-than", "0"]
    out = subprocess.run(
        [sys.executable, "-m", "flashckpt", *clean],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert _replica_files(b) == []


def test_capacity_check_refuses_with_numbers(fc_env: FcEnv, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs a tmpfs of a set size (root)")
    with machines(fc_env, tmp_path, ["b"], "3m") as (env,):
        agents = Agents(tmp_path)
        try:
            # Two slots of the tiny model fit in 3 MiB (about 2.3 MiB); a replica's worth more
            # does not: the trainer's first snapshot fails at alloc, naming the numbers.
            agents.start(env, "--replica-listen", "127.0.0.1:0", "--replicas", "1")
            rc, err = _train(env, tmp_path, "t", "--steps", "6")
            assert rc != 0
            assert "ShmSpaceError" in err and "for the replicas of other machines" in err, err[
                -4000:
            ]
            assert "MiB available but this machine needs" in err
        finally:
            agents.close()


def test_replica_config_is_checked() -> None:
    ok = AgentConfig(
        job="j", node="a", replica_listen="0.0.0.0:0", replica_peers="b=10.0.0.2:7070, c=[::1]:1"
    )
    assert ok.replica_peer_addrs() == {"b": ("10.0.0.2", 7070), "c": ("::1", 1)}
    assert ok.replica_listen_addr() == ("0.0.0.0", 0)
    for bad, words in (
        ({"replica_peers": "a=10.0.0.2:1"}, "own node"),
        ({"replica_peers": "b=10.0.0.2"}, "host:port"),
        ({"replica_peers": "b=10.0.0.2:0"}, "1-65535"),
        ({"replica_peers": "b:10.0.0.2:1"}, "node=host:port"),
        ({"replica_peers": "b/c=h:1"}, "not a valid id"),
        ({"replica_peers": "b=h:1,b=h:2"}, "twice"),
        ({"replica_listen": "h:70000"}, "0-65535"),
        ({"replicas": -1}, "replicas=-1"),
        ({"replica_limit_bytes": -5}, "replica_limit_bytes"),
    ):
        with pytest.raises(ValueError, match=words):
            AgentConfig(job="j", node="a", **bad)


def _state_with_slots(tmp_path: Path, positions: int = 1, **cfg: Any) -> tuple[Any, list[Slot]]:
    """An agent's shared state holding ``positions`` positions with two real slot files each in
    ``tmp_path`` (the slots returned in order: position 0's two, then position 1's, ...)."""
    from flashckpt.agent.state import AgentState, RankRecord
    from flashckpt.format.shm import allocate_slot_file

    st = AgentState(
        AgentConfig(job="j", node="a", shm_dir=str(tmp_path), run_dir=str(tmp_path / "r"), **cfg)
    )
    slots = []
    for rank in range(positions):
        mine = []
        for i in range(2):
            p = names.slot_path(str(tmp_path), "j", "a", rank, i)
            allocate_slot_file(p, 4096, 1 << 16)
            mine.append(Slot(p))
        st.ranks[rank] = RankRecord(rank, slots=list(mine))
        slots += mine
    return st, slots


def test_pace_waits_while_a_trainer_copies_and_aborts_when_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import flashckpt.agent.replicas.holder as ar
    from flashckpt.agent.replicas.transport import ReplicaError

    monkeypatch.setattr(ar, "PACE_WAIT_S", 120.0)
    st, (sent, other) = _state_with_slots(tmp_path)
    seq = sent.begin_write()
    sent.end_write(seq, 3, b"{}", 100)
    info = sent.header()
    assert info is not None and info.complete
    pace = ar.Replicator(st)._pacer(sent, info)
    pace()  # no trainer copies: returns at once

    # A trainer copies into the other slot (seq odd): the transfer waits until it is done.
    wseq = other.begin_write()
    t = threading.Thread(target=pace)
    t.start()
    t.join(timeout=1.0)
    assert t.is_alive(), "pace did not wait while a trainer copied"
    other.end_write(wseq, 6, b"{}", 100)
    t.join(timeout=60)
    assert not t.is_alive()

    # The trainer overwrites the slot being sent: the transfer stops at its next chunk.
    sent.begin_write()
    with pytest.raises(ReplicaError, match="overwritten"):
        pace()
    # The agent stopping stops it too.
    pace2 = ar.Replicator(st)._pacer(other, other.header())  # type: ignore[arg-type]
    st.stopping.set()
    with pytest.raises(ReplicaError, match="stopping"):
        pace2()
    for s in (sent, other):
        s.close()


def test_derived_limit_follows_own_slot_bytes(tmp_path: Path) -> None:
    import flashckpt.agent.replicas.holder as ar
    from flashckpt.errors import ShmSpaceError

    st, slots = _state_with_slots(tmp_path, replicas=2, replica_listen="127.0.0.1:0")
    r = ar.Replicator(st)
    r.start_server()
    try:
        # before any alloc: holds none, and says "not ready" rather than "no room"
        assert r.store is not None and r.store.limit_bytes == 0 and r.store.pending
        r.check_capacity(10 * 2**20, 0)
        assert r.store.limit_bytes == 2 * 10 * 2**20 and not r.store.pending
        with pytest.raises(ShmSpaceError, match="for the replicas of other machines"):
            r.check_capacity(2**60, 0)
    finally:
        r.close()
        for s in slots:
            s.close()


def test_a_holder_not_ready_yet_is_asked_again_soon_not_failed(tmp_path: Path) -> None:
    """A job's first snapshot reached a holder before its trainers set up their slots: it was
    refused as "no room (limit 0.0 MiB)", counted as a failure and retried with a growing
    back-off. It is "not ready": retried after NOT_READY_RETRY_S, and then held."""
    import flashckpt.agent.replicas.holder as ar
    from flashckpt.agent.state import AgentState

    (tmp_path / "a").mkdir()
    st, (slot, _) = _state_with_slots(tmp_path / "a")
    seq = slot.begin_write()
    slot.write_meta(b"{}")
    slot.data(1000)[:] = b"x" * 1000
    slot.end_write(seq, 4, b"{}", 1000)
    info = slot.header()
    assert info is not None and info.complete
    slot.record_hash(info.seq, slot.data_hash(info))
    sender = ar.Replicator(st)
    (tmp_path / "b").mkdir()
    hst = AgentState(
        AgentConfig(
            job="j",
            node="b",
            shm_dir=str(tmp_path / "b"),
            run_dir=str(tmp_path / "rb"),
            replicas=1,
            replica_listen="127.0.0.1:0",
        )
    )
    holder = ar.Replicator(hst)
    holder.start_server()
    try:
        assert holder.server is not None and holder.store is not None
        addr = holder.server.address
        t0 = time.monotonic()
        sender.push("b", addr, slot.path, 0, info, "w1")
        assert sender.failures == 0 and sender.errors == []
        retry_in = sender._retry_at["b"] - t0
        assert 0 < retry_in <= ar.NOT_READY_RETRY_S + (time.monotonic() - t0)
        assert "b" not in sender._backoff
        assert holder.store.held() == []
        holder.check_capacity(1 << 20, 0)  # the holder's trainer allocated its slots
        sender.push("b", addr, slot.path, 0, info, "w1")
        held = holder.store.get("a", 0)
        assert held is not None and held.header.step == 4
        assert sender.failures == 0 and "b" not in sender._retry_at
    finally:
        holder.close()
        for s in st.ranks[0].slots:
            if s is not None:
                s.close()


def test_status_shows_replicas_sent_and_held() -> None:
    from flashckpt.monitor.statusview import format_status

    rep = {
        "listen": "127.0.0.1:7070",
        "sent": [{"target": "b", "rank": 0, "step": 12, "time": time.time() - 3}],
        "held": [{"sender": "c", "rank": 1, "step": 9}],
        "failures": 2,
    }
    out = format_status([{"job": "j", "node": "a", "replication": rep}])
    assert "replicas: sent b r0 step 12 (3 s ago); held c r1 step 9; 2 failed" in out


def test_replicas_of_machines_that_left_the_world_are_dropped(tmp_path: Path) -> None:
    import flashckpt.agent.replicas.holder as ar
    from flashckpt.agent.replicas.transport import HeldReplica, ReplicaHeader

    def hold(r: ar.Replicator, sender: str) -> str:
        assert r.store is not None
        path = names.replica_path(str(tmp_path), "j", "a", sender, 0)
        Path(path).write_bytes(b"x")
        h = ReplicaHeader("j", sender, 0, 3, "w", 2, 2, 10, 1, 0.0)
        r.store._held[(sender, 0)] = HeldReplica(h, path)
        return path

    st, slots = _state_with_slots(
        tmp_path, replica_listen="127.0.0.1:0", replica_peers="b=127.0.0.1:1"
    )
    r = ar.Replicator(st)
    r.start_server()
    try:
        kept, gone = hold(r, "b"), hold(r, "c")
        r.prune_departed()
        assert r.store is not None and [h.header.sender_node for h in r.store.held()] == ["b"]
        assert os.path.exists(kept) and not os.path.exists(gone)
    finally:
        r.close()
        for s in slots:
            s.close()
    # Without a peer list the world is unknown: nothing is dropped.
    (tmp_path / "x").mkdir()
    st2, slots2 = _state_with_slots(tmp_path / "x", replica_listen="127.0.0.1:0")
    r2 = ar.Replicator(st2)
    r2.start_server()
    try:
        path = names.replica_path(str(tmp_path / "x"), "j", "a", "c", 0)
        Path(path).write_bytes(b"x")
        assert r2.store is not None
        r2.store._held[("c", 0)] = HeldReplica(
            ReplicaHeader("j", "c", 0, 3, "w", 2, 2, 10, 1, 0.0), path
        )
        r2.prune_departed()
        assert len(r2.store.held()) == 1 and os.path.exists(path)
    finally:
        r2.close()
        for s in slots2:
            s.close()


# -- the launcher's peer list (replica_peers request, Replicator.set_peers) --------------------


_request = agent_request


def test_replica_peers_request_is_validated() -> None:
    from flashckpt.errors import ProtocolError
    from flashckpt.protocol.messages import (
        MAX_REPLICA_PEERS,
        ReplicaPeers,
        ReplicaPeersReply,
        parse_reply,
        parse_request,
    )

    good = {"id": 1, "op": "replica_peers", "peers": {"b": "10.0.0.2:7070", "c": "[fd00::3]:1"}}
    body = parse_request(good).body
    assert isinstance(body, ReplicaPeers)
    assert body.addresses() == {"b": ("10.0.0.2", 7070), "c": ("fd00::3", 1)}
    assert parse_request(body.to_json(1)).body == body
    reply = parse_reply("replica_peers", {"id": 1, "ok": True, "listen": "h:1", "targets": ["b"]})
    assert reply == ReplicaPeersReply(listen="h:1", targets=["b"])
    too_many = {f"n{i}": "h:1" for i in range(MAX_REPLICA_PEERS + 1)}
    for peers, words in (
        ({"b": "10.0.0.2"}, "not host:port"),
        ({"b": "10.0.0.2:0"}, "1-65535"),
        ({"b": "10.0.0.2:65536"}, "1-65535"),
        ({"b": "10.0.0.2:-1"}, "not host:port"),
        ({"b": ":7070"}, "not host:port"),
        ({"b": "a b:7070"}, "not host:port"),
        ({"b": "a/b:7070"}, "not host:port"),
        ({"b": "h:\uff17\uff10"}, "not host:port"),  # fullwidth digits
        ({"b": 7070}, "not dict"),
        ({"b/../x": "h:1"}, "not a valid id"),
        ({"": "h:1"}, "not a valid id"),
        (too_many, "more than"),
        (["b", "h:1"], "not dict"),
    ):
        with pytest.raises(ProtocolError, match=words):
            parse_request({"id": 2, "op": "replica_peers", "peers": peers})
    with pytest.raises(ProtocolError, match="missing field 'peers'"):
        parse_request({"id": 3, "op": "replica_peers"})
    with pytest.raises(ProtocolError, match="unknown field"):
        parse_request({"id": 4, "op": "replica_peers", "peers": {}, "evil": 1})


def test_agent_takes_the_launchers_peer_list_and_serves_on_after_bad_ones(
    fc_env: FcEnv, tmp_path: Path
) -> None:
    """A real agent: bad peer lists get a ProtocolError reply (nothing changes, the agent serves
    on); a good one is taken, shown in ``status`` and answered with the listen address and the
    targets; a new one replaces it."""
    from flashckpt.errors import AgentError

    with machines(fc_env, tmp_path, ["a"], "64m") as (a,):
        agents = Agents(tmp_path)
        try:
            p, _ = agents.start(a, "--replica-listen", "127.0.0.1:0")
            listen = _status(a)["replication"]["listen"]
            assert listen.startswith("127.0.0.1:") and int(listen.rsplit(":", 1)[1]) > 0
            for peers in (
                {"b": "127.0.0.1:0"},
                {"b": "x"},
                {"a": "127.0.0.1:7070"},  # its own node
                {"b;rm": "127.0.0.1:1"},
                "b=127.0.0.1:1",
            ):
                with pytest.raises(AgentError) as e:
                    _request(a, "replica_peers", peers=peers)
                assert e.value.kind == "ProtocolError", (peers, e.value)
                assert _status(a)["replication"]["peers"] == {}
            assert _request(a, "ping")["pid"] == p.pid
            got = _request(a, "replica_peers", peers={"c": "127.0.0.1:9", "b": "127.0.0.1:8"})
            assert got["listen"] == listen and got["targets"] == ["b"], got
            rep = _status(a)["replication"]
            assert rep["peers"] == {"b": "127.0.0.1:8", "c": "127.0.0.1:9"}
            assert rep["targets"] == ["b"]
            got = _request(a, "replica_peers", peers={"c": "127.0.0.1:9"})
            assert got["targets"] == ["c"] and _status(a)["replication"]["peers"] == {
                "c": "127.0.0.1:9"
            }
            got = _request(a, "replica_peers", peers={})
            assert got["targets"] == [] and _status(a)["replication"]["targets"] == []
            assert p.poll() is None
        finally:
            agents.close()


def test_peer_list_sent_at_runtime_replicates_and_a_new_list_redirects(
    fc_env: FcEnv, tmp_path: Path
) -> None:
    """Agent ``a`` starts without peers; the launcher's list (b) makes it send its newest
    snapshot to b; a new list (c instead of b) sends the same snapshot to c without a new
    snapshot, and a's sent record forgets b."""
    with machines(fc_env, tmp_path, ["a", "b", "c"], "128m") as (a, b, c):
        agents = Agents(tmp_path)
        try:
            listen = {}
            for env in (b, c):
                agents.start(
                    env, "--replica-listen", "127.0.0.1:0", "--replica-limit-bytes", str(2**25)
                )
                listen[env.node] = _status(env)["replication"]["listen"]
            agents.start(a, "--replica-listen", "127.0.0.1:0")
            rc, err = _train(a, tmp_path, "t", "--steps", "9")
            assert rc == 0, err[-4000:]
            newest = _newest_step(a)
            time.sleep(1.0)
            assert _status(a)["replication"]["sent"] == []  # no peers yet: nothing sent

            def held(env: FcEnv) -> list[int]:
                rep = _status(env)["replication"]
                return [h["step"] for h in rep["held"] if h["sender"] == "a" and h["rank"] == 0]

            got = _request(a, "replica_peers", peers={"b": listen["b"]})
            assert got["targets"] == ["b"]
            _wait(lambda: newest in held(b), f"b to hold a's step {newest}")
            _check_replica_equals_slot(a, b, newest)

            got = _request(a, "replica_peers", peers={"c": listen["c"]})
            assert got["targets"] == ["c"]
            _wait(lambda: newest in held(c), f"c to hold a's step {newest}")
            sent = _status(a)["replication"]["sent"]
            assert [(s["target"], s["step"]) for s in sent] == [("c", newest)], sent
        finally:
            agents.close()


def test_set_peers_replaces_and_prunes_departed_once_the_new_world_snapshotted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flashckpt.agent.replicas.holder as ar
    from flashckpt.agent.replicas.transport import HeldReplica, ReplicaHeader

    st, slots = _state_with_slots(tmp_path, replica_listen="127.0.0.1:0")
    r = ar.Replicator(st)
    r.start_server()

    def hold(sender: str) -> str:
        assert r.store is not None
        path = names.replica_path(str(tmp_path), "j", "a", sender, 0)
        Path(path).write_bytes(b"x")
        h = ReplicaHeader("j", sender, 0, 3, "w1", 2, 2, 10, 1, 0.0)
        r.store._held[(sender, 0)] = HeldReplica(h, path)
        return path

    def holds() -> list[str]:
        assert r.store is not None
        return [h.header.sender_node for h in r.store.held()]

    # Whether this machine's trainers have a complete, hashed snapshot of the current world
    # (the real one reads the slots; here the test says when the new world snapshotted).
    new_world_snapshot: list[Any] = []
    monkeypatch.setattr(r, "candidates", lambda: list(new_world_snapshot))
    try:
        for bad, words in (
            ({"a": ("127.0.0.1", 1)}, "own node"),
            ({"b": ("127.0.0.1", 0)}, "not host:port"),
            ({"b": ("", 1)}, "not host:port"),
            ({"b/x": ("h", 1)}, "not a valid id"),
            ({f"n{i}": ("h", 1) for i in range(ar.MAX_PEERS + 1)}, "more than"),
        ):
            with pytest.raises(ValueError, match=words):
                r.set_peers(bad)
            assert r.peers == {}
        st.world_id = "w1"
        assert r.set_peers({"b": ("127.0.0.1", 1), "c": ("127.0.0.1", 2)}) == ["b"]
        first = r.peers
        r._done[("b", 0)] = ("p", 1, 3)  # b took step 3
        gone, kept = hold("c"), hold("b")
        newcomer = hold("d")  # a machine this agent has not heard of yet (its list is late)
        # c leaves (the launcher's next round): the list is replaced whole, the old dict as it was.
        assert r.set_peers({"b": ("127.0.0.1", 1)}) == ["b"]
        assert first == {"b": ("127.0.0.1", 1), "c": ("127.0.0.1", 2)} and r.peers is not first
        assert r._done == {}  # the newest snapshot goes to the targets again
        # The new world has no snapshot here yet: a replacement may restore c's ranks from it.
        r.prune_departed()
        assert holds() == ["b", "c", "d"]
        st.world_id = "w2"  # the new world's trainers said hello ...
        r.prune_departed()
        assert holds() == ["b", "c", "d"]
        new_world_snapshot.append(("slot", 0, None, "w2"))  # ... and took a snapshot
        r.prune_departed()
        assert holds() == ["b", "d"]
        assert os.path.exists(kept) and os.path.exists(newcomer) and not os.path.exists(gone)
        # b leaves too, d is named: b's replica goes, d's stays.
        st.world_id = "w3"
        assert r.set_peers({"d": ("127.0.0.1", 4)}) == ["d"]
        assert holds() == ["b", "d"]  # until the next world snapshotted here
        st.world_id = "w4"
        r.prune_departed()
        assert holds() == ["d"]
        assert r.status() is not None and r.status()["peers"] == {"d": "127.0.0.1:4"}  # type: ignore[index]
    finally:
        r.close()
        for s in slots:
            s.close()


def test_replicas_of_an_older_world_no_push_replaces_are_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Senders still in the world, but: one no longer sends here (the ring changed), one numbers
    its ranks anew (its replicas of the current world come under another rank). Their old
    world's replicas go once the current world snapshotted here and, for the renumbered one, it
    sent two steps of the current world; a sender whose current push has not come yet keeps
    its old replica."""
    import flashckpt.agent.replicas.holder as ar
    from flashckpt.agent.replicas.transport import HeldReplica, ReplicaHeader

    st, slots = _state_with_slots(tmp_path, replica_listen="127.0.0.1:0")
    r = ar.Replicator(st)
    r.start_server()

    def hold(sender: str, rank: int, step: int, world: str) -> None:
        assert r.store is not None
        path = names.replica_path(str(tmp_path), "j", "a", sender, rank)
        Path(path).write_bytes(b"x")
        h = ReplicaHeader("j", sender, rank, step, world, 2, 2, 10, 1, 0.0)
        r.store._held[(sender, rank)] = HeldReplica(h, path)

    def holds() -> list[tuple[str, int, int, str]]:
        assert r.store is not None
        return sorted(
            (h.header.sender_node, h.header.rank, h.header.step, h.header.world)
            for h in r.store.held()
        )

    new_world_snapshot: list[Any] = []
    monkeypatch.setattr(r, "candidates", lambda: list(new_world_snapshot))
    try:
        st.world_id = "w1"
        # World a, b, c, d (ring a -> b -> c -> d -> a): a holds d's replicas.
        r.set_peers({n: ("127.0.0.1", i + 1) for i, n in enumerate("bcd")})
        hold("d", 3, 5, "w1")
        hold("d", 7, 5, "w1")  # d's second rank
        # World w2 is a, c, d, z (ring a -> c -> d -> z -> a): d sends to z now, so no push
        # replaces d's replicas here; z sends here.
        st.world_id = "w2"
        r.set_peers({n: ("127.0.0.1", i + 1) for i, n in enumerate("cdz")})
        hold("z", 0, 6, "w1")  # z's replica of w1 (it sent here in w1 too)
        assert len(holds()) == 3
        r.prune()
        assert len(holds()) == 3, "dropped before the current world snapshotted here"
        new_world_snapshot.append(("slot", 0, None, "w2"))
        r.prune()
        # d no longer sends here: gone. z still sends here: its old replica stays until its
        # pushes of w2 come (two steps: a round of every rank).
        assert holds() == [("z", 0, 6, "w1")]
        hold("z", 1, 8, "w2")  # z's ranks numbered anew: rank 1 now
        r.prune()
        assert holds() == [("z", 0, 6, "w1"), ("z", 1, 8, "w2")], "one step of w2 is no round"
        hold("z", 1, 9, "w2")  # the next push replaces the previous one
        r.prune()
        assert holds() == [("z", 1, 9, "w2")]
    finally:
        r.close()
        for s in slots:
            s.close()


def test_a_taken_replica_port_takes_another_and_an_unusable_address_runs_without(
    tmp_path: Path,
) -> None:
    """The launcher gives an agent started again its previous replica port: taken meanwhile,
    the agent listens on another one (the launcher reads it back); an address that is not this
    machine's leaves the agent without replicas, never without its checkpoints."""
    import socket

    import flashckpt.agent.replicas.holder as ar

    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        st, slots = _state_with_slots(tmp_path, replica_listen=f"127.0.0.1:{port}")
        r = ar.Replicator(st)
        r.start_server()
        try:
            assert r.server is not None and r.store is not None
            host, got = r.server.address
            assert host == "127.0.0.1" and got not in (0, port)
        finally:
            r.close()
            for s in slots:
                s.close()
    finally:
        taken.close()
    (tmp_path / "x").mkdir()
    st, slots = _state_with_slots(tmp_path / "x", replica_listen="192.0.2.1:0")  # TEST-NET-1
    r = ar.Replicator(st)
    r.start_server()
    try:
        assert r.server is None and r.store is None
        assert r.status() is not None and r.status()["listen"] is None  # type: ignore[index]
        r.check_capacity(2**20, 0)  # no store: nothing to check, no error
    finally:
        r.close()
        for s in slots:
            s.close()


def _held_replica(
    shm: str,
    holder_shm: str,
    *,
    holder: str = "h",
    sender: str = "b",
    step: int = 8,
    world: str = "w1",
) -> tuple[Any, Any]:
    """A replica server (node ``holder``) holding machine ``sender``'s rank 1 ``step`` of
    ``world`` (1 MiB of data)."""
    import json

    from flashckpt.agent.replicas.transport import ReplicaServer, ReplicaStore, push_replica
    from flashckpt.format.shm import allocate_slot_file

    path = names.slot_path(shm, "j", sender, 0, 0)
    meta, data = json.dumps({"step": step}).encode(), os.urandom(2**20)
    allocate_slot_file(path, len(meta), len(data))
    slot = Slot(path)
    seq = slot.begin_write()
    slot.write_meta(meta)
    slot.data(len(data))[:] = data
    slot.end_write(seq, step, meta, len(data))
    info = slot.header()
    assert info is not None
    slot.record_hash(info.seq, slot.data_hash(info))
    store = ReplicaStore(holder_shm, "j", holder, limit_bytes=2**30)
    server = ReplicaServer(store, timeout=30)
    push_replica(server.address, slot, job="j", node=sender, rank=1, world=world)
    slot.close()
    os.unlink(path)
    return store, server


def test_a_look_prefers_the_newer_worlds_replica_over_an_abandoned_timelines_higher_step(
    tmp_path: Path,
) -> None:
    """Holder ``h1`` still has rank 1's step 40 of world w1 (machine ``x`` held rank 1 then);
    after a rollback to step 10, world w2 put rank 1 on machine ``y``, whose step 12 is on
    ``h2``. The look offers the replica taken last (w2's step 12), not the higher number."""
    import socket

    from flashckpt.agent.replicas.pull import Puller
    from flashckpt.agent.state import Conn
    from flashckpt.protocol.messages import PullReplica, PullReplicaReply

    for d in ("s", "h1", "h2"):
        (tmp_path / d).mkdir()
    st1, sv1 = _held_replica(
        str(tmp_path / "s"), str(tmp_path / "h1"), holder="h1", sender="x", step=40, world="w1"
    )
    time.sleep(0.01)  # completed later on its machine's clock
    st2, sv2 = _held_replica(
        str(tmp_path / "s"), str(tmp_path / "h2"), holder="h2", sender="y", step=12, world="w2"
    )
    st, slots = _state_with_slots(tmp_path)
    a, b = socket.socketpair()
    conn = Conn(a)
    conn.ranks.add(0)
    rec = st.ranks[0]
    rec.conn, rec.global_rank, rec.world_id, st.world_id = conn, 1, "w3", "w3"
    try:
        puller = Puller(st, lambda: {"h1": sv1.address, "h2": sv2.address})
        reply = puller.pull(conn, PullReplica(rank=1, local_rank=0, world_size=2, fetch=False))
        assert isinstance(reply, PullReplicaReply) and reply.found, reply
        assert (reply.holder, reply.sender, reply.step, reply.world_id) == ("h2", "y", 12, "w2")
    finally:
        for sv, store in ((sv1, st1), (sv2, st2)):
            sv.close()
            store.close()
        for s in slots:
            s.close()
        a.close()
        b.close()


def test_pulls_in_flight_count_in_every_room_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two positions: a pull into position 0 has allocated its incoming file (not installed
    yet) when a pull into position 1 and a trainer's alloc check their room: both count that
    file as the slot it will become (and as present in the tmpfs). And no two checks run at
    once: one whose allocation is slow holds the other's check until its file is counted."""
    import threading

    import flashckpt.agent.replicas.pull as ap
    from flashckpt.agent.replicas.transport import ReplicaHeader
    from flashckpt.agent.segments import Segments, slot_file_bytes

    st, slots = _state_with_slots(tmp_path, positions=2)
    slots0 = slots[:2]
    rec0, rec1 = st.ranks[0], st.ranks[1]
    size = slots0[0].size
    seen: list[tuple[int, int]] = []
    st.capacity_check = lambda own, present: seen.append((own, present))
    puller = ap.Puller(st, dict)
    h = ReplicaHeader("j", "x", 1, 8, "w1", 2, 4096, 1 << 20, 1, 0.0)
    big = slot_file_bytes(h.meta_len, h.data_len)
    in0, in1 = (str(tmp_path / f"in{i}.tmp-pull") for i in range(2))
    allocated = threading.Event()
    release = threading.Event()
    real_allocate = ap.allocate_slot_file

    def slow_allocate(path: str, meta_len: int, data_len: int) -> None:
        real_allocate(path, meta_len, data_len)
        if path == in0:
            allocated.set()
            release.wait(60)

    monkeypatch.setattr(ap, "allocate_slot_file", slow_allocate)
    first = threading.Thread(target=puller.reserve, args=(rec0, 0, in0, h))
    first.start()
    try:
        assert allocated.wait(60)
        second = threading.Thread(target=puller.reserve, args=(rec1, 1, in1, h))
        second.start()
        second.join(1.0)
        assert second.is_alive(), "a second room check ran while the first took its room"
        release.set()
        first.join(60)
        second.join(60)
        # The first saw 4 slots with its own replacing rec0's slot 0; the second saw the
        # first's file as rec0's slot 0 (and present), its own replacing rec1's slot 1.
        assert seen == [(3 * size + big, 4 * size), (2 * size + 2 * big, 4 * size + big)]
        assert set(st.incoming) == {in0, in1}
        # A trainer's alloc of position 1 (same capacities as its slots: kept) counts both.
        del st.incoming[in1]
        own, present = Segments(st).slot_bytes_after(rec1, 4096, 1 << 16, set())
        assert (own, present) == (3 * size + big, 4 * size + big)
    finally:
        release.set()
        first.join(60)
        for s in slots:
            s.close()


def test_a_pull_runs_allocs_capacity_check_and_refuses_with_the_numbers(tmp_path: Path) -> None:
    """A pulled replica becomes one of the position's slots: like a trainer's alloc, the pull
    first checks that this machine's slots after it plus the replicas it holds fit the tmpfs
    (the same check, the same numbers), and refuses with a clear error, leaving the position's
    slots as they were and no file behind."""
    import socket

    import flashckpt.agent.replicas.holder as ar
    from flashckpt.agent.replicas.pull import Puller
    from flashckpt.agent.segments import slot_file_bytes
    from flashckpt.agent.state import Conn
    from flashckpt.errors import ShmSpaceError
    from flashckpt.protocol.messages import ErrorReply, PullReplica

    (tmp_path / "h").mkdir()
    (tmp_path / "s").mkdir()
    store, server = _held_replica(str(tmp_path / "s"), str(tmp_path / "h"))
    st, slots = _state_with_slots(
        tmp_path, replicas=1, replica_listen="127.0.0.1:0", replica_limit_bytes=2**60
    )
    a, b = socket.socketpair()
    conn = Conn(a)
    conn.ranks.add(0)
    rec = st.ranks[0]
    rec.conn, rec.global_rank, rec.world_id, st.world_id = conn, 1, "w1", "w1"
    r = ar.Replicator(st)
    r.start_server()
    try:
        req = PullReplica(rank=1, local_rank=0, world_size=2, fetch=True)
        puller = Puller(st, lambda: {"h": server.address})
        # The agent's own check (a replica limit far beyond the tmpfs): refused, with numbers.
        st.capacity_check = r.check_capacity
        reply = puller.pull(conn, req)
        assert isinstance(reply, ErrorReply) and reply.kind == "ShmSpaceError", reply
        assert "for the replicas of other machines" in reply.error, reply.error
        assert "rank 1 step 8" in reply.error and "'h'" in reply.error, reply.error
        assert rec.slots == slots  # untouched
        assert not [n for n in os.listdir(tmp_path) if "tmp-pull" in n]
        # The numbers are alloc's: every slot of the machine once the pull replaced the slot
        # it goes into (0: the older of two empty slots), and the slot files present now.
        seen: list[tuple[int, int]] = []

        def check(own: int, present: int) -> None:
            seen.append((own, present))
            raise ShmSpaceError("no room (test)")

        st.capacity_check = check
        reply = puller.pull(conn, req)
        assert isinstance(reply, ErrorReply) and "no room (test)" in reply.error
        size = slots[0].size
        held = store.held()[0].header
        assert seen == [(size + slot_file_bytes(held.meta_len, held.data_len), 2 * size)]
    finally:
        r.close()
        server.close()
        store.close()
        for s in slots:
            s.close()
        a.close()
        b.close()
