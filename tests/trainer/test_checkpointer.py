"""The trainer side against a real node agent (served from a thread of the test process)."""

from __future__ import annotations

import os

import pytest
import torch
from fchelpers import FcEnv, RunningAgent, sized_tmpfs
from interrupts import SimulatedInterrupt
from tinytrain import batch, make, train_step

import flashckpt


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _opt_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def _run(env: FcEnv, steps: int, every: int = 3, stop_with_error_at: int | None = None, **kw):
    model, opt, sched = make(0)
    extras: dict = {"pos": 0}
    losses = {}
    ck = flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        extras=extras,
        every=every,
        **env.ckpt_kwargs(agent="connect", **kw),
    )
    try:
        with ck as ckpt:
            for step in range(ckpt.start_step, steps):
                if step == stop_with_error_at:
                    raise SimulatedInterrupt
                losses[step] = train_step(model, opt, sched, step)
                extras["pos"] = step + 1
                ckpt.step()
    except SimulatedInterrupt:
        pass
    return model, opt, sched, extras, losses, ck


# "auto" is the default (sync on this CPU state); "overlap" is what a GPU state gets.
@pytest.mark.parametrize("mode", ["auto", "overlap"])
def test_resume_from_memory_is_bitwise_identical(
    fc_env: FcEnv, agent: RunningAgent, mode: str
) -> None:
    # Uninterrupted reference, in its own job.
    ref_env = FcEnv(
        job=fc_env.job + "r",
        node="n0",
        run_dir=fc_env.run_dir,
        storage=fc_env.storage + "-ref",
        storage_path=fc_env.storage_path,
    )
    ref_agent = RunningAgent(ref_env.agent_config())
    try:
        ref_model, ref_opt, _, _, ref_losses, _ = _run(ref_env, 20, mode=mode)
    finally:
        ref_agent.stop()
    # Interrupted at step 11 (last snapshot labelled 9), then resumed in a "new process".
    _, _, _, _, _, ck1 = _run(fc_env, 20, stop_with_error_at=11, mode=mode)
    assert ck1.stats.last_snapshot_step == 9
    assert ck1.stats.copy_mode == ("sync" if mode == "auto" else "overlap")
    model, opt, _, extras, losses2, ck2 = _run(fc_env, 20, mode=mode)
    assert ck2.start_step == 9 and ck2.restored_from == "memory"
    for step in range(9, 20):
        assert losses2[step] == ref_losses[step], f"loss differs at step {step}"
    for k, v in ref_model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    for a, b in zip(_opt_tensors(opt), _opt_tensors(ref_opt), strict=True):
        assert torch.equal(a, b)
    assert extras == {"pos": 20}


def test_restore_from_storage_after_agent_restart(fc_env: FcEnv, agent: RunningAgent) -> None:
    model1, opt1, sched1, _, _, ck = _run(fc_env, 10)
    assert ck.stats.last_committed_step == 10
    agent.stop()  # clean stop removes the segments
    assert fc_env.segments() == []
    again = RunningAgent(fc_env.agent_config())
    try:
        model, opt, sched = make(seed=123)  # different init: everything must come from storage
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect")
        ) as ckpt:
            assert ckpt.start_step == 10 and ckpt.restored_from == "storage"
            for k, v in model1.state_dict().items():
                assert torch.equal(model.state_dict()[k], v)
            for a, b in zip(_opt_tensors(opt), _opt_tensors(opt1), strict=True):
                assert torch.equal(a, b)
            assert sched.state_dict() == sched1.state_dict()
    finally:
        again.stop()


def test_rng_states_are_restored(fc_env: FcEnv, agent: RunningAgent) -> None:
    import random

    import numpy as np

    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect")
    ) as ckpt:
        torch.manual_seed(5)
        random.seed(6)
        np.random.seed(7)
        ckpt.step()
        ckpt.save(mode="sync")
        expect = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect", every=0)
    ) as ckpt:
        assert ckpt.start_step == 1
        got = (torch.rand(3), random.random(), np.random.rand())
        ckpt.step  # noqa: B018
    assert torch.equal(got[0], expect[0]) and got[1] == expect[1] and got[2] == expect[2]


