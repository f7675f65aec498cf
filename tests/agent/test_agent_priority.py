"""Background work is bounded and hashed once (issue 14): the agent's hash and persist threads run
at a low CPU and IO priority, hash and write in bounded chunks, give way while a trainer copies
into a slot; a shard is hashed once while it is written (the split manifest form), and a slot
overwritten or scribbled during the write is still never committed."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_steps
from waiting import wait_until

import flashckpt
from flashckpt.agent import persist as agent_persist
from flashckpt.agent.persist import hash_snapshot
from flashckpt.agent.state import BACKGROUND_NICE, Pacer, lower_thread_priority, slots_busy
from flashckpt.errors import CorruptCheckpointError
from flashckpt.format.manifest import FileEntry
from flashckpt.format.shm import Slot, allocate_slot_file
from flashckpt.format.storage import Storage

# -- priority ----------------------------------------------------------------------------------


def _nice_of(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat") as f:
        stat = f.read()
    # Fields after the command name (in parentheses, which may hold spaces): state is field 3,
    # nice field 19.
    return int(stat[stat.rindex(")") + 2 :].split()[19 - 3])


_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "riscv64": 31}


def _ioprio_of(tid: int) -> int | None:
    nr = _IOPRIO_GET.get(platform.machine())
    if nr is None:
        return None
    rc = int(ctypes.CDLL(None, use_errno=True).syscall(nr, 1, tid))
    return None if rc < 0 else rc


def _nice_of_threads(name: str) -> list[int]:
    """The nice values of the live threads of that name (an earlier test's agent may still be
    winding down in this process: its threads count too, those that are gone are skipped)."""
    out = []
    for t in threading.enumerate():
        if t.name == name and t.native_id is not None:
            try:
                out.append(_nice_of(t.native_id))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return out


def _ioprio_of_threads(name: str) -> list[int]:
    out = []
    for t in threading.enumerate():
        if t.name == name and t.native_id is not None and t.is_alive():
            got = _ioprio_of(t.native_id)
            if got is not None:
                out.append(got)
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc only")
def test_the_hash_and_persist_threads_run_at_a_low_priority(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    names = ("flashckpt-agent-hash", "flashckpt-agent-persist", "flashckpt-agent-replica")

    def lowered() -> bool:
        # Both, each thread sets them one after the other when it starts: waited for together.
        nice = {n: _nice_of_threads(n) for n in names}
        io = {n: _ioprio_of_threads(n) for n in names}
        return all(v and min(v) >= BACKGROUND_NICE for v in nice.values()) and all(
            (got >> 13, got & 0xFF) == (2, 7)  # best-effort class (2), lowest level 7
            for v in io.values()
            for got in v
        )

    wait_until(
        lowered,
        "the agent's background threads at nice >= BACKGROUND_NICE and IO priority (2, 7)",
        interval=0.05,
        state=lambda: (
            f"nice { ({n: _nice_of_threads(n) for n in names}) }, "
            f"IO priority { ({n: _ioprio_of_threads(n) for n in names}) }"
        ),
    )
    # Only they: the thread that answers the trainers (accept) keeps its priority.
    accept = _nice_of_threads("flashckpt-agent-accept")
    assert accept and max(accept) < BACKGROUND_NICE, accept
    # And it still persists.
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect")
    ) as ck:
        train_steps(ck, model, opt, sched, 0, 2)
        ck.save(2, mode="sync")
        assert ck.flush() == 2


def test_lower_thread_priority_lowers_only_the_calling_thread() -> None:
    got: dict[str, Any] = {}

    def body() -> None:
        got["out"] = lower_thread_priority(BACKGROUND_NICE + 1)
        got["tid"] = threading.get_native_id()
        got["nice"] = os.getpriority(os.PRIO_PROCESS, got["tid"])

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert got["out"]["nice"] == "ok", got
    assert got["nice"] == BACKGROUND_NICE + 1
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < BACKGROUND_NICE + 1


# -- pacing ------------------------------------------------------------------------------------


@pytest.fixture
def slots(tmp_path: Path) -> Iterator[tuple[Slot, Slot, bytes]]:
    """Slot A holds a complete snapshot of 64 KiB of random data; slot B is empty."""
    paths = [str(tmp_path / f"slot{i}") for i in range(2)]
    for p in paths:
        allocate_slot_file(p, 4096, 1 << 16)
    a, b = (Slot(p) for p in paths)
    data = os.urandom(1 << 16)
    seq = a.begin_write()
    a.data(len(data))[:] = data
    a.end_write(seq, 7, b"{}", len(data))
    try:
        yield a, b, data
    finally:
        a.close()
        b.close()


def test_hashing_pauses_while_a_trainer_copies_and_resumes(
    slots: tuple[Slot, Slot, bytes],
) -> None:
    a, b, data = slots
    info = a.header()
    assert info is not None and info.complete
    seq_b = b.begin_write()  # a trainer copies into B: its seqlock is odd
    hashed: list[int] = []
    pacer = Pacer(lambda: slots_busy([b]), max_pause_s=3600, budget_s=3600)

    def pace() -> None:
        pacer()
        hashed.append(1)  # one more chunk goes

    out: dict[str, int | None] = {}
    t = threading.Thread(target=lambda: out.setdefault("h", hash_snapshot(a, info, pace, 4096)))
    t.start()
    try:
        assert pacer.pausing.wait(60), "hashing never paused for the copy"
        # While B's copy runs the pass stands in its first pause: no chunk hashed.
        assert t.is_alive() and hashed == [] and pacer.paused == 1
    finally:
        b.end_write(seq_b, 1, b"{}", 0)  # the copy ends
    t.join(60)
    assert not t.is_alive()
    assert pacer.paused == 1 and len(hashed) == len(data) // 4096
    assert out["h"] == xxhash.xxh3_64_intdigest(data) == a.data_hash(info)


def test_a_trainer_that_copies_all_the_time_does_not_starve_hashing(
    slots: tuple[Slot, Slot, bytes],
) -> None:
    a, b, _ = slots
    info = a.header()
    assert info is not None
    b.begin_write()  # stays odd: a copy that never ends (or a trainer that copies nonstop)
    pacer = Pacer(lambda: slots_busy([b]), max_pause_s=0.001, budget_s=0.005)
    assert hash_snapshot(a, info, pacer, 4096) == a.data_hash(info)
    assert pacer.paused >= 1  # it did give way, then went on


def test_hashing_stops_when_the_slot_itself_is_rewritten(
    slots: tuple[Slot, Slot, bytes],
) -> None:
    a, _, _ = slots
    info = a.header()
    assert info is not None
    calls = []

    def pace() -> None:
        calls.append(1)
        if len(calls) == 2:
            a.begin_write()  # the trainer rewrites the slot being hashed

    assert hash_snapshot(a, info, pace, 4096) is None
    assert len(calls) == 2  # given up at once, not hashed to the end


def test_the_pacer_gives_way_to_a_waiting_trainer_only_when_asked(
    slots: tuple[Slot, Slot, bytes],
) -> None:
    a, b, _ = slots
    b.want(True)
    assert not slots_busy([a, b])
    assert slots_busy([a, b], wanted=True)
    b.close()
    assert not slots_busy([b], wanted=True)  # closed slots are skipped


# -- hashed once: the manifest's split form ------------------------------------------------------


def test_file_entry_forms() -> None:
    old = FileEntry.from_json({"size": 10, "xxh3_64": "0123456789abcdef"})
    assert not old.split and old.to_json() == {"size": 10, "xxh3_64": "0123456789abcdef"}
    doc = {"size": 10, "data_offset": 4, "head_xxh3_64": "0" * 16, "data_xxh3_64": "f" * 16}
    new = FileEntry.from_json(doc)
    assert new.split and new.to_json() == doc
    for bad, why in [
        ({**doc, "data_offset": 11}, "data_offset"),
        ({**doc, "data_offset": -1}, "data_offset"),
        ({**doc, "data_offset": True}, "data_offset"),
        ({**doc, "head_xxh3_64": "XYZ"}, "head_xxh3_64"),
        ({k: v for k, v in doc.items() if k != "data_xxh3_64"}, "data_xxh3_64"),
        ({**doc, "xxh3_64": "0" * 16}, "both"),
        ({"size": 1, "xxh3_64": "0" * 16, "data_xxh3_64": "0" * 16}, "without a data_offset"),
        ({"size": 1.5, "xxh3_64": "0" * 16}, "size"),
        ([], "record"),
    ]:
        with pytest.raises(ValueError, match=why):
            FileEntry.from_json(bad)


def _train_save(env: FcEnv, steps: int, width: int = 32) -> Any:
    model, opt, sched = make(0, width)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **env.ckpt_kwargs(agent="connect", persist_every=1)
    ) as ck:
        train_steps(ck, model, opt, sched, 0, steps)
        ck.save(steps, mode="sync")
        assert ck.flush() == steps
        return ck.status()


def _shard(st: Storage, step: int) -> tuple[str, Path]:
    m = st.manifest(step)
    name = m.shards[0].file
    return name, Path(st.step_path(step, name).removeprefix("file://"))


def test_a_committed_shard_records_the_snapshot_hash_of_its_data(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    _train_save(fc_env, 2)
    st = Storage(fc_env.storage)
    name, path = _shard(st, 2)
    entry = st.manifest(2).files[name]
    raw = path.read_bytes()
    assert entry.split and entry.data_offset is not None and entry.data_offset % 4096 == 0
    assert entry.head_xxh3_64 == xxhash.xxh3_64_hexdigest(raw[: entry.data_offset])
    assert entry.data_xxh3_64 == xxhash.xxh3_64_hexdigest(raw[entry.data_offset :])
    # The data hash is the one the agent recorded in memory when the snapshot completed.
    for rec in agent.agent.st.ranks.values():
        for s in rec.slots:
            info = s.header() if s is not None else None
            if s is not None and info is not None and info.complete and info.step == 2:
                assert f"{s.recorded_hash(info):016x}" == entry.data_xxh3_64
    assert st.verify(2) == []
    assert flashckpt.load(fc_env.storage).step == 2


@pytest.mark.parametrize("where", ["head", "data"])
def test_a_corrupt_byte_of_a_split_shard_is_never_loaded(
    fc_env: FcEnv, agent: RunningAgent, where: str
) -> None:
    _train_save(fc_env, 2)
    st = Storage(fc_env.storage)
    name, path = _shard(st, 2)
    off = st.manifest(2).files[name].data_offset
    assert off is not None
    raw = bytearray(path.read_bytes())
    at = off - 1 if where == "head" else off + 5  # the header's padding, or a tensor byte
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))
    problems = st.verify(2)
    assert any(name in p and "fails its checksum" in p for p in problems), problems
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        st.read_shard_file(2, name, st.manifest(2))


def test_a_manifest_of_the_whole_file_hash_still_loads(fc_env: FcEnv, agent: RunningAgent) -> None:
    """Steps committed before the split form (one hash of the whole shard file) still load."""
    _train_save(fc_env, 2)
    st = Storage(fc_env.storage)
    name, path = _shard(st, 2)
    mpath = Path(st.step_path(2, "manifest.json").removeprefix("file://"))
    doc = json.loads(mpath.read_text())
    raw = path.read_bytes()
    doc["files"][name] = {"size": len(raw), "xxh3_64": xxhash.xxh3_64_hexdigest(raw)}
    mpath.write_text(json.dumps(doc))
    assert st.verify(2) == []
    assert flashckpt.load(fc_env.storage).step == 2
    doc["files"][name]["xxh3_64"] = "0" * 16  # and a wrong one is still caught
    mpath.write_text(json.dumps(doc))
    assert any("fails its checksum" in p for p in st.verify(2))


# -- no post-write re-hash, and still nothing torn or scribbled is committed ---------------------


def _pinned_slot(agent: RunningAgent) -> Slot:
    for rec in agent.agent.st.ranks.values():
        for s in rec.slots:
            if s is not None and s.pinned():
                return s
    raise AssertionError("the persister pins the slot it writes")


def _during_last_chunk(
    monkeypatch: pytest.MonkeyPatch, step: int, act: Callable[[memoryview], None]
) -> list[int]:
    """Runs ``act(data)`` once, while step ``step``'s shard is written, after the persister's
    last check of the slot (so only what it verifies after the write can notice)."""
    real = Storage.write_buffer
    done: list[int] = []

    def write_buffer(
        self: Storage, path: str, head: bytes, data: memoryview, check: Any = None, **kw: Any
    ) -> Any:
        if f"step-{step:09d}" not in path or done:
            return real(self, path, head, data, check, **kw)

        def check_then_act() -> None:
            if check is not None:
                check()
            if not done:
                act(data)
                done.append(1)

        return real(self, path, head, data, check_then_act, **kw)

    monkeypatch.setattr(Storage, "write_buffer", write_buffer)
    # One chunk: the persister checks the slot before it and never again until it is written.
    monkeypatch.setattr(agent_persist, "WRITE_CHUNK", 64 << 20)
    return done


def _hashed_before_persist(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Step ``step``'s completion hash is recorded before the persister writes it, as when the
    hash thread keeps up. Under load the persister can get there first, and then the write's
    hash becomes the completion hash."""
    real = agent_persist.Persister.persist

    def persist(self: agent_persist.Persister, at: int, picks: Any) -> None:
        if at == step:
            self.hash_pass()
        real(self, at, picks)

    monkeypatch.setattr(agent_persist.Persister, "persist", persist)


