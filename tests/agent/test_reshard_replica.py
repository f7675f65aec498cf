"""A job that shrinks after losing a machine reshards from the replica of that machine's snapshot
held in the survivor's node agent (issue 11: "resharding to a new world size may use replica
pieces too").

Real node agents (separate processes, node ids ``a`` and ``b``, each with its own tmpfs, replica
servers on 127.0.0.1 port 0), an FSDP2 (gloo) job of 2 machines x 1 rank, memory-only snapshots
every 2 steps. Machine ``b``'s agent replicates its rank's snapshots to ``a``; then ``b`` is lost
(its agent SIGKILLed, its memory removed) and no standby comes: the job goes on as 1 rank on
``a``. That rank holds its own snapshot of step 8 (old rank 0) and, in its agent's replica store,
old rank 1's: together the whole state, which it reshards to the new world
(``restored_from="peer-reshard"``), bitwise equal to the state gathered before the kill.
A replica whose bytes flipped in the holder's memory is refused with a warning naming rank, step
and source; the restore falls back to storage (resharded from there), or, without storage, starts
over with the restarted-job warning.

The ranks are test_peer_memory.py's worker (one process per rank, one "machine" each).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_peer_memory import STEPS_BEFORE, Machines, _lose_b, _report, _same_state, three

from flashckpt.testing.ports import free_ports

pytestmark = pytest.mark.timeout(900)

__all__ = ["three"]  # the fixture, imported for the tests here


def _flip(a: Any, offset: int, mask: int) -> None:
    """A bit flips in the replica of b's rank 1 that a's agent holds."""
    from flashckpt import names
    from flashckpt.format.shm import Slot

    rep = Slot(names.replica_path(a.shm_dir, a.job, "a", "b", 1))
    try:
        rep.data(offset + 1)[offset] ^= mask
    finally:
        rep.close()


def test_a_survivor_reshards_from_its_own_slot_and_the_lost_machines_replica(
    three: tuple[Any, Any, Any, Machines], tmp_path: Path
) -> None:
    a, b, c, m = three
    _lose_b(a, b, c, m, storage=False)  # memory only: storage cannot serve it
    errs = m.run_job([a], "after", steps=12, exit_after=-1, storage=False, code=0)
    rep = _report(tmp_path, "after")
    assert (rep[0]["start"], rep[0]["from"]) == (STEPS_BEFORE, "peer-reshard"), (
        rep,
        errs[0][-4000:],
    )
    info = rep[0]["restore"]
    assert info["saved_world_size"] == 2, info
    assert info["replica_of_old_ranks"] == [1], info
    assert info["replica_senders"] == ["b"], info
    assert info["received_from_old_ranks"] == [], info  # both pieces are on this machine
    _same_state(tmp_path)


def test_a_corrupted_replica_is_not_resharded_and_storage_serves_the_step(
    three: tuple[Any, Any, Any, Machines], tmp_path: Path
) -> None:
    a, b, c, m = three
    _lose_b(a, b, c, m, storage=True)
    _flip(a, 17, 0x40)
    errs = m.run_job([a], "after", steps=12, exit_after=-1, storage=True, code=0)
    rep = _report(tmp_path, "after")
    assert (rep[0]["start"], rep[0]["from"]) == (STEPS_BEFORE, "storage"), (rep, errs[0][-4000:])
    warned = [ln for ln in errs[0].splitlines() if "replica of old rank 1" in ln]
    assert warned, errs[0][-4000:]
    msg = warned[0]
    assert "rank 0" in msg and "step 8" in msg and "machine 'b'" in msg, msg
    assert ".rep.b.r00001" in msg and "fails its data hash" in msg, msg
    assert "trying another source" in msg, msg
    _same_state(tmp_path)  # the same step, resharded from storage instead


def test_a_corrupted_replica_without_storage_starts_over_with_the_warning(
    three: tuple[Any, Any, Any, Machines], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c, m = three
    _lose_b(a, b, c, m, storage=False)
    _flip(a, 3, 0x01)
    # As the launcher would say of a restarted worker group: nothing restored is lost work.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    errs = m.run_job([a], "after", steps=2, exit_after=-1, storage=False, code=0)
    rep = _report(tmp_path, "after")
    assert (rep[0]["start"], rep[0]["from"]) == (0, None), (rep, errs[0][-4000:])
    err = errs[0]
    assert "replica of old rank 1" in err and "fails its data hash" in err, err[-4000:]
    assert "starts from step 0 on restart 1 of the job" in err, err[-4000:]
    assert not os.path.exists(tmp_path / "after.restored.safetensors")


def test_a_replica_whose_name_and_description_disagree_is_not_used(
    three: tuple[Any, Any, Any, Machines], tmp_path: Path
) -> None:
    """Nothing in shared memory is trusted: a replica file named for old rank 0 that describes
    rank 1's state is skipped with a warning (and rank 0's own slot alone covers nothing)."""
    from flashckpt import names

    a, b, c, m = three
    _lose_b(a, b, c, m, storage=False)
    held = names.replica_path(a.shm_dir, a.job, "a", "b", 1)
    os.rename(held, names.replica_path(a.shm_dir, a.job, "a", "b", 0))
    errs = m.run_job([a], "after", steps=2, exit_after=-1, storage=False, code=0)
    rep = _report(tmp_path, "after")
    assert (rep[0]["start"], rep[0]["from"]) == (0, None), (rep, errs[0][-4000:])
    assert "named the replica of rank 0 but describes rank 1's state" in errs[0], errs[0][-4000:]


def test_the_replica_file_names_are_the_ones_the_source_lists() -> None:
    from flashckpt import names
    from flashckpt.trainer.restore.sources import REPLICA_SUFFIX_RE

    path = names.replica_path("/dev/shm", "job-1", "a", "n0_7", 12)
    name = os.path.basename(path)
    prefix = names.slot_prefix("job-1", "a")
    assert name.startswith(prefix)
    got = REPLICA_SUFFIX_RE.fullmatch(name[len(prefix) :])
    assert got is not None and (got.group(1), int(got.group(2))) == ("n0_7", 12)
    # A replica still being received, and a trainer's own slot, are not replicas.
    assert REPLICA_SUFFIX_RE.fullmatch(name[len(prefix) :] + ".in") is None
    slot = os.path.basename(names.slot_path("/dev/shm", "job-1", "a", 12, 0))
    assert REPLICA_SUFFIX_RE.fullmatch(slot[len(prefix) :]) is None


def test_the_restart_line_names_peer_memory_reshard() -> None:
    from flashckpt.elastic.launch.restore_report import format_restore_line

    line = format_restore_line(
        2,
        [{"rank": 0, "resume_step": 8, "restored_from": "peer-reshard", "restore_s": 0.4}],
    )
    assert "rank 0 restored step 8 from peer-reshard" in line, line
    assert "another machine's replica" in line, line


def test_three_machines_shrink_to_two_with_pieces_in_both_survivors_replica_stores(
    three: tuple[Any, Any, Any, Machines], tmp_path: Path
) -> None:
    """3 machines x 1 rank, replicas in ring order (a -> b -> c -> a); c is lost and the job
    goes on as 2 ranks on a and b. Old rank 2's snapshot survives only as the replica in a's
    agent; rank 1 (on b) needs part of it and receives it from rank 0 over gloo, and reads old
    rank 0's from the replica in its own agent."""
    from test_peer_memory import _status, _wait

    a, b, c, m = three
    envs = {"a": a, "b": b, "c": c}
    ports = dict(zip(envs, free_ports(3), strict=True))
    procs = {}
    for node, env in envs.items():
        peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items() if n != node)
        procs[node] = m.agent(
            env,
            "--replica-listen",
            f"127.0.0.1:{ports[node]}",
            "--replica-peers",
            peers,
            storage=False,
        )
    m.run_job([a, b, c], "before", steps=20, exit_after=STEPS_BEFORE, storage=False, code=3)

    def holds(env: Any, sender: str, rank: int) -> bool:
        rep = _status(env)["replication"]
        return any(
            (h["sender"], h["rank"], h["step"]) == (sender, rank, STEPS_BEFORE) for h in rep["held"]
        )

    _wait(lambda: holds(a, "c", 2), "a to hold c's replica of step 8")
    _wait(lambda: holds(b, "a", 0), "b to hold a's replica of step 8")
    procs["c"].kill()
    procs["c"].wait(timeout=30)
    c.remove_segments()  # the lost machine's memory is gone with it
    errs = m.run_job([a, b], "after", steps=12, exit_after=-1, storage=False, code=0)
    rep = _report(tmp_path, "after")
    for r in (0, 1):
        assert (rep[r]["start"], rep[r]["from"]) == (STEPS_BEFORE, "peer-reshard"), (
            rep,
            errs[r][-4000:],
        )
        assert rep[r]["restore"]["saved_world_size"] == 3, rep
    # Old rank 2 from a's replica (its designated holder, for every rank); rank 1 also read old
    # rank 0 from the replica in b's agent rather than receive it.
    assert rep[0]["restore"]["replica_of_old_ranks"] == [2], rep
    assert rep[1]["restore"]["replica_of_old_ranks"] == [0, 2], rep
    assert rep[1]["restore"]["replica_holders"] == ["a", "b"], rep
    assert 2 in rep[1]["restore"]["received_from_old_ranks"], rep
    assert 0 not in rep[1]["restore"]["received_from_old_ranks"], rep
    _same_state(tmp_path)


