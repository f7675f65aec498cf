"""The optional remote tier (``mirror=``, ``mirror_every``): the marked persisted steps are
copied to a second root and committed there entirely or not at all; restore reads the newest
committed step of either tier and falls back from a broken copy to the other tier or an older
step (real node agents, real trainers, real storage: two local roots, or ``memory://`` as the
"remote" one)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from fchelpers import FcEnv, RunningAgent, agent_process
from rankprocs import run_worker
from stephelpers import snapmeta_parts, wait_committed, wait_gone
from tinytrain import make, persisted_steps, train_step
from waiting import wait_until

import flashckpt
from flashckpt.errors import CorruptCheckpointError, StorageUnavailableError
from flashckpt.format.manifest import FileEntry
from flashckpt.format.snapmeta import SnapshotMeta
from flashckpt.format.storage import MANIFEST, PARTS, Storage
from flashckpt.trainer.config import CheckpointConfig, parse_mirror_every

HERE = Path(__file__).resolve().parents[1] / "support"


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, by name (copies)."""
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"o.{pid}.{k}"] = v.detach().clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _train(
    env: FcEnv, mirror: str, saves: int, *, wait_mirror: bool = False, **over: Any
) -> tuple[dict[str, torch.Tensor], Any]:
    """Trains ``saves`` steps with a snapshot after each, then one more step (the exit's final
    snapshot); returns the final state and the checkpointer. ``wait_mirror``: after each
    mirror-marked snapshot, waits until the mirror committed it (the mirror copies the newest
    waiting step and drops older waiting ones, by design: under load a test that expects
    every marked step in the mirror must not run ahead of it)."""
    model, opt, sched = make(0)
    kw = env.ckpt_kwargs(every=0, mirror=mirror, **{"persist_every": 1, **over})
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        for i in range(saves):
            train_step(model, opt, sched, i)
            ck.step()
            marked = ck.stats.mirror_marked
            ck.save(mode="sync")
            ck.flush()
            if wait_mirror and ck.stats.mirror_marked > marked:
                wait_committed(Storage(mirror), ck.stats.last_snapshot_step)
        train_step(model, opt, sched, saves)
        ck.step()
        final = _state(model, opt)
    return final, ck


def _restore(env: FcEnv, mirror: str) -> tuple[dict[str, torch.Tensor], Any]:
    model, opt, sched = make(1)  # other initial weights: only a restore makes them equal
    kw = env.ckpt_kwargs(every=0, persist_every=1, mirror=mirror)
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        got = _state(model, opt)
    return got, ck


def _fresh_agent(env: FcEnv, agent: RunningAgent) -> RunningAgent:
    """Stops ``agent`` (its shared memory goes with it: a restore must read storage) and
    starts another, keeping 10 steps per tier."""
    agent.stop()
    return RunningAgent(env.agent_config(keep=10))


