"""Shared memory is verified: a scribbled snapshot is never restored nor committed, and a slot
whose header fails its check is discarded (not served, no crash loop)."""

from __future__ import annotations

import signal
import struct
import warnings
from pathlib import Path

import pytest
import torch
from fchelpers import FcEnv, RunningAgent, agent_process
from tinytrain import make, train_steps
from waiting import wait_until

import flashckpt
from flashckpt.format.shm import Slot
from flashckpt.format.storage import Storage


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _slot_of_step(env: FcEnv, step: int) -> Path:
    for p in sorted(Path(env.shm_dir).glob(f"fc.{env.job}.{env.node}.r00000.s?")):
        s = Slot(str(p))
        try:
            info = s.header()
            if info is not None and info.complete and info.step == step:
                return p
        finally:
            s.close()
    raise AssertionError(f"no slot holds step {step}")


def _wait_hashed(path: Path) -> None:
    """Waits for the agent's background hash of the slot's snapshot."""
    s = Slot(str(path))

    def hashed() -> bool:
        info = s.header()
        assert info is not None and info.complete
        return s.recorded_hash(info) is not None

    try:
        wait_until(hashed, f"the agent's hash of the snapshot in {path}", 60, 0.01)
    finally:
        s.close()


def _scribble(path: Path, offset_in_data: int = 100, n: int = 8) -> None:
    s = Slot(str(path))
    try:
        view = s.data(offset_in_data + n)
        view[offset_in_data : offset_in_data + n] = bytes(
            b ^ 0xFF for b in view[offset_in_data : offset_in_data + n]
        )
    finally:
        s.close()


def _train_to(env: FcEnv, steps: int) -> dict[str, torch.Tensor]:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every=2, **env.ckpt_kwargs(agent="connect")
    ) as ck:
        train_steps(ck, model, opt, sched, 0, steps)
        assert ck.flush() == steps
    return _state(model)


def test_a_scribbled_snapshot_is_not_restored_from_memory(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    """Finding 8: bytes scribbled into the newest slot were restored "from memory"."""
    want = _train_to(fc_env, 4)
    path = _slot_of_step(fc_env, 4)
    _wait_hashed(path)
    _scribble(path)
    model, opt, sched = make(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, every=2, **fc_env.ckpt_kwargs(agent="connect")
        ) as ck:
            assert (ck.start_step, ck.restored_from) == (4, "storage")
            got = _state(model)
    msgs = [str(w.message) for w in caught]
    assert any(
        "rank 0" in m and "step 4" in m and str(path) in m and "fails its data hash" in m
        for m in msgs
    ), msgs
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_scribbled_snapshot_without_storage_copy_falls_back_to_the_older_slot(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect", storage=None)
    ) as ck:
        train_steps(ck, model, opt, sched, 0, 2)
        ck.save(2, mode="sync")
        at2 = _state(model)
        train_steps(ck, model, opt, sched, 2, 4)
        ck.save(4, mode="sync")
    path = _slot_of_step(fc_env, 4)
    _wait_hashed(path)
    _scribble(path)
    model, opt, sched = make(0)
    with (
        pytest.warns(UserWarning, match="step 4 in memory .* fails its data hash"),
        flashckpt.checkpointing(
            model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect", storage=None)
        ) as ck,
    ):
        assert (ck.start_step, ck.restored_from) == (2, "memory")
        got = _state(model)
    for k, v in at2.items():
        assert torch.equal(got[k], v), k


def test_a_scribbled_snapshot_is_never_committed(fc_env: FcEnv, agent: RunningAgent) -> None:
    """Finding 8: a scribbled slot was persisted as a committed step with a valid hash."""
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect")
    ) as ck:
        train_steps(ck, model, opt, sched, 0, 2)
        ck.save(2, mode="sync")
        assert ck.flush() == 2
        train_steps(ck, model, opt, sched, 2, 4)
        # Hold persistence back (the persister takes this lock for every step) until the
        # snapshot of step 4 is hashed and then scribbled over.
        with agent.agent._io_lock:
            ck.save(4, mode="sync")
            path = _slot_of_step(fc_env, 4)
            _wait_hashed(path)
            _scribble(path)
        assert ck.flush(timeout=30) is None
        assert any("no longer matches its hash" in e["error"] for e in ck.stats.persist_errors)
        corrupt = ck.status()["agent"]["corrupt_snapshots"]
        assert [c["step"] for c in corrupt] == [4]
        st = Storage(fc_env.storage)
        assert st.committed_steps() == [2]
        # Training goes on; the next snapshot is persisted.
        train_steps(ck, model, opt, sched, 4, 6)
        assert ck.save(6, mode="sync").taken
        assert ck.flush(timeout=60) == 6
        assert st.verify(6) == []


