"""Restores hand the optimizer state tensors of its own: copied into the optimizer's current state
where it has some, else into one pre-mapped block; never views of the slot or the shard buffer."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from fchelpers import FcEnv, RunningAgent

import flashckpt
from flashckpt.trainer.restore.apply import clone_tensors as _clone_tensors

HUGE = 2 << 20


def _make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 1024)).square().mean().backward()
        opt.step()


def _state(opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for st in opt.state.values() for k, v in st.items() if torch.is_tensor(v)]


def _copy(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for _, v in _state(opt)]


def _checkpointing(
    env: FcEnv, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> flashckpt.Checkpointer:
    """The test's checkpointer, on the agent of the ``agent`` fixture."""
    return flashckpt.checkpointing(model, opt, **env.ckpt_kwargs(agent="connect"))


def _shm_ranges(env: FcEnv) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of the job's slot files."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if f"/dev/shm/fc.{env.job}." in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                out.append((lo, hi))
    return out


def _in(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= t.data_ptr() < hi for lo, hi in ranges)


@dataclass
class Saved:
    """A model and optimizer trained two steps, snapshotted at step 2 and committed."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    state: list[torch.Tensor]
    """A copy of the optimizer state at step 2."""


@pytest.fixture
def saved(fc_env: FcEnv, agent: RunningAgent) -> Saved:
    model, opt = _make(0)
    _train(model, opt, 2)
    with _checkpointing(fc_env, model, opt) as ck:
        ck.step()
        ck.step()
        ck.save(mode="sync")
        assert ck.flush() == 2
    return Saved(model, opt, _copy(opt))


def test_memory_restore_copies_into_existing_optimizer_state(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    model, opt = _make(0)
    _train(model, opt, 2)
    with _checkpointing(fc_env, model, opt) as ck:
        ck.step()
        ck.step()
        ck.save(mode="sync")
        saved = _copy(opt)
        _train(model, opt, 2)  # the live state moves on; the restore must bring step 2 back
        assert any(not torch.equal(a, b) for a, b in zip(_copy(opt), saved, strict=True))
    before = {(id(p), k): v for p, st in opt.state.items() for k, v in st.items()}
    with _checkpointing(fc_env, model, opt) as ck:
        assert ck.start_step == 2 and ck.restored_from == "memory"
        slots = _shm_ranges(fc_env)
        assert slots, "the restored trainer maps no slot file"
        after = {(id(p), k): v for p, st in opt.state.items() for k, v in st.items()}
        assert after.keys() == before.keys()
        for key, t in after.items():
            assert t is before[key], f"{key[1]}: a new tensor instead of a copy in place"
            assert not _in(t, slots), "views the slot"
        for a, b in zip(_copy(opt), saved, strict=True):
            assert torch.equal(a, b)
        _train(model, opt, 1)  # the optimizer keeps working on its restored state


def test_memory_restore_into_fresh_optimizer_uses_one_block(fc_env: FcEnv, saved: Saved) -> None:
    model2, opt2 = _make(1)  # a restarted trainer: no optimizer state yet
    with _checkpointing(fc_env, model2, opt2) as ck:
        assert ck.restored_from == "memory"
        slots = _shm_ranges(fc_env)
        state = _state(opt2)
        assert len(state) == len(saved.state)
        for (_, a), b in zip(state, saved.state, strict=True):
            assert torch.equal(a, b)
            assert not _in(a, slots), "views the slot"
        blocks = {v.untyped_storage().data_ptr() for _, v in state}
        assert len(blocks) == 1, "the state is not carved out of one block"
        assert min(v.data_ptr() for _, v in state) % HUGE == 0
        _train(model2, opt2, 1)


def test_storage_restore_does_not_keep_the_shard_buffer(
    fc_env: FcEnv, agent: RunningAgent, saved: Saved
) -> None:
    agent.stop()  # removes the slots: the next restore reads storage
    shard = fc_env.storage_path / "step-000000002" / "shard-00000-of-00001.safetensors"
    shard_bytes = os.path.getsize(shard)
    again = RunningAgent(fc_env.agent_config())
    try:
        model2, opt2 = _make(1)
        with _checkpointing(fc_env, model2, opt2) as ck:
            assert ck.restored_from == "storage"
            state = _state(opt2)
            for (_, a), b in zip(state, saved.state, strict=True):
                assert torch.equal(a, b)
            opt_bytes = sum(v.nbytes for _, v in state)
            for _, v in state:
                # Before: views into the whole shard buffer (model bytes included).
                size = v.untyped_storage().nbytes()
                assert size < shard_bytes and size <= opt_bytes + 64 * len(state) + HUGE
    finally:
        again.stop()


def test_clone_tensors_targets_aliases_and_kept_values() -> None:
    a = torch.arange(6.0)
    b = torch.ones(2, 3, dtype=torch.bfloat16)
    big = torch.randn(1 << 19)  # 2 MiB: the pre-mapped block
    keep = torch.zeros(3)
    dst = torch.empty(6)
    tree = {"a": a, "pair": (b, a), "big": [big, 7], "keep": keep, "s": "x"}
    out = _clone_tensors(tree, into={"a": dst, "keep": keep, "big": [torch.empty(3)]})
    assert out["a"] is dst and torch.equal(dst, a)
    assert out["pair"][1] is dst  # the same tensor twice stays one tensor
    assert out["keep"] is keep
    assert torch.equal(out["pair"][0], b) and out["pair"][0].data_ptr() != b.data_ptr()
    assert torch.equal(out["big"][0], big) and out["big"][0].data_ptr() != big.data_ptr()
    assert out["pair"][0].untyped_storage().data_ptr() == out["big"][0].untyped_storage().data_ptr()
    assert min(out["pair"][0].data_ptr(), out["big"][0].data_ptr()) % HUGE == 0
    assert out["big"][1] == 7 and out["s"] == "x" and isinstance(out["pair"], tuple)
    big.fill_(0)  # the copies are independent of their sources
    assert out["big"][0].abs().sum() > 0


def test_rejected_optimizer_state_leaves_the_optimizer_untouched(
    fc_env: FcEnv, saved: Saved
) -> None:
    layers = list(saved.model.children())
    other = torch.optim.AdamW(
        [{"params": layers[0].parameters()}, {"params": layers[1].parameters()}], lr=1e-2
    )
    _train(saved.model, other, 1)
    before = _copy(other)
    ck = _checkpointing(fc_env, saved.model, other)
    with pytest.raises(ValueError, match="parameter groups"):
        ck.__enter__()
    for a, b in zip(_copy(other), before, strict=True):
        assert torch.equal(a, b)


def test_state_that_load_state_dict_casts_is_copied_once_and_owned(
    fc_env: FcEnv, saved: Saved
) -> None:
    model2, _ = _make(1)
    model2 = model2.to(torch.bfloat16)  # the same layout in another dtype: the moments get cast
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    with _checkpointing(fc_env, model2, opt2) as ck:
        assert ck.restored_from == "memory"
        slots = _shm_ranges(fc_env)
        state = _state(opt2)
        for (key, a), b in zip(state, saved.state, strict=True):
            want = b if key == "step" else b.to(torch.bfloat16)
            assert a.dtype == want.dtype and torch.equal(a, want), key
            assert not _in(a, slots), "views the slot"
