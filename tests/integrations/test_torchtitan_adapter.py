"""flashckpt.integrations.torchtitan against a stand-in for torchtitan's CheckpointManager.

torchtitan is not in the dev extra (its ``datasets<4.8`` pin would install a huggingface_hub that
transformers, which the Hugging Face adapter's tests need, refuses), so the stand-in below has the
interface the adapter uses: ``enable``, ``async_mode``, ``exclude_from_loading``, ``load_only``,
``folder``, the ``states`` dict (``model`` a ModelWrapper holding ``.model``, the model parts;
``optimizer``, ``lr_scheduler``, ``dataloader`` whose state is pickled bytes as torchtitan's is,
``train_state``), ``save(curr_step, last_step=False)``, ``load(step=-1) -> bool``, ``close()``.
The node agent is real (served from a thread), and so are the model, optimizer and scheduler.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import batch, make

from flashckpt.integrations.torchtitan import FlashCheckpointManager


class _ModelWrapper:
    def __init__(self, parts: list[torch.nn.Module]) -> None:
        self.model = parts

    def state_dict(self) -> dict[str, Any]:
        return {k: v for p in self.model for k, v in p.state_dict().items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for p in self.model:
            p.load_state_dict(sd, strict=False)


class _Loader:
    """A data position kept the way torchtitan's ParallelAwareDataloader keeps it: pickled. As
    torch's DataLoader does, making an iterator draws a seed from torch's RNG (which torchtitan
    does after load())."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self):
        torch.empty((), dtype=torch.int64).random_()  # DataLoader's _base_seed
        return self._batches()

    def _batches(self):
        while True:  # pos counts the batches handed out, as a StatefulDataLoader does
            self.pos += 1
            yield batch(self.pos - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"dp_rank_0": pickle.dumps({"pos": self.pos}), "world_size": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = pickle.loads(sd["dp_rank_0"])["pos"]


class _TrainState:
    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


class _StandInManager:
    """torchtitan's CheckpointManager as the adapter sees it; counts the calls it gets."""

    def __init__(self, model, opt, sched, loader, train_state, **config: Any) -> None:
        self.enable = True
        self.async_mode = config.get("async_mode", "disabled")
        self.exclude_from_loading = config.get("exclude_from_loading", [])
        self.load_only = False
        self.folder = "/nonexistent/checkpoint"
        self.states = {"train_state": train_state}
        self.states.update(
            model=_ModelWrapper([model]), optimizer=opt, lr_scheduler=sched, dataloader=loader
        )
        self.calls: list[tuple] = []

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        self.calls.append(("save", curr_step, last_step))
        return True

    def load(self, step: int = -1) -> bool:
        self.calls.append(("load", step))
        return False

    def close(self) -> None:
        self.calls.append(("close",))


def _job(seed: int, env: FcEnv | None, until: int, *, total: int = 8, **config: Any):
    """A torchtitan-shaped loop: load once, then train, save(step) after every step, close."""
    model, opt, sched = make(seed)
    loader, ts = _Loader(), _TrainState()
    manager = _StandInManager(model, opt, sched, loader, ts, **config)
    ck = None
    if env is not None:
        ck = FlashCheckpointManager(manager, every=2, **env.ckpt_kwargs(agent="connect"))
        ck.load()
    it = iter(loader)
    while ts.step < until:
        ts.step += 1
        x, y = next(it)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ts.ntokens_seen += x.shape[0]
        if ck is not None:
            ck.save(ts.step, last_step=ts.step == total)
    if ck is not None:
        ck.close()
    return model, opt, sched, loader, ts, manager, ck


def _opt_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def _assert_same(a, b) -> None:
    (ma, oa, sa), (mb, ob, sb) = a, b
    for (k, va), (_, vb) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert torch.equal(va, vb), k
    ta, tb = _opt_tensors(oa), _opt_tensors(ob)
    assert len(ta) == len(tb) > 0
    assert all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))
    assert sa.state_dict() == sb.state_dict()