def test_every_restored_from_name_fits_the_step_rings_field() -> None:
    """The monitor (and so the launcher's restart line) reads ``restored_from`` from the step
    ring's fixed field: a longer name would be cut there ("peer-memory-resh")."""
    import struct

    from flashckpt.monitor.ring import INFO
    from flashckpt.trainer.restore.pipeline import SOURCES
    from flashckpt.trainer.restore.sources import REPLICA_RESHARD

    width = INFO.size - struct.calcsize("<dddddqi")  # the trailing 16s
    assert width == 16, INFO.format
    names = [getattr(s, "name", "") for s in SOURCES] + [REPLICA_RESHARD, "mirror"]
    assert all(names), names
    for name in names:
        assert len(name.encode()) <= width, (name, width)


@pytest.fixture
def two_machines(fc_env: Any, tmp_path: Path) -> Iterator[tuple[Any, Any, Machines]]:
    """Machines ``<node>-0`` and ``<node>-1`` (shardtrain.py's names with ``--per-node``), each
    with its own tmpfs."""
    import dataclasses

    from fchelpers import private_shm

    with (
        private_shm(tmp_path / "shm-0", "256m") as shm0,
        private_shm(tmp_path / "shm-1", "256m") as shm1,
    ):
        m0 = dataclasses.replace(fc_env, node=f"{fc_env.node}-0", shm_dir=shm0)
        m1 = dataclasses.replace(fc_env, node=f"{fc_env.node}-1", shm_dir=shm1)
        m = Machines(tmp_path)
        try:
            yield m0, m1, m
        finally:
            m.close()
            for env in (m0, m1):
                env.remove_segments()


