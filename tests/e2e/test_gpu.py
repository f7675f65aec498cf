"""GPU paths: the slots registered with CUDA at entry, device -> registered shared memory on a
side stream, restore host -> device from registered memory. Skipped without CUDA (the same
logic against a stand-in CUDA runtime is in tests/test_auto_mode.py)."""

from __future__ import annotations

import pytest
import torch
from fchelpers import FcEnv, RunningAgent

import flashckpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_cuda_state_snapshots_and_restores(fc_env: FcEnv, agent: RunningAgent, mode: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    with flashckpt.checkpointing(
        model, opt, **fc_env.ckpt_kwargs(agent="connect", mode=mode)
    ) as ck:
        for _ in range(3):
            model(torch.randn(8, 256, device="cuda")).sum().backward()
            opt.step()
            ck.step()
        want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        ck.save()
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        opt.step()  # waits for the side-stream copy of the pre-step values
        ck.wait()
    loaded = flashckpt.load(fc_env.storage, step=3)
    for k, v in want.items():
        assert torch.equal(loaded.state["model"][k], v), k
    model2 = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256)).cuda()
    opt2 = torch.optim.AdamW(model2.parameters())
    with flashckpt.checkpointing(model2, opt2, **fc_env.ckpt_kwargs(agent="connect")) as ck2:
        assert ck2.start_step == 3 and ck2.restored_from == "memory"
        # the slots it restored from were registered at entry, before the restore read them
        assert all(sm is not None and sm.registered_cuda for sm in ck2._snap.slots)
        assert all(p.is_cuda for p in model2.parameters())
        assert all(v.is_cuda for st in opt2.state.values() for v in st.values() if v.dim())


def test_auto_mode_overlaps_on_cuda_and_registers_the_slots_at_entry(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    model = torch.nn.Linear(512, 512).cuda()
    opt = torch.optim.AdamW(model.parameters())
    ck = flashckpt.checkpointing(model, opt, every=0, **fc_env.ckpt_kwargs(agent="connect"))
    with ck:
        slots = [sm for sm in ck._snap.slots if sm is not None]
        assert len(slots) == 2 and ck.stats.saves == 0
        assert all(sm.registered_cuda and sm.data.is_pinned() for sm in slots)
        assert len(ck._snap.registrar.registered) == 2
        model(torch.randn(8, 512, device="cuda")).sum().backward()
        opt.step()
        ck.step()
        h = ck.save()
        assert ck.stats.copy_mode == "overlap" and ck.status()["copy_mode"]["resolved"] == "overlap"
        assert h._future is not None  # the bulk went to the copy thread
        h.wait()
        assert len(ck._snap.registrar.registered) == 2  # save() registered nothing more
    assert ck._snap.registrar.registered == {}
    assert not any(sm.data.is_pinned() for sm in slots)  # unregistered at close


def test_overlapped_copy_orders_after_work_on_the_callers_stream(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    """The copy thread's own current stream is the default one: a copy ordered after it alone
    would read parameters a kernel queued on the user's stream before save() still changes."""
    model = torch.nn.Linear(1024, 1024, bias=False).cuda()  # no buffers: nothing syncs in save()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    side = torch.cuda.Stream()
    with flashckpt.checkpointing(
        model, opt, every=0, **fc_env.ckpt_kwargs(agent="connect", mode="overlap")
    ) as ck:
        with torch.cuda.stream(side):
            model(torch.randn(8, 1024, device="cuda")).sum().backward()
            opt.step()
            ck.step()
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the update below
            with torch.no_grad():
                model.weight.add_(1.0)
            h = ck.save()
        h.wait()
        side.synchronize()
        want = model.weight.detach().cpu().clone()
    loaded = flashckpt.load(fc_env.storage, step=1)
    assert torch.equal(loaded.state["model"]["weight"], want)


def test_a_refused_registration_is_cleared_and_cuda_goes_on(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    model = torch.nn.Linear(64, 64).cuda()
    with flashckpt.checkpointing(model, every=0, **fc_env.ckpt_kwargs(agent="connect")) as ck:
        sm = ck._snap.slots[0]
        assert sm.registered_cuda
        # Registering it again: CUDA refuses (already registered); the code is checked.
        assert not ck._snap.registrar.register_range(sm.data.data_ptr(), 4096, "a test range")
        x = torch.ones(1024, device="cuda") * 2  # no stale error surfaces in a later launch
        torch.cuda.synchronize()
        assert float(x.sum()) == 2048.0
        ck.step()
        assert ck.save().taken