def test_save_then_load_in_a_new_process_state_resumes_bitwise(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    torch.manual_seed(7)
    ref = _job(0, None, 8)
    torch.manual_seed(7)
    first = _job(0, fc_env, 5)
    assert first[6].restored_from is None
    assert ("load", -1) in first[5].calls  # nothing in flashckpt: torchtitan's own load ran
    assert first[5].calls[-1] == ("close",)
    saved = {k: v.clone() for k, v in first[0].state_dict().items()}

    # A new process state: other weights, other RNG; the adapter restores step 5.
    torch.manual_seed(99)
    model, opt, sched = make(1)
    loader, ts = _Loader(), _TrainState()
    manager = _StandInManager(model, opt, sched, loader, ts)
    ck = FlashCheckpointManager(manager, every=2, **fc_env.ckpt_kwargs(agent="connect"))
    assert ck.load() is True
    assert (ck.restored_step, ck.restored_from) == (5, "memory")
    assert ("load", -1) not in manager.calls
    assert (ts.step, ts.ntokens_seen, loader.pos) == (5, 40, 5)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    _assert_same((model, opt, sched), first[:3])

    # Continue to the end: the same trajectory as the uninterrupted run, bitwise.
    it = iter(loader)
    while ts.step < 8:
        ts.step += 1
        x, y = next(it)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ts.ntokens_seen += x.shape[0]
        ck.save(ts.step, last_step=ts.step == 8)
    ck.close()
    _assert_same((model, opt, sched), ref[:3])
    assert ("save", 8, True) in manager.calls  # torchtitan's final export still runs
    assert ck.ckpt is not None and ck.ckpt.steps_done == 8


def test_settings_it_cannot_honour_are_refused(fc_env: FcEnv, agent: RunningAgent) -> None:
    model, opt, sched = make(0)
    parts = (model, opt, sched, _Loader(), _TrainState())
    kw = fc_env.ckpt_kwargs(agent="connect")
    with pytest.raises(ValueError, match="async_mode='disabled'"):
        FlashCheckpointManager(_StandInManager(*parts, async_mode="async"), **kw)
    with pytest.raises(NotImplementedError, match="exclude_from_loading"):
        FlashCheckpointManager(_StandInManager(*parts, exclude_from_loading=["model"]), **kw)
    with pytest.raises(ValueError, match=r"does not hold.*fix the key names"):
        FlashCheckpointManager(_StandInManager(*parts, exclude_from_loading=["datalaoder"]), **kw)
    ck = FlashCheckpointManager(_StandInManager(*parts), every=2, **kw)
    with pytest.raises(NotImplementedError, match="load_step=-1"):
        ck.load(step=3)
    try:
        ck.save(1)
        with pytest.raises(ValueError, match="once per training step"):
            ck.save(3)  # step 2 skipped: snapshots would be labelled off by one
    finally:
        ck.close()


class _Opaque:
    """A dataset position kept as an object: pickled, it names a class to import and build."""

    def __init__(self, pos: int) -> None:
        self.pos = pos


def test_loader_state_travels_as_plain_data_so_nothing_read_back_is_unpickled() -> None:
    """The loader's pickled ``dp_rank_0`` goes into the snapshot as the plain data it pickles;
    restored, the loader unpickles bytes the adapter made from plain values. A loader state
    that is not plain data is refused at save; a snapshot holding the pickled bytes (an older
    adapter's form) is refused at load, never unpickled."""
    loader = _Loader()
    loader.pos = 3
    parts = (*make(0), loader, _TrainState())
    ck = FlashCheckpointManager(_StandInManager(*parts), every=2)  # nothing started yet
    wrapped = ck._stateful["dataloader"]
    sd = wrapped.state_dict()
    assert sd == {"dp_rank_0": {"flashckpt_unpickled": {"pos": 3}}, "world_size": 1}
    loader.pos = 0
    got: list[bytes] = []
    loader.load_state_dict = lambda s: got.append(s["dp_rank_0"])  # type: ignore[method-assign]
    wrapped.load_state_dict(sd)
    assert pickle.loads(got[0]) == {"pos": 3} and got[0] == pickle.dumps({"pos": 3})

    # A loader state that is no plain data: refused at save, naming where it is.
    opaque = pickle.dumps({"pos": _Opaque(3)})
    loader.state_dict = lambda: {"dp_rank_0": opaque}  # type: ignore[method-assign]
    with pytest.raises(TypeError, match=r"\['dp_rank_0'\] \(unpickled\)\['pos'\] is a .*_Opaque"):
        wrapped.state_dict()
    # Bytes read from a snapshot (the older form, a uint8 tensor) never reach pickle.loads.
    blob = torch.frombuffer(bytearray(opaque), dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not hand bytes read from a snapshot"):
        wrapped.load_state_dict({"dp_rank_0": {"flashckpt_bytes": blob}, "world_size": 1})
    with pytest.raises(TypeError, match="plain data"):  # a rebuilt tree with a foreign value
        wrapped.load_state_dict({"dp_rank_0": {"flashckpt_unpickled": {"pos": object()}}})
    assert len(got) == 1


class _Container(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer's shape: an Optimizer over every parameter whose state
    lives in the optimizers of its ``optimizers`` list."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        half = len(params) // 2
        self.optimizers = [torch.optim.AdamW(params[:half]), torch.optim.SGD(params[half:], 0.1)]
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for o in self.optimizers:
            o.step()


def test_the_first_snapshot_fits_the_slots_reserved_for_an_optimizer_container() -> None:
    """The slots are reserved at entry from an estimate of the state: an optimizer container in
    stateful= (torchtitan's, before its first step) counts its optimizers' state, so the first
    snapshot does not outgrow the slots and reallocate them inside a training step (what made
    the first snapshot of a torchtitan run cost ~0.4 s), and estimating steps none of them."""
    from flashckpt.trainer.snapshot import _stateful_optimizer_bytes

    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))
    params = list(model.parameters())
    opt = _Container(params)
    before = [p.detach().clone() for p in params]
    estimate = _stateful_optimizer_bytes(opt)
    assert all(not o.state for o in opt.optimizers)  # nothing was stepped
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    actual = sum(
        v.numel() * v.element_size()
        for o in opt.optimizers
        for st in o.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    assert estimate == actual > 0


def test_a_loader_position_saved_at_another_data_parallel_degree_is_refused_or_excluded() -> None:
    """torchtitan's loader cannot reshard its position (its own load asserts; a rank whose
    dp_rank_N is missing only warns and restarts its data): a restore handing it one saved at
    another data-parallel degree raises, naming the fix, and exclude_from_loading leaves it out
    (the loader keeps its fresh position)."""
    from flashckpt.integrations.torchtitan import _LoaderState

    loader = _Loader()
    loader.dp_world_size = 2  # type: ignore[attr-defined]
    saved = _LoaderState(_Loader(), "dataloader").state_dict()  # world_size 1
    with pytest.raises(ValueError, match=r"degree of 1 and this run has 2.*exclude_from_loading"):
        _LoaderState(loader, "dataloader").load_state_dict(saved)
    loader.pos = 5
    _LoaderState(loader, "dataloader", excluded=True).load_state_dict(saved)
    assert loader.pos == 5
    loader.dp_world_size = 1  # type: ignore[attr-defined]
    _LoaderState(loader, "dataloader").load_state_dict(saved)
    assert loader.pos == 0