def _wait_passed(agent: RunningAgent, step: int) -> None:
    wait_until(
        lambda: agent.agent.st.persisted_high >= step,
        f"the persister to take step {step}",
        state=lambda: f"persisted_high {agent.agent.st.persisted_high}",
    )


@pytest.mark.parametrize("how", ["overwritten", "scribbled"])
def test_a_slot_changed_during_the_write_is_never_committed(
    fc_env: FcEnv, agent: RunningAgent, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A trainer that rewrites the slot while its shard is written (the seqlock moves), or a
    stray write into it (the seqlock does not move), after the last check before the write:
    the file holds other bytes than the snapshot hashed at completion. Were the verification
    after the write dropped without a replacement, the step would be committed."""

    def act(data: memoryview) -> None:
        s = _pinned_slot(agent)
        info = s.header()
        assert info is not None and info.complete
        if how == "overwritten":  # as a trainer does: seq odd, new bytes, seq even again
            meta = bytes(s.buf[s.meta_off : s.meta_off + info.meta_len])
            seq = s.begin_write()
            data[:64] = bytes(b ^ 0xFF for b in data[:64])
            s.end_write(seq, info.step, meta, info.data_len)
        else:
            # The premise: a completion hash was recorded before the write (without one, the
            # write's own hash becomes it, and a scribble after the last check is then
            # indistinguishable from the snapshot itself).
            assert s.recorded_hash(info) is not None
            data[:64] = bytes(b ^ 0xFF for b in data[:64])

    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect", persist_every=1)
    ) as ck:
        train_steps(ck, model, opt, sched, 0, 2)
        ck.save(2, mode="sync")
        assert ck.flush() == 2
        done = _during_last_chunk(monkeypatch, 4, act)
        _hashed_before_persist(monkeypatch, 4)
        train_steps(ck, model, opt, sched, 2, 4)
        ck.save(4, mode="sync")
        _wait_passed(agent, 4)
        assert done == [1]
        st = Storage(fc_env.storage)
        assert st.committed_steps() == [2]
        corrupt = [c["step"] for c in ck.status()["agent"]["corrupt_snapshots"]]
        if how == "scribbled":
            assert corrupt == [4]
            assert any("no longer matches its hash" in e["error"] for e in agent.agent.st.errors)
        else:
            assert corrupt == []  # a torn read is no corruption
        # Training goes on; the next snapshot is committed, sound.
        monkeypatch.undo()
        train_steps(ck, model, opt, sched, 4, 6)
        assert ck.save(6, mode="sync").taken
        assert ck.flush(timeout=60) == 6
        assert st.verify(6) == []


@pytest.mark.parametrize("direct", [True, False])
def test_a_shard_write_pauses_between_chunks_while_a_trainer_copies(
    tmp_path: Path, slots: tuple[Slot, Slot, bytes], monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """The persister's check runs a :class:`Pacer` before each chunk of a shard: the write stands
    while a copy runs, goes on once it ended, and records the data's hash (split form)."""
    a, b, data = slots
    if not direct:  # the buffered path (a file system refusing O_DIRECT, or remote storage)
        monkeypatch.setattr(os, "O_DIRECT", 0, raising=False)
    st = Storage(f"file://{tmp_path}/ckpt")
    seq_b = b.begin_write()
    pacer = Pacer(lambda: slots_busy([b]), max_pause_s=3600, budget_s=3600)
    chunks: list[int] = []

    def check() -> None:
        pacer()
        chunks.append(1)

    out: dict[str, Any] = {}
    head = b"H" * 4096
    view = a.data(len(data))
    t = threading.Thread(
        target=lambda: out.setdefault(
            "rec",
            st.write_buffer(st.path("s.safetensors"), head, view, check, split=True, chunk=8192),
        )
    )
    t.start()
    try:
        assert pacer.pausing.wait(60), "the write never paused for the copy"
        assert t.is_alive() and chunks == []
    finally:
        b.end_write(seq_b, 1, b"{}", 0)
    t.join(60)
    view.release()
    assert not t.is_alive()
    rec = out["rec"]
    assert len(chunks) == len(data) // 8192 and pacer.paused == 1
    assert rec.xxh3_64 is None and rec.data_offset == len(head)
    assert rec.data_xxh3_64 == xxhash.xxh3_64_hexdigest(data)
    assert rec.head_xxh3_64 == xxhash.xxh3_64_hexdigest(head)
    assert (tmp_path / "ckpt" / "s.safetensors").read_bytes() == head + data