def test_overlapped_copy_is_guarded_by_optimizer_step(fc_env: FcEnv, agent: RunningAgent) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    with flashckpt.checkpointing(
        model, opt, **fc_env.ckpt_kwargs(agent="connect", mode="overlap")
    ) as ckpt:
        for _ in range(2):
            model(torch.randn(4, 512)).sum().backward()
            opt.step()
        ckpt.step()
        ckpt.step()
        before = _params(model)
        momentum = _opt_tensors(opt)
        h = ckpt.save()
        assert h.taken
        model(torch.randn(4, 512)).sum().backward()
        opt.step()  # must wait for the copy of the pre-step values
        h.wait()
        assert h.done()
    loaded = flashckpt.load(fc_env.storage, step=2)
    for k, v in before.items():
        assert torch.equal(loaded.state["model"][k], v), k
    saved_m = [
        v
        for st in loaded.state["optimizer"]["state"].values()
        for v in st.values()
        if torch.is_tensor(v)
    ]
    for a, b in zip(saved_m, momentum, strict=True):
        assert torch.equal(a, b)


def test_save_never_mutates_callers_state(fc_env: FcEnv, agent: RunningAgent) -> None:
    model, opt, sched = make(0)
    train_step(model, opt, sched, 0)
    extras = {"pos": 1, "nested": {"a": [1, 2]}}
    sd_before = opt.state_dict()
    keys_before = set(model.state_dict())
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, extras=extras, **fc_env.ckpt_kwargs(agent="connect")
    ) as ckpt:
        ckpt.step()
        ckpt.save(mode="sync")
        extras["nested"]["a"].append(3)  # later edits do not leak into the taken snapshot
    assert set(model.state_dict()) == keys_before
    assert opt.state_dict()["param_groups"] == sd_before["param_groups"]
    assert set(opt.state_dict()["state"]) == set(sd_before["state"])
    loaded = flashckpt.load(fc_env.storage, step=1)
    assert loaded.ranks[0]["extras"] == {"pos": 1, "nested": {"a": [1, 2]}}


def test_mismatched_model_lists_keys_and_shapes(fc_env: FcEnv, agent: RunningAgent) -> None:
    _run(fc_env, 3)
    other = torch.nn.Sequential(
        torch.nn.Linear(16, 8), torch.nn.Linear(8, 1), torch.nn.Linear(1, 1)
    )
    ck = flashckpt.checkpointing(other, **fc_env.ckpt_kwargs(agent="connect"))
    with pytest.raises(ValueError) as ei:
        ck.__enter__()
    msg = str(ei.value)
    assert "missing keys" in msg and "2.weight" in msg
    assert "unexpected keys" in msg and "1.running_mean" in msg
    assert "shape mismatches" in msg and "0.weight: checkpoint (32, 16) vs model (8, 16)" in msg


def test_unsupported_state_is_a_type_error_naming_the_key(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    class Weird:
        def state_dict(self):
            return {"handle": object()}

        def load_state_dict(self, sd):
            pass

    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, stateful={"w": Weird(), "s": sched}, **fc_env.ckpt_kwargs(agent="connect")
    ) as ck:
        ck.step()
        with pytest.raises(TypeError, match=r"stateful/w/handle"):
            ck.save()
        del ck.stateful["w"]
        ck.extras["bad"] = {1, 2}
        with pytest.raises(TypeError, match="extras must be JSON"):
            ck.save()
        ck.extras.pop("bad")
        assert ck.save().taken


def test_skip_policy_reports_every_skip(fc_env: FcEnv, agent: RunningAgent) -> None:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        **fc_env.ckpt_kwargs(agent="connect", when_busy="skip", storage=None),
    ) as ck:
        ck.step()
        assert ck.save(mode="sync").taken
        for sm in ck._snap.slots:
            sm.slot.pin(0)  # as the agent does while persisting
        ck.step()
        with pytest.warns(UserWarning, match="step 2 skipped"):
            h = ck.save()
        assert not h.taken and h.skipped
        assert ck.stats.skips == 1 and ck.stats.skipped_steps == [2]
        assert ck.status()["skips"] == 1
        for sm in ck._snap.slots:
            sm.slot.unpin()
        ck.step()
        assert ck.save().taken


def test_unwritable_storage_is_refused_at_entry(fc_env: FcEnv, tmp_path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the checkpoint directory should be")
    url = f"file://{blocker}/ckpt"
    model, opt, sched = make(0)
    ck = flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect", storage=url)
    )
    with pytest.raises(flashckpt.StorageUnavailableError) as ei:
        ck.__enter__()  # no agent runs: the probe comes before the agent is needed
    msg = str(ei.value)
    assert url in msg and ("Not a directory" in msg or "NotADirectoryError" in msg), msg
    assert isinstance(ei.value, OSError) and isinstance(ei.value, flashckpt.FlashckptError)
    assert blocker.read_text().startswith("a file")  # nothing was written over it


