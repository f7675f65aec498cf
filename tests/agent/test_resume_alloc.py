"""On a resume the slots this machine lacks (it took its snapshot from storage or a peer) are
checked for room at entry and allocated by a thread beside the first steps: the entry does not
wait for the allocation, a too-small shared memory is still an error at entry (allocating
nothing), and the first snapshot after the resume goes into fully mapped slots."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from fchelpers import FcEnv, RunningAgent, private_shm
from test_agent_prefault import _slot_mappings, _thread_minor_faults

import flashckpt
import flashckpt.trainer.snapshot
from flashckpt.protocol.messages import Alloc

RESUME_PHASES = ["join", "hello", "restore", "timeline", "prefault", "preallocate"]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """16 MiB of parameters, 48 MiB with Adam's moments."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.zero_grad()
    model(torch.ones(2, 2048)).sum().backward()
    opt.step()
    return model, opt


def _persist_one_step(fc_env: FcEnv) -> dict[str, torch.Tensor]:
    """A first run that commits step 1 to storage and whose agent then stops (its memory is
    gone): the next entry can resume only from storage. Returns the model's state at step 1."""
    first = RunningAgent(fc_env.agent_config())
    try:
        model, opt = _model()
        kw = fc_env.ckpt_kwargs(agent="connect", persist_every=1)
        with flashckpt.checkpointing(model, opt, **kw) as ck:
            ck.step()
        assert ck.stats.last_committed_step == 1
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        first.stop()  # a clean stop removes the segments


def test_a_resume_from_storage_allocates_its_slots_beside_the_first_steps(
    fc_env: FcEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The allocating thread waits for the test's go: what entry did without it is seen.
    go = threading.Event()
    real = flashckpt.trainer.snapshot.Snapshotter._background_alloc

    def held(self: flashckpt.trainer.snapshot.Snapshotter, need: int) -> None:
        assert go.wait(60)
        real(self, need)

    monkeypatch.setattr(flashckpt.trainer.snapshot.Snapshotter, "_background_alloc", held)
    want = _persist_one_step(fc_env)
    assert fc_env.segments() == []
    again = RunningAgent(fc_env.agent_config())
    try:
        model, opt = _model()
        torch.nn.init.zeros_(model.weight)  # everything must come from storage
        with flashckpt.checkpointing(model, opt, **fc_env.ckpt_kwargs(agent="connect")) as ck:
            assert ck.restored_from == "storage" and ck.start_step == 1
            for k, v in want.items():
                assert torch.equal(model.state_dict()[k], v)
            entry = ck.status()["entry"]
            assert list(entry["phases_s"]) == RESUME_PHASES
            # The entry returned with no slot allocated: the thread allocates them.
            assert ck._snap.slots == [None, None]
            assert not any(n[-3:] in (".s0", ".s1") for n in fc_env.segments())
            assert any(t.name == "flashckpt-alloc" for t in threading.enumerate())
            go.set()
            ck._snap.wait_alloc()
            assert not any(t.name == "flashckpt-alloc" for t in threading.enumerate())
            paths = [s.slot.path for s in ck._snap.slots if s is not None]
            assert len(paths) == 2
            # Both allocated slots have every page mapped: the first snapshot does not fault.
            rss = _slot_mappings(paths)
            # (Rss may count the header page twice: the slot's own header mapping.)
            assert set(rss) == set(paths) and all(rss[p] >= os.path.getsize(p) for p in paths)
            before = _thread_minor_faults()
            ck.step()
            ck.save(mode="sync")
            # A copy into 48 MiB of never-touched pages faults ~12,000 times on this thread.
            assert _thread_minor_faults() - before < 1_500
            assert ck.stats.last_snapshot_step == 2
    finally:
        again.stop()


def test_too_small_shm_at_a_resume_is_an_error_at_entry_and_allocates_nothing(
    fc_env: FcEnv, tmp_path: Path
) -> None:
    _persist_one_step(fc_env)
    with private_shm(tmp_path / "shm", size="8m") as mnt:
        if not os.path.ismount(mnt):
            pytest.skip("needs a tmpfs of a set size (root)")
        a = RunningAgent(fc_env.agent_config(shm_dir=mnt))
        try:
            model, opt = _model()
            ck = flashckpt.checkpointing(
                model, opt, **fc_env.ckpt_kwargs(agent="connect", shm_dir=mnt)
            )
            with pytest.raises(flashckpt.ShmSpaceError, match=r"MiB free but .*--shm-size"):
                ck.__enter__()
            assert not any(t.name == "flashckpt-alloc" for t in threading.enumerate())
        finally:
            a.stop()
        assert [n for n in os.listdir(mnt) if not n.endswith(".owner")] == []


def test_check_only_alloc_is_a_boolean() -> None:
    ok = Alloc(rank=0, local_rank=0, meta_cap=4096, data_cap=4096, check_only=True)
    assert ok.check_only is True
    with pytest.raises(Exception, match="check_only"):
        Alloc(rank=0, local_rank=0, meta_cap=4096, data_cap=4096, check_only=1)  # type: ignore[arg-type]