def _lose_machine_1(m0: Any, m1: Any, m: Machines, tmp_path: Path, *, storage: bool) -> None:
    """4 ranks of shardtrain.py, 2 on each machine (machine 1 replicating to machine 0), die
    after the snapshot of step 4; machine 1 is then lost (agent SIGKILLed, memory gone)."""
    from shardruns import run as _run
    from test_peer_memory import _listen, _status, _wait

    m.agent(m0, "--replica-listen", "127.0.0.1:0", storage=storage)
    p1 = m.agent(m1, "--replica-peers", f"{m0.node}={_listen(m0)}", storage=storage)
    _run(m0, tmp_path, "w4", 4, 8, "--every", "2", "--per-node", "2", "--exit-at", "3", code=3)

    def held() -> bool:
        got = {(h["sender"], h["rank"], h["step"]) for h in _status(m0)["replication"]["held"]}
        return {(m1.node, 2, 4), (m1.node, 3, 4)} <= got

    _wait(held, "machine 0 to hold machine 1's replicas of step 4")
    if storage:
        from flashckpt.format.storage import Storage

        st = Storage(m0.storage)
        _wait(lambda: 4 in st.committed_steps(), "step 4 committed")
    p1.kill()
    p1.wait(timeout=30)
    m1.remove_segments()


def test_two_ranks_per_machine_reshard_from_the_machines_slots_and_replicas(
    two_machines: tuple[Any, Any, Machines], tmp_path: Path
) -> None:
    """4 ranks on 2 machines shrink to the 2 ranks of machine 0: each reads old ranks 0 and 1
    from the machine's slots and old ranks 2 and 3 from the replicas in its agent (each replica
    hash-checked by one of the two)."""
    from shardruns import assert_same_state as _assert_same_state
    from shardruns import run as _run

    m0, m1, m = two_machines
    _lose_machine_1(m0, m1, m, tmp_path, storage=False)
    _run(m0, tmp_path, "w2", 2, 8, "--every", "2", "--per-node", "2")
    report = sorted((tmp_path / "report.txt").read_text().splitlines())
    assert report == sorted(
        [f"{r} 0 None" for r in range(4)] + ["0 4 peer-reshard", "1 4 peer-reshard"]
    )
    for line in (tmp_path / "w2.log.restore.jsonl").read_text().splitlines():
        info = json.loads(line)
        assert info["replica_of_old_ranks"] == [2, 3], info
        assert info["received_from_old_ranks"] == [], info
    _assert_same_state(
        tmp_path / "w4.log.crash.safetensors", tmp_path / "w2.log.restored.safetensors"
    )


def test_a_replica_failing_its_hash_on_one_local_rank_is_used_by_none(
    two_machines: tuple[Any, Any, Machines], tmp_path: Path
) -> None:
    """Old rank 3's replica is hash-checked by local rank 1 only (3 % 2); when it fails, local
    rank 0, which maps the same file, must not use it either: the step comes from storage."""
    from shardruns import assert_same_state as _assert_same_state
    from shardruns import run as _run

    from flashckpt import names
    from flashckpt.format.shm import Slot

    m0, m1, m = two_machines
    _lose_machine_1(m0, m1, m, tmp_path, storage=True)
    rep = Slot(names.replica_path(m0.shm_dir, m0.job, m0.node, m1.node, 3))
    try:
        rep.data(64)[40] ^= 0x08
    finally:
        rep.close()
    _run(m0, tmp_path, "w2", 2, 8, "--every", "2", "--per-node", "2")
    report = sorted((tmp_path / "report.txt").read_text().splitlines())
    assert report == sorted([f"{r} 0 None" for r in range(4)] + ["0 4 storage", "1 4 storage"])
    errs = "".join(p.read_text() for p in tmp_path.glob("w2-*.stderr"))
    assert "replica of old rank 3" in errs and "fails its data hash" in errs, errs[-4000:]
    _assert_same_state(
        tmp_path / "w4.log.crash.safetensors", tmp_path / "w2.log.restored.safetensors"
    )