def _break_header(path: Path) -> None:
    """Overwrites the data capacity field of the header (its CRC no longer matches)."""
    with open(path, "r+b") as f:
        f.seek(56)
        f.write(struct.pack("<Q", 1 << 50))


def test_a_slot_with_a_bad_header_is_discarded_by_a_running_agent(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    _train_to(fc_env, 4)
    _break_header(_slot_of_step(fc_env, 4))
    # No crash loop: every restart works (the first from storage, the next from memory).
    for start, source, stop in ((4, "storage", 6), (6, "memory", 8)):
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, every=2, **fc_env.ckpt_kwargs(agent="connect")
        ) as ck:
            assert (ck.start_step, ck.restored_from) == (start, source)
            train_steps(ck, model, opt, sched, start, stop)
            assert ck.flush() == stop


def test_a_slot_with_a_bad_header_is_discarded_by_the_next_agent(fc_env_private: FcEnv) -> None:
    """Finding 8: capacities were read without the header CRC: a bad capacity field or magic
    put every restart into a crash loop."""
    env = fc_env_private
    a = agent_process(env)
    try:
        _train_to(env, 4)
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=30)
    newest, older = _slot_of_step(env, 4), _slot_of_step(env, 2)
    _break_header(newest)
    with open(older, "r+b") as f:
        f.write(b"GARBAGE!")  # bad magic
    b = agent_process(env)
    try:
        for start, source, stop in ((4, "storage", 6), (6, "memory", 8)):
            model, opt, sched = make(0)
            with flashckpt.checkpointing(
                model, opt, scheduler=sched, every=2, **env.ckpt_kwargs(agent="connect")
            ) as ck:
                assert (ck.start_step, ck.restored_from) == (start, source)
                refused = ck.status()["agent"]["refused_slots"]
                assert str(newest) in refused and "CRC" in refused[str(newest)], refused
                assert str(older) in refused and "magic" in refused[str(older)], refused
                train_steps(ck, model, opt, sched, start, stop)
                assert ck.flush() == stop
    finally:
        b.send_signal(signal.SIGTERM)
        assert b.wait(timeout=60) == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_scribbled_piece_is_not_resharded_from_memory(tmp_path: Path, fc_env: FcEnv) -> None:
    """The memory-reshard path (a sharded job changed size) checks the data hash too: the slot
    of a local rank no trainer uses now is verified by the rank that reads it for cleanup."""
    from shardruns import run as _run

    _run(fc_env, tmp_path, "w2", 2, 8, "--every", "2", "--exit-at", "3", code=3)
    rank1 = sorted(Path(fc_env.shm_dir).glob(f"fc.{fc_env.job}.{fc_env.node}.r00001.s?"))
    newest = None
    for p in rank1:
        s = Slot(str(p))
        info = s.header()
        s.close()
        if info is not None and info.complete and info.step == 4:
            newest = p
    assert newest is not None, rank1
    _wait_hashed(newest)
    _scribble(newest)
    _run(fc_env, tmp_path, "w1", 1, 8, "--every", "2")
    report = (tmp_path / "report.txt").read_text().splitlines()
    # Step 4 cannot be had from memory (rank 1's piece is scribbled): an older one is.
    assert report[-1].split()[:2] == ["0", "2"], report
    errs = "".join(p.read_text() for p in tmp_path.glob("w1-*.stderr"))
    assert "fails its data hash" in errs and str(newest) in errs, errs[-3000:]
