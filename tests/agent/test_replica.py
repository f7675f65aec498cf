"""Replicas between node agents (flashckpt/agent/replicas/transport.py): real slot files in a tmpfs
of the test's own, real TCP on 127.0.0.1, real hashes. The agent integration builds on these
guarantees: a replica is kept only whole and verified, a newer one replaces an older one only once
complete,
and nothing a peer sends is trusted."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from fchelpers import private_shm

from flashckpt import names
from flashckpt.agent.replicas.transport import (
    FRAME_MAGIC,
    ReplicaError,
    ReplicaHeader,
    ReplicaNotReady,
    ReplicaServer,
    ReplicaStore,
    check_replica_capacity,
    fetch_replica,
    push_replica,
    query_replicas,
    replica_targets,
)
from flashckpt.errors import CorruptSnapshotError, ShmSpaceError
from flashckpt.format.shm import Slot, allocate_slot_file, shm_free_bytes

JOB = "jrep"


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[str]:
    with private_shm(tmp_path / "shm", size="64m") as d:
        yield d


def _snapshot(shm_dir: str, node: str, rank: int, step: int, data: bytes) -> Slot:
    """A trainer-style complete snapshot in a slot of ``node``, hashed as the agent does."""
    path = names.slot_path(shm_dir, JOB, node, rank, 0)
    meta = json.dumps({"step": step, "rank": rank}).encode()
    allocate_slot_file(path, len(meta), len(data))
    slot = Slot(path)
    seq = slot.begin_write()
    slot.write_meta(meta)
    slot.data(len(data))[:] = data
    slot.end_write(seq, step, meta, len(data))
    info = slot.header()
    assert info is not None and info.complete
    slot.record_hash(info.seq, slot.data_hash(info))
    return slot


@pytest.fixture
def holder(shm: str) -> Iterator[tuple[ReplicaStore, ReplicaServer]]:
    store = ReplicaStore(shm, JOB, "nB", limit_bytes=32 * 2**20)
    server = ReplicaServer(store, chunk_bytes=64 * 1024, timeout=10)
    try:
        yield store, server
    finally:
        server.close()
        store.close()


def _push(
    server: ReplicaServer, slot: Slot, rank: int = 0, world: str = "w1", **kw: object
) -> ReplicaHeader:
    return push_replica(
        server.address, slot, job=JOB, node="nA", rank=rank, world=world, chunk_bytes=50_000, **kw
    )


def test_push_keeps_a_verified_copy_and_fetch_returns_it_bitwise(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer]
) -> None:
    store, server = holder
    data = os.urandom(3 * 2**20 + 123)  # not a multiple of the chunk
    slot = _snapshot(shm, "nA", 0, 7, data)
    h = _push(server, slot)
    held = store.get("nA", 0)
    assert held is not None and held.header == h and h.step == 7
    assert os.path.basename(held.path) == f"fc.{JOB}.nB.rep.nA.r00000"
    # The held copy is a slot like a trainer's, with its hash record: restore reads it the same.
    rep = Slot(held.path)
    try:
        info = rep.header()
        assert info is not None and info.complete and info.step == 7
        assert bytes(rep.data(info.data_len)) == data
        assert rep.verify_data(info) is True
        assert rep.read_meta(info) == {"step": 7, "rank": 0}
    finally:
        rep.close()
    got = fetch_replica(server.address, job=JOB, sender_node="nA", rank=0, chunk_bytes=40_000)
    assert got is not None and got.header == h
    assert bytes(got.data) == data and json.loads(got.meta) == {"step": 7, "rank": 0}
    assert fetch_replica(server.address, job=JOB, sender_node="nA", rank=1) is None
    assert fetch_replica(server.address, job=JOB, sender_node="nA", rank=0, min_step=8) is None
    slot.close()


def test_a_newer_step_replaces_the_older_one_and_an_older_one_is_refused(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer]
) -> None:
    store, server = holder
    s1 = _snapshot(shm, "nA", 0, 4, b"a" * 100_000)
    _push(server, s1)
    s1.close()
    s2 = _snapshot(shm, "nA", 0, 6, b"b" * 200_000)
    _push(server, s2)
    held = store.held()
    assert [(x.header.sender_node, x.header.step) for x in held] == [("nA", 6)]
    # the replaced file is kept as the next push's target, not counted as held
    name = f"fc.{JOB}.nB.rep.nA.r00000"
    assert sorted(n for n in os.listdir(shm) if ".rep." in n) == [name, name + ".spare"]
    assert store.held_bytes() == held[0].header.nbytes and store.spare_bytes() > 0
    s2.close()
    s3 = _snapshot(shm, "nA", 0, 5, b"c" * 1000)
    with pytest.raises(ReplicaError, match=r"holds step 6 .* step 5 of the same world is older"):
        _push(server, s3)
    s3.close()
    got = fetch_replica(server.address, job=JOB, sender_node="nA", rank=0)
    assert got is not None and got.header.step == 6 and bytes(got.data) == b"b" * 200_000


def test_a_push_of_the_same_size_writes_into_the_spare_and_spares_yield_their_room(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer]
) -> None:
    """A replaced replica's file is the next push's target (pages allocated and mapped once,
    not per push); a fetch of the held one never finds no file; spares are released whenever
    their room is wanted, on prune and on close."""
    store, server = holder
    final = os.path.join(shm, f"fc.{JOB}.nB.rep.nA.r00000")
    blobs = [os.urandom(400_000) for _ in range(4)]
    inodes = []
    for step, blob in enumerate(blobs[:3], start=1):
        s = _snapshot(shm, "nA", 0, step, blob)
        _push(server, s)
        s.close()
        inodes.append(os.stat(final).st_ino)
        got = fetch_replica(server.address, job=JOB, sender_node="nA", rank=0)
        assert got is not None and got.header.step == step and bytes(got.data) == blob
    # push 3 went into the file push 1 had: two files take turns
    assert inodes[2] == inodes[0] != inodes[1]
    assert os.stat(final + ".spare").st_ino == inodes[1]
    # a fetch racing the pushes always finds a complete replica (old or new), never no file
    stop, seen, errors = threading.Event(), set(), []

    def fetcher() -> None:
        while not stop.is_set():
            try:
                r = fetch_replica(server.address, job=JOB, sender_node="nA", rank=0)
            except ReplicaError as e:  # a fetch of the old one overtaken by the next push
                if "changed while sent" not in str(e) and "no longer complete" not in str(e):
                    errors.append(str(e))
                continue
            if r is None:
                errors.append("no replica held")
            else:
                assert bytes(r.data) == blobs[(r.header.step - 1) % 2 + 2]
                seen.add(r.header.step)

    t = threading.Thread(target=fetcher)
    t.start()
    try:
        for step in range(4, 12):
            s = _snapshot(shm, "nA", 0, step, blobs[(step - 1) % 2 + 2])
            _push(server, s)
            s.close()
    finally:
        stop.set()
        t.join(timeout=60)
    assert errors == [] and seen
    # the room is wanted: spares go first
    assert store.spare_bytes() > 0
    assert store.drop_spares() > 0 and store.spare_bytes() == 0
    assert not os.path.exists(final + ".spare")
    s = _snapshot(shm, "nA", 0, 20, blobs[0])
    _push(server, s)  # no spare: a new file, then the replaced one is the spare again
    s.close()
    assert os.path.exists(final + ".spare")
    store.prune(())
    assert [n for n in os.listdir(shm) if ".rep." in n] == []


def test_a_push_short_of_tmpfs_room_takes_the_spares_room(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer], tmp_path: Path
) -> None:
    store, server = holder
    for step in (1, 2):
        s = _snapshot(shm, "nA", 0, step, b"s" * (12 << 20))
        _push(server, s)
        s.close()
    spare = store.spare_bytes()
    assert spare > 12 << 20
    s = _snapshot(shm, "nA", 1, 2, b"t" * (10 << 20))
    filler = os.path.join(shm, "filler")
    fd = os.open(filler, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        # leave less free than the next replica needs, but enough once the spare is released
        os.posix_fallocate(fd, 0, shm_free_bytes(shm) - (6 << 20))
        _push(server, s, rank=1)
    finally:
        s.close()
        os.close(fd)
        os.unlink(filler)
    assert store.get("nA", 1) is not None and store.get("nA", 0) is not None
    assert store.spare_bytes() == 0


def test_after_a_rollback_the_new_worlds_older_step_replaces_the_abandoned_timelines(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer]
) -> None:
    """A job restored from an older step (storage fallback) is a new world whose steps are lower
    than the abandoned timeline's: its replicas must replace the old world's (else a later loss
    finds only the abandoned timeline's replica); within the new world older steps stay
    refused, and a late push of the world that ended does not replace the new one."""
    store, server = holder
    late = _snapshot(shm, "nA", 7, 42, b"z" * 1000)  # the ended world's, completed first
    s40 = _snapshot(shm, "nA", 0, 40, b"a" * 100_000)
    _push(server, s40, world="w1")
    s40.close()
    s10 = _snapshot(shm, "nA", 0, 10, b"b" * 200_000)
    _push(server, s10, world="w2")
    s10.close()
    held = store.held()
    assert [(x.header.step, x.header.world) for x in held] == [(10, "w2")]
    got = fetch_replica(server.address, job=JOB, sender_node="nA", rank=0)
    assert got is not None and got.header.step == 10 and bytes(got.data) == b"b" * 200_000
    s12 = _snapshot(shm, "nA", 0, 12, b"c" * 1000)
    _push(server, s12, world="w2")
    s12.close()
    s8 = _snapshot(shm, "nA", 0, 8, b"d" * 1000)
    with pytest.raises(ReplicaError, match=r"holds step 12 .* step 8 of the same world is older"):
        _push(server, s8, world="w2")
    s8.close()
    with pytest.raises(ReplicaError, match=r"world 'w2'.*world that ended"):
        _push(server, late, world="w1")  # sent as rank 0's, late
    late.close()
    assert [(x.header.step, x.header.world) for x in store.held()] == [(12, "w2")]


def test_a_corrupted_transfer_is_discarded_and_the_older_replica_stays(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer]
) -> None:
    store, server = holder
    s1 = _snapshot(shm, "nA", 0, 2, b"x" * 300_000)
    _push(server, s1)
    s1.close()
    s2 = _snapshot(shm, "nA", 0, 4, b"y" * 300_000)
    info = s2.header()
    assert info is not None
    s2.data(info.data_len)[1000] ^= 0xFF  # flipped after hashing: the hash no longer matches
    with pytest.raises(CorruptSnapshotError, match="corrupted in this machine's memory"):
        _push(server, s2, info=info)
    s2.close()
    held = store.get("nA", 0)
    assert held is not None and held.header.step == 2
    assert not [n for n in os.listdir(shm) if n.endswith(".in")]
    assert store.held_bytes() == held.header.nbytes
    assert any("or in the sender's memory" in e for e in server.errors)


def test_bytes_corrupted_on_the_wire_are_caught_by_the_holder(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer]
) -> None:
    store, server = holder
    data = os.urandom(200_000)
    h = ReplicaHeader(JOB, "nA", 0, 5, "w", 10, 2, len(data), xxhash.xxh3_64_intdigest(data), 0.0)
    bad = bytearray(data)
    bad[777] ^= 0x10
    with socket.create_connection(server.address, timeout=10) as s:
        s.sendall(_frame({"op": "push", "header": h.to_json()}))
        assert s.recv(100)  # "go"
        s.sendall(b"{}" + bytes(bad) + _frame({"end": "ok"}))
        head = s.recv(12)
        reply = json.loads(s.recv(struct.unpack("<8sI", head)[1]))
    assert reply["ok"] is False and "corrupted in transfer" in str(reply["error"])
    assert store.held() == [] and not [n for n in os.listdir(shm) if ".rep." in n]


def test_a_snapshot_overwritten_while_sent_is_aborted(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer]
) -> None:
    store, server = holder
    slot = _snapshot(shm, "nA", 0, 3, os.urandom(2 * 2**20))
    calls = []

    def overwrite() -> None:  # the trainer starts its next snapshot into this slot mid-transfer
        calls.append(1)
        if len(calls) == 3:
            slot.begin_write()

    with pytest.raises(ReplicaError, match="overwritten while being sent"):
        _push(server, slot, pace=overwrite)
    assert store.get("nA", 0) is None
    assert not [n for n in os.listdir(shm) if ".rep." in n]
    slot.close()


def test_fetch_detects_a_replica_corrupted_in_the_holders_memory(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer]
) -> None:
    store, server = holder
    slot = _snapshot(shm, "nA", 1, 9, os.urandom(500_000))
    _push(server, slot, rank=1)
    slot.close()
    held = store.get("nA", 1)
    assert held is not None
    rep = Slot(held.path)
    rep.data(10)[5] ^= 0x01  # a bit flips in the holder's memory
    rep.close()
    with pytest.raises(
        CorruptSnapshotError, match=r"rank 1 \(machine 'nA'\) step 9 .* not loaded"
    ) as e:
        fetch_replica(server.address, job=JOB, sender_node="nA", rank=1)
    assert (e.value.rank, e.value.step, e.value.source) == (1, 9, "{}:{}".format(*server.address))


def test_the_holder_refuses_what_it_must_not_keep(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer]
) -> None:
    store, server = holder
    slot = _snapshot(shm, "nA", 0, 1, b"z" * 10_000)
    with pytest.raises(ReplicaError, match="of job 'other'"):
        push_replica(server.address, slot, job="other", node="nA", rank=0, world="w")
    with pytest.raises(ReplicaError, match="its own snapshot"):
        push_replica(server.address, slot, job=JOB, node="nB", rank=0, world="w")
    store.pending = True  # the limit derives from own slots not set up yet: not ready, no failure
    with pytest.raises(ReplicaNotReady, match="cannot hold replicas yet"):
        _push(server, slot)
    store.set_limit(8192)  # smaller than one replica
    with pytest.raises(ReplicaError, match=r"no room: .* the limit is") as no_room:
        _push(server, slot)
    assert not isinstance(no_room.value, ReplicaNotReady)
    assert store.held() == [] and store.held_bytes() == 0
    # An unhashed snapshot is never sent (the hash is what the holder checks it against).
    s2 = _snapshot(shm, "nA", 1, 1, b"q" * 100)
    s2.record_hash(0, 0)
    with pytest.raises(ReplicaError, match="no data hash yet"):
        _push(server, s2, rank=1)
    slot.close()
    s2.close()


def _raw(server: ReplicaServer, payload: bytes) -> dict[str, object]:
    with socket.create_connection(server.address, timeout=10) as s:
        s.sendall(payload)
        head = s.recv(12)
        magic, n = struct.unpack("<8sI", head)
        assert magic == FRAME_MAGIC
        body = b""
        while len(body) < n:
            body += s.recv(n - len(body))
        return json.loads(body)


def _frame(obj: object) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("<8sI", FRAME_MAGIC, len(body)) + body


@pytest.mark.parametrize(
    ("request_obj", "why"),
    [
        ({"op": "nope"}, "unknown replica op"),
        ({"op": "push", "header": []}, "not a JSON object"),
        ({"op": "push", "header": {"job": JOB}}, "'sender_node' is missing"),
        (
            {
                "op": "push",
                "header": {
                    "job": JOB,
                    "sender_node": "../x",
                    "world": "w",
                    "rank": 0,
                    "step": 1,
                    "seq": 2,
                    "meta_len": 1,
                    "data_len": 1,
                    "data_hash": 0,
                    "time_complete": 0.0,
                },
            },
            "not a valid id",
        ),
        (
            {
                "op": "push",
                "header": {
                    "job": JOB,
                    "sender_node": "nA",
                    "world": "w",
                    "rank": 0,
                    "step": 1,
                    "seq": 2,
                    "meta_len": 2**40,
                    "data_len": 1,
                    "data_hash": 0,
                    "time_complete": 0.0,
                },
            },
            "'meta_len'",
        ),
        ({"op": "fetch", "job": JOB, "sender_node": "nA", "rank": "0"}, "integers"),
    ],
)
def test_bad_requests_get_a_reason_and_the_server_lives_on(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer], request_obj: object, why: str
) -> None:
    store, server = holder
    reply = _raw(server, _frame(request_obj))
    assert reply["ok"] is False and why in str(reply["error"])
    # Garbage that is not even a frame, and an oversized frame length: the server answers
    # or drops the connection, never dies.
    with socket.create_connection(server.address, timeout=10) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        s.recv(100)
    with socket.create_connection(server.address, timeout=10) as s:
        s.sendall(struct.pack("<8sI", FRAME_MAGIC, 2**31))
        s.recv(100)
    slot = _snapshot(shm, "nA", 0, 1, b"ok" * 1000)
    assert _push(server, slot).step == 1  # still serving
    slot.close()
    assert store.held_bytes() > 0


def test_a_sender_that_vanishes_mid_transfer_leaves_nothing(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer]
) -> None:
    store, server = holder
    h = ReplicaHeader(JOB, "nA", 0, 5, "w", 10, 4, 1_000_000, 0, 0.0)
    with socket.create_connection(server.address, timeout=10) as s:
        s.sendall(_frame({"op": "push", "header": h.to_json()}))
        assert s.recv(100)  # "go"
        s.sendall(b"meta" + b"\0" * 1000)  # then the sender's machine dies
    deadline = threading.Event()
    for _ in range(100):
        if not [n for n in os.listdir(shm) if n.endswith(".in")] and store.held_bytes() == 0:
            break
        deadline.wait(0.1)
    assert store.held() == [] and store.held_bytes() == 0
    assert not [n for n in os.listdir(shm) if ".rep." in n]


def test_replica_targets_follow_the_ring_and_never_the_machine_itself() -> None:
    world = ["n2", "n0", "n1"]
    assert replica_targets(world, "n0", 1) == ["n1"]
    assert replica_targets(world, "n2", 1) == ["n0"]
    assert replica_targets(world, "n1", 2) == ["n2", "n0"]
    assert replica_targets(world, "n1", 5) == ["n2", "n0"]  # at most the others
    assert replica_targets(["n0"], "n0", 1) == []
    assert replica_targets(world, "n1", 0) == []
    # Every machine is protected by exactly `replicas` others.
    for r in (1, 2):
        held = [t for me in world for t in replica_targets(world, me, r)]
        assert sorted(held) == sorted(world * r)
    with pytest.raises(ValueError, match="not in the world"):
        replica_targets(world, "n9", 1)


def test_capacity_is_checked_up_front_with_the_numbers(shm: str) -> None:
    check_replica_capacity(shm, 10 * 2**20, 10 * 2**20)
    with pytest.raises(ShmSpaceError, match=r"needs 40\.0 MiB .* plus 30\.0 MiB .* replicas="):
        check_replica_capacity(shm, 40 * 2**20, 30 * 2**20)


def test_replica_names_are_the_holders_and_never_parse_as_a_slot() -> None:
    p = names.replica_path("/d", "j", "nB", "nA", 3)
    assert p == "/d/fc.j.nB.rep.nA.r00003"
    assert names.SLOT_NAME_RE.match(os.path.basename(p)) is None
    g = names.GROUP_NAME_RE.match(os.path.basename(p))
    assert g is not None and g.groups() == ("j", "nB")
    with pytest.raises(ValueError, match="not a valid id"):
        names.replica_path("/d", "j", "nB", "../x", 0)


def test_header_hash_matches_what_the_agent_records(shm: str) -> None:
    data = os.urandom(70_000)
    slot = _snapshot(shm, "nA", 0, 1, data)
    info = slot.header()
    assert info is not None
    assert slot.recorded_hash(info) == xxhash.xxh3_64_intdigest(data)
    slot.close()


def test_query_lists_the_held_replicas_of_a_rank_newest_first(
    shm: str, holder: tuple[ReplicaStore, ReplicaServer]
) -> None:
    """A restoring agent asks which replicas of a global rank a peer holds (of any machine)."""
    _store, server = holder
    for node, rank, step in (("nA", 1, 6), ("nC", 1, 8), ("nA", 0, 9)):
        slot = _snapshot(shm, node, rank, step, os.urandom(20_000))
        push_replica(server.address, slot, job=JOB, node=node, rank=rank, world="w1")
        slot.close()
    got = query_replicas(server.address, job=JOB, rank=1)
    assert [(h.sender_node, h.rank, h.step, h.world) for h in got] == [
        ("nC", 1, 8, "w1"),
        ("nA", 1, 6, "w1"),
    ]
    assert [h.step for h in query_replicas(server.address, job=JOB, rank=1, min_step=7)] == [8]
    assert query_replicas(server.address, job=JOB, rank=5) == []
    with pytest.raises(ReplicaError, match="holds replicas of job"):
        query_replicas(server.address, job="other", rank=1)
    # A bad query is refused with a reason; the server serves on.
    with socket.create_connection(server.address, timeout=10) as sock:
        body = json.dumps({"op": "query", "job": JOB, "rank": "one"}).encode()
        sock.sendall(struct.pack("<8sI", b"FCRPL001", len(body)) + body)
        head = sock.recv(12, socket.MSG_WAITALL)
        (n,) = struct.unpack("<I", head[8:])
        reply = json.loads(sock.recv(n, socket.MSG_WAITALL))
    assert reply["ok"] is False and "rank and min_step (integers)" in reply["error"]
    assert [h.step for h in query_replicas(server.address, job=JOB, rank=0)] == [9]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_the_replica_server_listens_and_serves_on_ipv6(shm: str) -> None:
    """``[::1]:port`` in ``--replica-listen`` and in the peer list: the server listens on an
    IPv6 socket, a push and a fetch go over it, and addresses are written back bracketed (the
    form they parse from)."""
    from flashckpt.agent.config import AgentConfig
    from flashckpt.agent.replicas.transport import host_port

    cfg = AgentConfig(job=JOB, node="nB", replica_listen="[::1]:0", replica_peers="nA=[::1]:7070")
    assert cfg.replica_listen_addr() == ("::1", 0)
    assert cfg.replica_peer_addrs() == {"nA": ("::1", 7070)}
    assert host_port("::1", 7070) == "[::1]:7070" and host_port("10.0.0.2", 1) == "10.0.0.2:1"
    with pytest.raises(ValueError, match=r"IPv6 address without brackets.*\[address\]:port"):
        AgentConfig(job=JOB, node="nB", replica_peers="nA=fd00::2:7070")
    if not _ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (::1 cannot be bound)")
    store = ReplicaStore(shm, JOB, "nB", limit_bytes=32 * 2**20)
    server = ReplicaServer(store, "::1", 0, timeout=10)
    try:
        host, port = server.address
        assert host == "::1" and port > 0
        assert server._sock.family == socket.AF_INET6
        data = os.urandom(300_000)
        slot = _snapshot(shm, "nA", 0, 7, data)
        _push(server, slot)
        slot.close()
        [held] = query_replicas(("::1", port), job=JOB, rank=0)
        assert held.step == 7
        got = fetch_replica(("::1", port), job=JOB, sender_node="nA", rank=0)
        assert got is not None and bytes(got.data) == data and got.source == f"[::1]:{port}"
    finally:
        server.close()
        store.close()


def test_receiving_a_push_runs_the_background_hook_and_serving_a_restore_does_not(
    shm: str,
) -> None:
    """The agent passes ``lower_thread_priority``: a replica arriving from another machine is
    background work (its connection thread is lowered before it takes a byte); a restore's
    fetch and query are waited on, and run at the agent's priority."""
    calls: list[str] = []
    store = ReplicaStore(shm, JOB, "nB", limit_bytes=32 * 2**20)
    server = ReplicaServer(
        store, timeout=10, background=lambda: calls.append(threading.current_thread().name)
    )
    try:
        slot = _snapshot(shm, "nA", 0, 3, os.urandom(10_000))
        _push(server, slot)
        slot.close()
        assert calls == ["fc-replica"]
        assert query_replicas(server.address, job=JOB, rank=0)
        assert fetch_replica(server.address, job=JOB, sender_node="nA", rank=0) is not None
        assert calls == ["fc-replica"]
    finally:
        server.close()
        store.close()