def test_marked_steps_reach_the_mirror_and_restore_survives_the_lost_disk(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    mirror_url = f"memory://flashckpt-mirror-{uuid.uuid4().hex}"
    mirror = Storage(mirror_url)
    primary = Storage(fc_env.storage)
    try:
        final, ck = _train(fc_env, mirror_url, 7, mirror_every=3, wait_mirror=True)
        assert ck.stats.mirror_marked == 4  # persisted snapshots 1, 4, 7, and the exit's 8
        got = wait_committed(mirror, 8)
        # keep=3 (the agent's) holds in each tier on its own.
        assert got == [4, 7, 8]
        assert primary.committed_steps() == [6, 7, 8]
        for step in got:
            # The same manifest (the same files, sizes and hashes) in both tiers, every file
            # sound, and the mirror's latest names the newest.
            assert mirror.check_step(step).status == "ok"
            if step in (7, 8):
                a, b = primary.manifest(step), mirror.manifest(step)
                assert dataclasses.replace(a, created=0) == dataclasses.replace(b, created=0)
        assert json.loads(mirror.fs.cat_file(mirror.path("latest")))["step"] == 8
        status = agent.agent.status()["mirror"]
        assert status["committed"] == [4, 7, 8] and status["errors"] == []

        # Node-local disk lost (and the machine's memory with it): the mirror has the state.
        agent = _fresh_agent(fc_env, agent)
        shutil.rmtree(fc_env.storage_path)
        restored, ck2 = _restore(fc_env, mirror_url)
        assert (ck2.start_step, ck2.restored_from) == (8, "mirror")
        _same(restored, final)
    finally:
        agent.stop()
        mirror.fs.rm(mirror.root, recursive=True)


def test_the_last_step_reaches_the_mirror_when_the_loop_saved_it_unmarked(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    """The loop's own save is the run's last snapshot (the exit takes none) and mirror_every
    did not mark it: the agent mirrors the last persisted step once the trainers finished."""
    mirror_url = f"file://{tmp_path / 'remote'}"
    mirror = Storage(mirror_url)
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(every=0, persist_every=1, mirror=mirror_url, mirror_every=10)
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        persisted_steps(ck, model, opt, sched, 0, 4)
        wait_committed(mirror, 1)
        time.sleep(0.5)
        assert mirror.committed_steps() == [1]  # 2..4 unmarked: in the storage root only
    assert ck.stats.mirror_marked == 1
    assert wait_committed(mirror, 4) == [1, 4]
    assert mirror.check_step(4).status == "ok"


def test_a_duration_mirrors_the_first_persisted_then_waits(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    mirror_url = f"file://{tmp_path / 'remote'}"
    mirror = Storage(mirror_url)
    _, ck = _train(fc_env, mirror_url, 3, mirror_every="1h", persist_every=1)
    # The first persisted snapshot, then nothing for an hour; the exit's final one (4) too.
    assert ck.stats.mirror_marked == 2
    assert wait_committed(mirror, 4) == [1, 4]
    assert Storage(fc_env.storage).committed_steps() == [2, 3, 4]


def test_the_newest_step_of_either_tier_is_restored(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    mirror_url = f"file://{tmp_path / 'remote'}"
    mirror, primary = Storage(mirror_url), Storage(fc_env.storage)
    agent = _fresh_agent(fc_env, agent)
    try:
        final, _ = _train(fc_env, mirror_url, 4, mirror_every=1, wait_mirror=True)
        wait_committed(mirror, 5)
        agent = _fresh_agent(fc_env, agent)
        # Both hold 5: the storage root (nearer) serves it.
        restored, ck = _restore(fc_env, mirror_url)
        assert (ck.start_step, ck.restored_from) == (5, "storage")
        _same(restored, final)
        agent = _fresh_agent(fc_env, agent)
        # Only the mirror holds 5 (the disk's newest steps lost): the mirror serves it.
        for s in (4, 5):
            assert primary._remove_step(s)
        restored, ck = _restore(fc_env, mirror_url)
        assert (ck.start_step, ck.restored_from) == (5, "mirror")
        _same(restored, final)
        agent = _fresh_agent(fc_env, agent)
        # The mirror lags (its newest steps lost): the storage root's newer step wins.
        for s in (3, 4, 5):
            assert mirror._remove_step(s)
        assert max(mirror.committed_steps()) < max(primary.committed_steps())
        _, ck = _restore(fc_env, mirror_url)
        assert (ck.start_step, ck.restored_from) == (3, "storage")
    finally:
        agent.stop()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_copy_falls_back_to_the_other_tier_or_an_older_step(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    mirror_url = f"file://{tmp_path / 'remote'}"
    mirror = Storage(mirror_url)
    shard = "shard-00000-of-00001.safetensors"
    agent = _fresh_agent(fc_env, agent)
    try:
        final, _ = _train(fc_env, mirror_url, 4, mirror_every=1)
        wait_committed(mirror, 5)
        agent = _fresh_agent(fc_env, agent)
        # The storage root's copy of 5 is corrupt: read from the mirror, with a warning.
        _flip_a_byte(fc_env.storage_path / "step-000000005" / shard)
        with pytest.warns(UserWarning, match=r"cannot restore step 5 from storage.*fails its"):
            restored, ck = _restore(fc_env, mirror_url)
        assert (ck.start_step, ck.restored_from) == (5, "mirror")
        _same(restored, final)
        agent = _fresh_agent(fc_env, agent)
        # The mirror's copy is corrupt too: an older step, with a warning.
        _flip_a_byte(tmp_path / "remote" / "step-000000005" / shard)
        with pytest.warns(UserWarning, match=r"cannot restore step 5"):
            _, ck = _restore(fc_env, mirror_url)
        assert (ck.start_step, ck.restored_from) == (4, "storage")
    finally:
        agent.stop()


def test_a_failed_copy_leaves_no_step_in_the_mirror(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy that fails at the second file (its source fails its hash) writes no part:
    nothing is committed in the mirror, the error is kept in status, and the next marked
    step is mirrored whole."""
    mirror_url = f"file://{tmp_path / 'remote'}"
    mirror = Storage(mirror_url)
    real = Storage.copy_step_file
    fail_step = {"step": 2}

    def flaky(self: Storage, step: int, name: str, entry: FileEntry, *a: Any, **k: Any) -> Any:
        if step == fail_step["step"] and name.startswith("shard-"):
            # The bytes read back differ from what was persisted (as if the disk rotted).
            entry = dataclasses.replace(entry, data_xxh3_64="0" * 16)
        return real(self, step, name, entry, *a, **k)

    monkeypatch.setattr(Storage, "copy_step_file", flaky)
    agent = _fresh_agent(fc_env, agent)
    try:
        model, opt, sched = make(0)
        kw = fc_env.ckpt_kwargs(every=0, persist_every=1, mirror=mirror_url, mirror_every=1)
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            for i in range(3):
                train_step(model, opt, sched, i)
                ck.step()
                ck.save(mode="sync")
                assert ck.flush() == i + 1
                if i == 0:
                    wait_committed(mirror, 1)
                if i == 1:
                    wait_until(
                        lambda: agent.agent.status()["mirror"]["errors"],
                        "the failed copy reported",
                        interval=0.05,
                    )
                    # The rank file went over, the shard was copied, found to differ and
                    # removed: no part of this node, no manifest, not a committed step.
                    d = tmp_path / "remote" / "step-000000002"
                    assert (d / "rank-00000-of-00001.json").exists()
                    assert not (d / "shard-00000-of-00001.safetensors").exists()
                    assert not (d / PARTS).exists() and not (d / MANIFEST).exists()
                    assert mirror.committed_steps() == [1]
            wait_committed(mirror, 3)
        assert mirror.committed_steps() == [1, 3]
        # The abandoned step's files go with the retention after the next commit.
        wait_gone(mirror, 2)
        err = agent.agent.status()["mirror"]["errors"][0]
        assert err["step"] == 2 and "fails its checksum (corrupted): not copied" in err["error"]
        # A mirror failure is no persist failure: the storage root has every step.
        assert Storage(fc_env.storage).committed_steps() == [1, 2, 3]
    finally:
        agent.stop()


def test_killed_mid_copy_no_half_step_is_visible(fc_env: FcEnv, tmp_path: Path) -> None:
    """The agent is killed (SIGKILL) while it copies a step to the mirror: the mirror holds
    no committed step (no manifest before every part), a restore finds nothing there, and a
    later agent mirrors the next step and clears the half-copied one."""
    remote = tmp_path / "remote"
    mirror_url = f"file://{remote}"
    mirror = Storage(mirror_url)
    # The copy of step 1's shard blocks: its place in the mirror is a FIFO nobody reads (the
    # copy's open for writing waits for a reader), so the agent is caught mid-copy.
    stuck = remote / "step-000000001"
    stuck.mkdir(parents=True)
    fifo = stuck / "shard-00000-of-00001.safetensors"
    os.mkfifo(fifo)
    proc = agent_process(fc_env)
    try:
        model, opt, sched = make(0)
        kw = fc_env.ckpt_kwargs(every=0, persist_every=1, mirror=mirror_url, agent="connect")
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            train_step(model, opt, sched, 0)
            ck.step()
            ck.save(mode="sync")
            assert ck.flush() == 1  # the primary tier commits regardless
            wait_until(
                (stuck / "rank-00000-of-00001.json").exists,
                "the mirror copy to start",
                interval=0.05,
            )
        time.sleep(0.3)
        assert mirror.committed_steps() == []
        assert not (stuck / PARTS).exists() and not (stuck / MANIFEST).exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert mirror.committed_steps() == []
        assert not (remote / "latest").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    fifo.unlink()
    # Nothing to restore from the mirror; the storage root has step 1. (The killed agent's
    # shared memory is adopted by the next agent: restore finds step 1 in memory first.)
    proc = agent_process(fc_env)
    try:
        model, opt, sched = make(0)
        kw = fc_env.ckpt_kwargs(
            every=0, persist_every=1, mirror=mirror_url, mirror_every=1, agent="connect"
        )
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            assert ck.start_step == 1
            train_step(model, opt, sched, 1)
            ck.step()
            ck.save(mode="sync")
            ck.flush()
        wait_committed(mirror, 2)
        assert mirror.check_step(2).status == "ok"
        # The half-copied step goes with the retention of the commit after it.
        wait_gone(mirror, 1)
        assert mirror.all_step_dirs() == [2]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_two_ranks_on_two_machines_mirror_the_same_steps(fc_env: FcEnv, tmp_path: Path) -> None:
    mirror_url = f"file://{tmp_path / 'remote'}"
    init, out = tmp_path / "init", tmp_path / "out"
    run_worker(
        HERE / "_mirror_worker.py",
        tmp_path,
        "mirror",
        lambda rank: [
            *("--rank", str(rank), "--storage", fc_env.storage, "--mirror", mirror_url),
            *("--job", fc_env.job, "--run-dir", fc_env.run_dir),
            *("--init-file", str(init), "--out", str(out)),
        ],
    )
    r0, r1 = (json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2))
    assert r0 == r1 == {"saved": [1, 2, 3, 4, 5, 6], "mirror_marked": 4}
    mirror = Storage(mirror_url)
    # Persisted 1..6 (every one) and the exit's 7; the 1st and every 2nd persisted, and the
    # exit's final one, are mirrored: 1, 3, 5, 7. The exit's goes while the agents shut down
    # (a bounded wait).
    got = wait_committed(mirror, 7)
    assert got == [1, 3, 5, 7]
    for step in got:
        m = mirror.manifest(step)
        assert m.nodes == ("n0", "n1") and sorted(m.ranks) == [0, 1]
        assert mirror.check_step(step).status == "ok"
        parts = sorted(p.name for p in (tmp_path / "remote" / f"step-{step:09d}" / PARTS).iterdir())
        assert parts == ["n0.json", "n1.json"]


# -- the options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "want"),
    [(1, (1, None)), (10, (10, None)), ("30m", (None, 1800.0)), ("2h", (None, 7200.0))],
)
def test_mirror_every_forms(value: object, want: tuple[int | None, float | None]) -> None:
    assert parse_mirror_every(value) == want


@pytest.mark.parametrize("bad", [0, -1, True, "", "10", "1d", 2.5])
def test_mirror_every_refuses_what_it_cannot_mean(bad: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"mirror_every=.*positive number of persisted"):
        CheckpointConfig(
            storage=str(tmp_path / "a"),
            mirror=str(tmp_path / "b"),
            mirror_every=bad,  # type: ignore[arg-type]
        )


def test_mirror_options_are_checked_early(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"mirror=.*without storage.*pass storage="):
        CheckpointConfig(mirror=str(tmp_path / "b"))
    with pytest.raises(ValueError, match=r"is the storage root itself"):
        CheckpointConfig(storage=str(tmp_path / "a"), mirror=f"file://{tmp_path / 'a'}/")
    with pytest.raises(ValueError, match=r"mirror=''"):
        CheckpointConfig(storage=str(tmp_path / "a"), mirror="")
    with pytest.raises(ValueError, match=r"mirror='nosuchscheme://x'.*cannot be opened"):
        CheckpointConfig(storage=str(tmp_path / "a"), mirror="nosuchscheme://x")
    ok = CheckpointConfig(storage=str(tmp_path / "a"), mirror=str(tmp_path / "b"))
    assert ok.mirror_every == 10


def test_a_mirror_that_cannot_keep_checkpoints_fails_at_entry(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(persist_every=1, mirror=f"file://{blocker}/remote")
    with (
        pytest.raises(StorageUnavailableError, match=r"^mirror .* pass mirror=None"),
        flashckpt.checkpointing(model, opt, scheduler=sched, **kw),
    ):
        pass


def test_a_fresh_start_over_a_mirror_with_steps_is_refused(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    mirror_url = f"file://{tmp_path / 'remote'}"
    _train(fc_env, mirror_url, 1, mirror_every=1, wait_mirror=True)
    wait_committed(Storage(mirror_url), 2)
    shutil.rmtree(fc_env.storage_path)  # the storage root is empty: the mirror still holds 2
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(persist_every=1, mirror=mirror_url, restore=False)
    with (
        pytest.raises(ValueError, match=r"^mirror .* holds committed steps \[1, 2\]"),
        flashckpt.checkpointing(model, opt, scheduler=sched, **kw),
    ):
        pass


def test_the_mirror_mark_is_part_of_the_typed_snapshot_meta() -> None:
    base, tail = snapmeta_parts()
    base["persist"] = True
    doc = {**base, "mirror": "s3://bucket/run", **tail}
    m = SnapshotMeta.from_json(doc)
    assert m.mirror == "s3://bucket/run"
    assert json.dumps(m.to_json()) == json.dumps(doc)  # same keys, same order
    unmarked = SnapshotMeta.from_json({**base, **tail})
    assert unmarked.mirror is None and "mirror" not in unmarked.to_json()
    for bad in (3, "", "x" * 5000, "a\nb"):
        with pytest.raises(CorruptCheckpointError, match="'mirror'"):
            SnapshotMeta.from_json({**base, "mirror": bad, **tail})


def test_the_mirror_commits_only_once_every_part_is_in_and_the_primary_committed(
    tmp_path: Path,
) -> None:
    """Two machines' agents (their state objects, no threads): the committing node's mirror
    copy alone commits nothing, nor do both copies before the step is committed in the primary
    root; then the mirror's manifest is the primary's, and its ``latest`` names the step."""
    from flashckpt.agent.commit import Committer
    from flashckpt.agent.config import AgentConfig
    from flashckpt.agent.mirror import Mirrorer, MirrorJob
    from flashckpt.agent.state import AgentState
    from flashckpt.format.manifest import RankEntry, ShardEntry
    from flashckpt.format.snapmeta import NodePart

    primary_url, mirror_url = f"file://{tmp_path / 'disk'}", f"file://{tmp_path / 'remote'}"
    states = [
        AgentState(
            AgentConfig(
                job="jmirror", node=f"n{n}", storage=primary_url, run_dir=str(tmp_path / "run")
            )
        )
        for n in range(2)
    ]
    primary, mirror = Storage(primary_url), Storage(mirror_url)
    step, shard = 5, "shard-00000-of-00001.safetensors"
    parts = []
    for n in range(2):
        rank_rec = primary.write_private(step, n, 2, {"rng": {}, "extras": {"n": n}})
        files = {f"rank-0000{n}-of-00002.json": rank_rec.entry()}
        shards = {}
        if n == 0:
            files[shard] = primary.write_stream(
                primary.step_path(step, shard), [b"x" * 100]
            ).entry()
            shards = {0: ShardEntry(shard, 0)}
        ranks = {n: RankEntry(f"rank-0000{n}-of-00002.json", 0)}
        part = NodePart(f"n{n}", step, "", 2, 1, ranks, shards, files)
        primary.write_part(step, f"n{n}", part.to_json())
        parts.append(part)
    primary0 = Committer(states[0])
    m0, m1 = Mirrorer(states[0], primary0), Mirrorer(states[1])
    m0.copy(MirrorJob(step, mirror_url, parts[0], commits=True))
    m0.committer.commit_round()
    assert mirror.committed_steps() == [] and m0.committer.commit_missing[step] == [1]
    m1.copy(MirrorJob(step, mirror_url, parts[1], commits=False))
    m0.committer.commit_round()
    assert mirror.committed_steps() == []  # every part is in, the primary has not committed
    assert not (tmp_path / "remote" / "latest").exists()
    assert primary0.try_commit(step, 2, 1, "")
    # A fenced agent (its machine cut off from the job) commits nothing in the mirror either.
    primary0.fence("lease lapsed")
    m0.committer.commit_round()
    assert mirror.committed_steps() == []
    primary0.unfence("w2")
    m0.committer.commit_round()
    assert mirror.committed_steps() == [step] and m0.committed == [step]
    assert dataclasses.replace(mirror.manifest(step), created=0) == dataclasses.replace(
        primary.manifest(step), created=0
    )
    assert json.loads((tmp_path / "remote" / "latest").read_text())["step"] == step
    assert m1.committed == []  # only the committing node commits


@pytest.mark.parametrize("late", ["copy", "commit"])
def test_a_slow_mirror_keeps_its_step_from_the_primary_retention(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late: str
) -> None:
    """The mirror copies step 1 (or commits it) only after the storage root committed steps 2-4:
    with keep=3 the root's retention would have removed step 1 before the mirror was done with
    it (the copy found no files, or the mirror's commit waited for a root manifest that was gone:
    a CI failure under load). The root keeps it until the mirror is done, then retains."""
    from flashckpt.agent.mirror import MirrorCommitter, Mirrorer

    primary = Storage(fc_env.storage)
    mirror_url = f"file://{tmp_path / 'remote'}"
    mirror = Storage(mirror_url)
    root_has_4 = threading.Event()

    def wait_for_step_4(step: int) -> None:
        if step == 1:
            assert root_has_4.wait(120), "the storage root never committed step 4"

    if late == "copy":
        copy = Mirrorer.copy

        def slow_copy(self: Mirrorer, job: Any) -> None:
            wait_for_step_4(job.step)
            copy(self, job)

        monkeypatch.setattr(Mirrorer, "copy", slow_copy)
    else:
        try_commit = MirrorCommitter.try_commit

        def slow_commit(self: MirrorCommitter, step: int, *a: Any) -> bool:
            wait_for_step_4(step)
            return try_commit(self, step, *a)

        monkeypatch.setattr(MirrorCommitter, "try_commit", slow_commit)
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(every=0, persist_every=1, mirror=mirror_url, mirror_every=10, keep=3)
    try:
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            persisted_steps(ck, model, opt, sched, 0, 4)
            assert primary.committed_steps() == [1, 2, 3, 4]  # step 1 held for the mirror
            root_has_4.set()
            wait_committed(mirror, 1)
            # Done with step 1: the root's retention runs (keep=3).
            wait_until(
                lambda: primary.committed_steps() == [2, 3, 4],
                "the root's retention to keep [2, 3, 4]",
                interval=0.05,
                state=primary.committed_steps,
            )
    finally:
        root_has_4.set()  # a failed check leaves no agent thread blocked
    assert wait_committed(mirror, 4) == [1, 4]
    assert mirror.check_step(1).status == "ok"
    errors = agent.agent.mirrorer.errors
    assert not [e for e in errors if e["step"] == 1], errors
