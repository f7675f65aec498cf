"""A checkpoint saved through DistributedDataParallel (``module.``) or torch.compile
(``_orig_mod.``) restores into the same model without the wrapper, and the other way round,
when the prefix is the only difference; otherwise the error names the prefix (issue 30)."""

from __future__ import annotations

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import batch, make

import flashckpt
from flashckpt.trainer.restore.apply import wrapper_prefix


class Wrapped(torch.nn.Module):
    """A wrapper with the key prefix of DDP (``module``) or torch.compile (``_orig_mod``),
    without a process group or a compiler: the state dict is what matters here."""

    def __init__(self, inner: torch.nn.Module, attr: str) -> None:
        super().__init__()
        setattr(self, attr, inner)
        self.attr = attr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.attr)(x)


def _train(model: torch.nn.Module, opt, sched, steps: range, ckpt) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        ckpt.step()


@pytest.mark.parametrize(
    ("saved_as", "restored_as"),
    [("module", None), ("_orig_mod", None), (None, "module"), ("module", "_orig_mod")],
)
def test_a_wrapper_prefix_alone_restores_bitwise(
    fc_env: FcEnv, agent: RunningAgent, saved_as: str | None, restored_as: str | None
) -> None:
    kw = fc_env.ckpt_kwargs(agent="connect")
    inner, opt, sched = make(0)
    model = Wrapped(inner, saved_as) if saved_as else inner
    with flashckpt.checkpointing(model, opt, scheduler=sched, every=2, **kw) as ckpt:
        _train(model, opt, sched, range(4), ckpt)
    want = {k: v.clone() for k, v in inner.state_dict().items()}
    want_opt = [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]

    inner2, opt2, sched2 = make(1)
    model2 = Wrapped(inner2, restored_as) if restored_as else inner2
    with flashckpt.checkpointing(model2, opt2, scheduler=sched2, every=2, **kw) as ck2:
        assert ck2.start_step == 4
        for k, v in inner2.state_dict().items():
            assert torch.equal(v, want[k]), k
        got_opt = [v for st in opt2.state.values() for v in st.values() if torch.is_tensor(v)]
        assert len(got_opt) == len(want_opt)
        for a, b in zip(got_opt, want_opt, strict=True):
            assert torch.equal(a, b)


def test_a_prefix_with_other_differences_is_refused_naming_it(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    kw = fc_env.ckpt_kwargs(agent="connect")
    inner, opt, sched = make(0)
    model = Wrapped(inner, "module")
    with flashckpt.checkpointing(model, opt, scheduler=sched, every=2, **kw) as ckpt:
        _train(model, opt, sched, range(2), ckpt)
    # Another architecture (one more layer) without the wrapper: never a partial mapping.
    inner2, _, _ = make(1)
    other = torch.nn.Sequential(*inner2, torch.nn.Linear(1, 1))
    opt3 = torch.optim.SGD(other.parameters(), lr=0.1)
    sched3 = torch.optim.lr_scheduler.StepLR(opt3, 1)
    with (
        pytest.raises(ValueError) as err,
        flashckpt.checkpointing(other, opt3, scheduler=sched3, **kw),
    ):
        pass
    text = str(err.value)
    assert "the checkpoint's keys all start with 'module.'" in text, text
    assert "DistributedDataParallel" in text, text
    assert "restore into the same architecture" in text, text


def test_wrapper_prefix_maps_whole_sets_only() -> None:
    assert wrapper_prefix({"module.a", "module.b"}, {"a", "b"}) == ("module.", "checkpoint")
    assert wrapper_prefix({"a", "b"}, {"_orig_mod.a", "_orig_mod.b"}) == ("_orig_mod.", "model")
    assert wrapper_prefix({"module.a", "module.b"}, {"a"}) is None
    assert wrapper_prefix({"module.a", "b"}, {"a", "b"}) is None
    assert wrapper_prefix({"a"}, {"a"}) is None