def test_full_storage_is_refused_at_entry(fc_env: FcEnv, tmp_path) -> None:
    import errno

    with sized_tmpfs(tmp_path / "full", "64k") as mnt:
        (mnt / "ckpt").mkdir()
        with open(mnt / "filler", "wb", buffering=0) as f:  # fill it up: a real ENOSPC
            with pytest.raises(OSError) as full:
                while True:
                    f.write(b"x" * 4096)
            assert full.value.errno == errno.ENOSPC
        model, opt, sched = make(0)
        ck = flashckpt.checkpointing(
            model, opt, scheduler=sched, **fc_env.ckpt_kwargs(storage=f"file://{mnt}/ckpt")
        )
        with pytest.raises(flashckpt.StorageUnavailableError, match=r"No space left on device"):
            ck.__enter__()
        assert os.listdir(mnt / "ckpt") == []  # the probe left nothing behind


def test_sync_and_overlap_snapshots_are_identical(fc_env: FcEnv, agent: RunningAgent) -> None:
    results = []
    for mode in ("sync", "overlap"):
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model,
            opt,
            scheduler=sched,
            every=0,
            # the second run replaces the first one's step (read just before)
            **fc_env.ckpt_kwargs(agent="connect", mode=mode, restore=False, overwrite=True),
        ) as ck:
            for step in range(4):
                train_step(model, opt, sched, step)
                ck.step()
            ck.save()
        results.append(flashckpt.load(fc_env.storage, step=4).state)
    a, b = results
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k])


def test_corrupt_storage_falls_back_to_previous_step(fc_env: FcEnv, agent: RunningAgent) -> None:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect", every=3)
    ) as ck:
        for step in range(9):
            train_step(model, opt, sched, step)
            if ck.step() is not None:
                assert ck.flush() == step + 1  # commit each snapshot: 3, 6, 9
    agent.stop()
    assert sorted(int(p.name[5:]) for p in fc_env.storage_path.glob("step-*")) == [3, 6, 9]
    shard = fc_env.storage_path / "step-000000009" / "shard-00000-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x01
    shard.write_bytes(bytes(raw))
    a2 = RunningAgent(fc_env.agent_config())
    try:
        model, opt, sched = make(0)
        with (
            pytest.warns(
                UserWarning,
                match=r"step-000000009/shard-00000-of-00001.safetensors fails its checksum",
            ),
            flashckpt.checkpointing(
                model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect")
            ) as ck,
        ):
            assert ck.start_step == 6 and ck.restored_from == "storage"
    finally:
        a2.stop()
    assert flashckpt.load(fc_env.storage, step=6).step == 6


def test_auto_started_agent_serves_and_exits(fc_env: FcEnv) -> None:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every=2, **fc_env.ckpt_kwargs()
    ) as ck:
        pid = ck.status()["agent"]["pid"]
        assert pid != os.getpid()
        for step in range(4):
            train_step(model, opt, sched, step)
            ck.step()
    assert flashckpt.load(fc_env.storage).step == 4
    import psutil

    try:
        psutil.Process(pid).wait(timeout=30)  # exit_when_done: it goes away by itself
    except psutil.NoSuchProcess:
        pass
    assert fc_env.segments() == []
    assert batch(0)[0].shape == (8, 16)


def test_too_small_shm_is_a_clear_error_at_entry(fc_env: FcEnv, tmp_path) -> None:

    with sized_tmpfs(tmp_path / "shm", "4m") as mnt:
        a = RunningAgent(fc_env.agent_config(shm_dir=str(mnt)))
        try:
            model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights + 8 MiB of Adam state
            opt = torch.optim.Adam(model.parameters())
            ck = flashckpt.checkpointing(
                model, opt, **fc_env.ckpt_kwargs(agent="connect", shm_dir=str(mnt))
            )
            with pytest.raises(flashckpt.ShmSpaceError, match=r"MiB free but .*--shm-size"):
                ck.__enter__()
        finally:
            a.stop()
        assert [n for n in os.listdir(mnt) if not n.endswith(".owner")] == []


def test_memory_fsspec_storage(fc_env: FcEnv) -> None:
    import uuid

    url = f"memory://fc-{uuid.uuid4().hex}"
    env = FcEnv(job=fc_env.job, node="n0", run_dir=fc_env.run_dir, storage=url, storage_path=None)  # type: ignore[arg-type]
    a = RunningAgent(env.agent_config())  # in-process: memory:// is per process
    try:
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, every=2, **env.ckpt_kwargs(agent="connect")
        ) as ck:
            for step in range(4):
                train_step(model, opt, sched, step)
                ck.step()
        loaded = flashckpt.load(url)
        assert loaded.step == 4
        for k, v in model.state_dict().items():
            assert torch.equal(loaded.state["model"][k], v)
    finally:
        a.stop()
