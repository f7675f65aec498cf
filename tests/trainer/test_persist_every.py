"""``persist_every``: memory keeps every snapshot, storage gets the marked ones, and a rarer
persist loses nothing on a process crash: the newest snapshot is still persisted when a flush or
the exit waits for it and when the trainer dies (real agent, real trainers, real storage)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fchelpers import FcEnv, RunningAgent, tinytrain_command
from rankprocs import RankProcs, run_worker
from stephelpers import snapmeta_parts, wait_committed
from tinytrain import make, train_step
from waiting import wait_until

import flashckpt
from flashckpt.agent.daemon import NodeAgent
from flashckpt.errors import CorruptCheckpointError
from flashckpt.format.snapmeta import SnapshotMeta
from flashckpt.format.storage import Storage
from flashckpt.trainer.config import CheckpointConfig, parse_persist_every
from flashckpt.trainer.rankctx import RankContext

HERE = Path(__file__).resolve().parents[1] / "support"


def _two_machines(
    env: FcEnv, tmp: Path, steps: int, every: int, flags: dict[int, list[str]]
) -> list[dict[str, int]]:
    """Runs ``tests/ddptrain.py`` as 2 DDP ranks (gloo), each on a (simulated) machine of its
    own: nodes n0 and n1, each with its own auto-started node agent, to the end; ``flags[r]``
    are rank r's extra flags. Returns each rank's ``stats`` (saves, persist_marked)."""
    init = tmp / f"init-{time.monotonic_ns()}"
    run_worker(
        HERE / "ddptrain.py",
        tmp,
        "r",
        lambda rank: [
            *("--rank", str(rank), "--storage", env.storage, "--job", env.job),
            *("--run-dir", env.run_dir, "--log", str(tmp / f"r{rank}.log")),
            *("--init-file", str(init), "--steps", str(steps), "--every", str(every)),
            *("--node", f"n{rank}", "--local-world", "1"),
            *flags.get(rank, []),
        ],
    )
    return [json.loads((tmp / f"r{r}.log.stats.json").read_text()) for r in range(2)]


def _marked_steps_committed(
    stats: list[dict[str, int]], st: Storage, marked: list[int], snapshots: list[int]
) -> list[int]:
    """Both ranks marked the same snapshots, and storage committed exactly those marked plus
    the exit's last one. ``marked`` are the steps the cadence marks; one replaced in its slot
    before its node agent began on it (a persister behind under load) carries its mark to the
    next snapshot, on every rank alike (``persist_carried``): then that one is committed in its
    place. Returns the committed steps."""
    assert stats[0] == stats[1], stats  # the ranks' OR: every machine marked the same ones
    s = stats[0]
    assert s["saves"] == len(snapshots)
    carried = s["persist_carried"]
    assert s["persist_marked"] == len(marked) + carried
    committed = st.committed_steps()
    if carried == 0:
        assert committed == sorted({*marked, snapshots[-1]})
    else:
        # Each carry moves a lost mark to the next snapshot: what is committed are marked steps
        # (some moved later), never more of them than were marked, and the last snapshot.
        assert committed[-1] == snapshots[-1] and set(committed) <= set(snapshots)
        assert len(committed) <= len(marked) + 1
        assert committed[0] >= marked[0]
    return committed


@pytest.mark.slow
def test_the_ranks_or_of_their_clocks_marks_the_same_steps_on_every_machine(
    fc_env: FcEnv, tmp_path: Path
) -> None:
    """The time form on 2 machines: at the snapshot of step 6 only rank 1's clock says a persist
    is due (an hour since its last mark; rank 0's says a few seconds). The ranks take the OR,
    so both mark step 6 and both machines' agents persist their part of it: step 6 is committed.
    Had each rank followed its own clock, rank 0's agent would never write step 6 and it would
    never be committed (the replica's part is rank 0's)."""
    st = Storage(fc_env.storage)
    stats = _two_machines(
        fc_env,
        tmp_path,
        12,
        3,
        {
            0: ["--persist-every", "1h"],
            1: ["--persist-every", "1h", "--clock-due-at", "6"],
        },
    )
    # Snapshots 3, 6, 9, 12: marked are the first (3) and the one rank 1's clock asked for (6),
    # on both ranks alike.
    committed = _marked_steps_committed(stats, st, marked=[3, 6], snapshots=[3, 6, 9, 12])
    # 3 and 6 persisted as marked (or 6's mark carried to 9 on both, see above), 9 stayed in
    # memory, 12 committed by the exit's flush.
    assert committed[-1] == 12
    for step in committed:
        assert st.check_step(step).status == "ok", step


@pytest.mark.slow
def test_the_default_persists_the_first_snapshot_and_the_exit_commits_the_last(
    fc_env: FcEnv, tmp_path: Path
) -> None:
    """With the default ``persist_every`` (a duration far longer than this run) on 2 machines:
    storage gets the first snapshot and, from the exit's flush, the last one; the snapshots
    between stay in memory only."""
    assert CheckpointConfig().persist_every == "5m"
    st = Storage(fc_env.storage)
    flags = ["--persist-every", "default"]
    stats = _two_machines(fc_env, tmp_path, 12, 3, {0: flags, 1: flags})
    committed = _marked_steps_committed(stats, st, marked=[3], snapshots=[3, 6, 9, 12])
    assert committed[-1] == 12
    assert st.check_step(12).status == "ok"


def test_every_nth_snapshot_goes_to_storage_and_the_exit_commits_the_last(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    st = Storage(fc_env.storage)
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(every=0, persist_every=3)
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        for i in range(8):
            train_step(model, opt, sched, i)
            ck.step()
            h = ck.save(mode="sync")
            assert h.done
            if i % 3 == 0:  # saves 1, 4, 7 are marked: each is committed without a flush
                wait_committed(st, i + 1)
            else:
                # An unmarked one is not persisted: the agent holds it in memory only. The
                # agent has looked at it once its persister records it as passed over.
                wait_until(
                    lambda n=i + 1: agent.agent.st.unmarked_high >= n,
                    f"the agent passing over unmarked step {i + 1}",
                )
                assert i + 1 not in st.committed_steps()
        assert st.committed_steps() == [1, 4, 7]
        assert ck.stats.persist_marked == 3
        assert agent.agent.st.unmarked_high == 8
    # The exit's flush waits for the newest snapshot (step 8, unmarked): it is persisted.
    assert 8 in st.committed_steps()
    assert st.check_step(8).status == "ok"
    # The agent keeps the newest 3 committed steps: its retention runs right after the commit
    # it announced (the flush returns first, agent_commit), so step 1 goes a moment later.
    wait_until(
        lambda: st.committed_steps() == [4, 7, 8],
        "retention to keep [4, 7, 8]",
        30,
        0.05,
        state=st.committed_steps,
    )


def test_a_duration_marks_the_first_and_flush_persists_the_newest(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    st = Storage(fc_env.storage)
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(every=0, persist_every="1h")
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        for i in range(4):
            train_step(model, opt, sched, i)
            ck.step()
            ck.save(mode="sync")
            if i == 0:
                wait_committed(st, 1)
        time.sleep(0.5)
        assert st.committed_steps() == [1]
        assert ck.flush() == 4  # a flush persists the newest, marked or not
        assert st.committed_steps() == [1, 4]
        for i in range(4, 6):
            train_step(model, opt, sched, i)
            ck.step()
            ck.save(mode="sync")
    assert st.committed_steps() == [1, 4, 6]
    assert ck.stats.persist_marked == 1


def test_the_newest_snapshot_is_persisted_when_the_trainer_dies(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    st = Storage(fc_env.storage)
    log = tmp_path / "train.log"
    cmd = tinytrain_command(
        fc_env,
        log,
        "--steps",
        "100000",
        "--every",
        "2",
        "--persist-every",
        "1000",
        "--step-sleep",
        "0.05",
        "--mode",
        "sync",
    )
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        # The first snapshot (step 2) is marked; under load it can be replaced before its
        # persist began, and then its mark goes on to the next snapshot (by design): the first
        # committed step is the marked one, whichever it is.
        first = wait_until(st.committed_steps, "the first marked snapshot committed", 120)[0]
        assert first % 2 == 0 and first < 1000
        wait_until(
            lambda: log.exists() and len(log.read_text().splitlines()) >= first + 12,
            f"step {first + 12} in the trainer's log",
            120,
            0.05,
        )
        assert st.committed_steps() == [first]  # the snapshots after it are in memory only
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    a = agent.agent
    with a.st.lock:
        slots = [s for r in a.st.ranks.values() for s in r.slots if s is not None]
    newest = max(h.step for s in slots if (h := s.header()) is not None and h.complete)
    assert newest >= first + 10
    # Its trainer is gone: the agent persists what this machine's memory holds (save at
    # breakpoint), marked or not.
    got = wait_committed(st, newest)
    assert got == [first, newest]
    assert st.check_step(newest).status == "ok"


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (1, (1, None)),
        (7, (7, None)),
        ("90s", (None, 90.0)),
        ("10m", (None, 600.0)),
        ("2h", (None, 7200.0)),
        ("0.5S", (None, 0.5)),
    ],
)
def test_persist_every_forms(value: object, want: tuple[int | None, float | None]) -> None:
    assert parse_persist_every(value) == want


@pytest.mark.parametrize("bad", [0, -3, True, "", "10", "s", "-5s", "1d", "infs", 2.5])
def test_persist_every_refuses_what_it_cannot_mean(bad: object) -> None:
    with pytest.raises(ValueError, match=r"persist_every=.*use a positive number of snapshots"):
        CheckpointConfig(persist_every=bad)  # type: ignore[arg-type]


def test_the_mark_is_part_of_the_typed_snapshot_meta() -> None:
    base, tail = snapmeta_parts()
    for persist in (True, False):
        doc = {**base, "persist": persist, **tail}
        m = SnapshotMeta.from_json(doc)
        assert m.persist is persist and m.persist_wanted is persist
        assert json.dumps(m.to_json()) == json.dumps(doc)  # same keys, same order
    old = SnapshotMeta.from_json({**base, **tail})  # an older trainer: no mark, persisted
    assert old.persist is None and old.persist_wanted and "persist" not in old.to_json()
    with pytest.raises(CorruptCheckpointError, match="'persist'"):
        SnapshotMeta.from_json({**base, "persist": "yes", **tail})


# -- a marked snapshot lost before the agent began on it: the mark carries forward ------------


@contextlib.contextmanager
def _persister_held(a: NodeAgent) -> Iterator[threading.Event]:
    """Holds the agent's persister back (it looks for no step to persist) until the event is
    set: a persister that is behind, as on a loaded machine or a slow storage."""
    gate = threading.Event()
    look = a.persister.pending_step

    def held() -> tuple[int, dict[int, tuple[int, object]]] | None:
        if threading.current_thread().name == "flashckpt-agent-persist":
            gate.wait(timeout=600)
        return look()  # type: ignore[return-value]

    a.persister.pending_step = held  # type: ignore[assignment,method-assign]
    try:
        yield gate
    finally:
        gate.set()
        del a.persister.pending_step  # the method again


def _looked_at(a: NodeAgent, step: int) -> Callable[[], bool]:
    """Whether the agent's persister has looked at ``step``: persisted it, or found it unmarked
    (and persisted nothing)."""
    return lambda: a.st.persisted_high >= step or a.st.unmarked_high >= step


@pytest.mark.parametrize("persist_every", [100, "1h"])
def test_a_mark_lost_before_the_persist_began_carries_to_the_next_snapshot(
    fc_env: FcEnv, agent: RunningAgent, persist_every: int | str
) -> None:
    """The first snapshot (step 1) is marked, but the agent's persister is behind: snapshots 2
    and 3 replace it in the two slots before the persister began on it. Step 3 is marked in its
    place (the mark carries forward), so storage gets step 3 as soon as the persister looks,
    not at the next mark (the 101st snapshot, or an hour later). Once the agent persisted it,
    nothing more is carried: snapshots 4-6 stay in memory only, until the exit's flush."""
    a = agent.agent
    st = Storage(fc_env.storage)
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(every=0, persist_every=persist_every, agent="connect")
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        with _persister_held(a) as gate:
            for i in range(3):
                train_step(model, opt, sched, i)
                ck.step()
                ck.save(mode="sync")
            assert a.st.persisted_high == -1  # the persister never began on step 1
            assert (ck.stats.persist_marked, ck.stats.persist_carried) == (2, 1)
            gate.set()
            wait_until(_looked_at(a, 3), "the persister looks at step 3", timeout=120.0)
        assert a.st.persisted_high == 3, f"step 3 not persisted ({a.st.unmarked_high=})"
        assert wait_committed(st, 3) == [3]
        wait_until(
            lambda: ck.stats.last_persisted_step == 3,
            "the trainer hears step 3 persisted",
            timeout=120.0,
        )
        for i in range(3, 6):
            train_step(model, opt, sched, i)
            ck.step()
            ck.save(mode="sync")
        wait_until(_looked_at(a, 6), "the persister looks at step 6", timeout=120.0)
        assert (ck.stats.persist_marked, ck.stats.persist_carried) == (2, 1)
        assert a.st.persisted_high == 3 and st.committed_steps() == [3]
    assert st.committed_steps() == [3, 6]  # the exit's flush commits the last one
    assert st.check_step(6).status == "ok"


def test_a_mark_kept_while_the_persister_reads_it_carries_nothing(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    """The persister is behind but the marked step is still in memory when it looks (one more
    snapshot only, into the other slot): nothing is carried, the marked step is persisted."""
    a = agent.agent
    st = Storage(fc_env.storage)
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(every=0, persist_every=100, agent="connect")
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        with _persister_held(a) as gate:
            for i in range(2):
                train_step(model, opt, sched, i)
                ck.step()
                ck.save(mode="sync")
            gate.set()
            wait_until(_looked_at(a, 1), "the persister looks at step 1", timeout=120.0)
        assert wait_committed(st, 1) == [1]
        wait_until(
            lambda: ck.stats.last_persisted_step == 1,
            "the trainer hears step 1 persisted",
            timeout=120.0,
        )
        for i in range(2, 5):
            train_step(model, opt, sched, i)
            ck.step()
            ck.save(mode="sync")
        wait_until(_looked_at(a, 5), "the persister looks at step 5", timeout=120.0)
        assert (ck.stats.persist_marked, ck.stats.persist_carried) == (1, 0)
        assert st.committed_steps() == [1]


@pytest.mark.slow
@pytest.mark.parametrize("persist_every", [100, "1h"])
def test_a_mark_lost_on_one_machine_carries_forward_on_every_machine(
    fc_env: FcEnv, tmp_path: Path, persist_every: int | str
) -> None:
    """2 ranks (gloo), each a machine with its own node agent; machine n1's persister is behind.
    Step 1 is marked: n0's agent persists its part at once (rank 0 waits for it), n1's never
    begins before snapshots 2 and 3 replace step 1 there. Only rank 1 finds the mark lost; the
    ranks' OR marks step 3 on both, so both agents persist their part of step 3 and it is
    committed as soon as n1's persister looks. Had only rank 1 carried the mark, n0's agent
    would not write step 3 and no step would be committed before the next mark."""
    st = Storage(fc_env.storage)
    agents = [RunningAgent(fc_env.agent_config(node=f"n{r}")) for r in range(2)]
    out = tmp_path / "carry"
    procs = RankProcs(tmp_path, "r")
    try:
        with _persister_held(agents[1].agent) as gate:
            init = tmp_path / f"init-{time.monotonic_ns()}"
            for rank in range(2):
                procs.start(
                    [
                        sys.executable,
                        str(HERE / "_persist_carry_worker.py"),
                        *("--rank", str(rank), "--storage", fc_env.storage, "--job", fc_env.job),
                        *("--run-dir", fc_env.run_dir, "--init-file", str(init)),
                        *("--out", str(out), "--persist-every", str(persist_every)),
                    ]
                )

            def saved() -> bool:
                for rank, p in enumerate(procs.procs):
                    assert p.poll() is None, procs.stderr(rank)[-3000:]
                return all(Path(f"{out}.{r}.json").exists() for r in range(2))

            wait_until(saved, "both ranks take 3 snapshots", timeout=240)
            n0, n1 = (x.agent for x in agents)
            assert n1.st.persisted_high == -1  # n1's persister never began on step 1
            assert n0.st.persisted_high >= 1  # n0's did (its part of step 1 is written)
            ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
            # Both ranks marked step 1 and, carried forward, step 3: the same steps.
            assert [(r["marked"], r["carried"]) for r in ranks] == [(2, 1), (2, 1)]
            gate.set()
            wait_until(_looked_at(n1, 3), "n1's persister looks at step 3", timeout=120.0)
        assert n1.st.persisted_high == 3, f"n1 persisted nothing ({n1.st.unmarked_high=})"
        assert wait_committed(st, 3) == [3]  # step 1 never was: n1's part never came
        assert st.check_step(3).status == "ok"
        Path(f"{out}.go").touch()
        procs.expect([0, 0], timeout=120)
        assert st.committed_steps() == [3]  # the exit found step 3, the last, committed
    finally:
        Path(f"{out}.go").touch()
        procs.close()
        for x in agents:
            if x.thread.is_alive():
                x.stop()


def test_a_persisted_snapshot_is_hashed_once_by_its_write(
    fc_env: FcEnv, agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot persisted before the hash thread reached it is read once: the shard's write
    hashes each chunk and that hash becomes the snapshot's completion hash (recorded in the
    slot: a restore from memory checks it), no second pass over the data. Here the hash thread
    is held off, so every hash of the data would have to come from somewhere else."""
    import flashckpt.agent.persist as ap

    a = agent.agent
    passes: list[int] = []
    hash_snapshot = ap.hash_snapshot

    def counted(*args: object, **kw: object) -> int | None:
        passes.append(1)
        return hash_snapshot(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ap, "hash_snapshot", counted)
    hash_pass = a.persister.hash_pass

    def no_background(rank: int | None = None, background: bool = False) -> None:
        if not background:
            hash_pass(rank)  # a trainer's request (hash_now) is served

    monkeypatch.setattr(a.persister, "hash_pass", no_background)
    st = Storage(fc_env.storage)
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(every=0, persist_every=1, agent="connect")
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        train_step(model, opt, sched, 0)
        ck.step()
        ck.save(mode="sync")
        assert ck.flush() == 1
        assert passes == []  # the write's hash was the only read of the data
        with a.st.lock:
            slots = [s for r in a.st.ranks.values() for s in r.slots if s is not None]
        (slot,) = [s for s in slots if (h := s.header()) is not None and h.step == 1]
        info = slot.header()
        assert info is not None
        entry = st.manifest(1).files["shard-00000-of-00001.safetensors"]
        assert f"{slot.recorded_hash(info):016x}" == entry.data_xxh3_64
        assert slot.verify_data(info) is True
        want = {k: v.clone() for k, v in model.state_dict().items()}
    model2, opt2, sched2 = make(1)
    with flashckpt.checkpointing(model2, opt2, scheduler=sched2, **kw) as ck2:
        assert (ck2.restored_from, ck2.start_step) == ("memory", 1)
        for k, v in model2.state_dict().items():
            assert torch.equal(v, want[k]), k


def test_a_carried_mark_keeps_the_lost_marks_mirror_mark(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    """Step 1 is marked for storage and (the first of ``mirror_every=2``) for the remote tier,
    and lost before the persister began on it: step 3 carries both marks, so the remote tier
    gets step 3 too; the carried mark is not counted by ``mirror_every`` (it stands in for
    one that was)."""
    a = agent.agent
    st = Storage(fc_env.storage)
    mirror = Storage(f"file://{tmp_path}/remote")
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(
        every=0, persist_every=100, mirror=mirror.url, mirror_every=2, agent="connect"
    )
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        with _persister_held(a) as gate:
            for i in range(3):
                train_step(model, opt, sched, i)
                ck.step()
                ck.save(mode="sync")
            assert (ck.stats.persist_carried, ck.stats.mirror_marked) == (1, 2)
            assert ck._mirror_cadence.calls == 1  # step 1's mark only
            gate.set()
            wait_until(_looked_at(a, 3), "the persister looks at step 3", timeout=120.0)
        assert wait_committed(st, 3) == [3]
        assert wait_committed(mirror, 3) == [3]
    assert mirror.check_step(3).status == "ok"


def test_the_exits_final_snapshot_needs_no_collective(
    fc_env: FcEnv, agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exit's final snapshot is marked without asking the other ranks (the exit's flush
    persists it anyway): a rank whose last snapshot was skipped (``when_busy="skip"``) takes
    this one where the others do not, and an all-reduce in it would wait for them forever."""
    st = Storage(fc_env.storage)
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(every=0, persist_every="1h", agent="connect")
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        train_step(model, opt, sched, 0)
        ck.step()
        ck.save(mode="sync")
        train_step(model, opt, sched, 1)
        ck.step()  # step 2: not saved; the exit takes it

        def no_collective(self: RankContext, code: int) -> int:
            raise AssertionError("a collective in the exit's final snapshot")

        monkeypatch.setattr(RankContext, "all_max", no_collective)
    assert st.committed_steps()[-1] == 2  # (step 1 too, if the persister took it in time)
    assert st.check_step(2).status == "ok"


def test_a_mark_the_persister_yields_to_the_trainer_carries_to_the_next_snapshot(
    fc_env: FcEnv, agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The persister began on marked step 1 (it holds the slot) when snapshot 3 wants that slot:
    the persister yields it to the trainer (abandons step 1). Snapshot 3 was not marked (step 1
    was still being read when it asked); snapshot 4 finds step 1 gone without the agent having
    persisted it and carries the mark: storage gets step 4, not the next mark."""
    a = agent.agent
    st = Storage(fc_env.storage)
    write_shard = a.persister.write_shard
    began, gate = threading.Event(), threading.Event()

    def held(*args: Any, **kw: Any) -> Any:
        if not gate.is_set():
            began.set()
            gate.wait(timeout=300)
        return write_shard(*args, **kw)

    monkeypatch.setattr(a.persister, "write_shard", held)

    def release_when_wanted() -> None:  # the trainer asks for the slot: the write goes on
        began.wait(timeout=300)

        def wanted() -> bool:
            with a.st.lock:
                slots = [s for r in a.st.ranks.values() for s in r.slots if s is not None]
            return any(s.wanted() for s in slots)

        try:
            wait_until(wanted, "the trainer to want a slot", 300, 0.005)
        finally:
            gate.set()

    helper = threading.Thread(target=release_when_wanted, daemon=True)
    helper.start()
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(every=0, persist_every=100, agent="connect")
    try:
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            for i in range(4):
                train_step(model, opt, sched, i)
                ck.step()
                ck.save(mode="sync")
                if i == 0:
                    assert began.wait(timeout=120), "the persister did not begin on step 1"
            assert (ck.stats.persist_marked, ck.stats.persist_carried) == (2, 1)
            wait_until(_looked_at(a, 4), "the persister looks at step 4", timeout=120.0)
            assert a.st.persisted_high == 4, f"step 4 not persisted ({a.st.unmarked_high=})"
            assert wait_committed(st, 4) == [4]  # step 1 was abandoned, never committed
    finally:
        gate.set()
        helper.join(timeout=30)
