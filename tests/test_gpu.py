"""GPU paths: device -> pinned shared memory on a side stream. Skipped without CUDA."""

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
        assert all(p.is_cuda for p in model2.parameters())
        assert all(v.is_cuda for st in opt2.state.values() for v in st.values() if v.dim())
