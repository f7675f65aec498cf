"""The restore pipeline: planning over the sources, and a source added by one class in one list."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_step

import flashckpt
import flashckpt.trainer.restore.pipeline
from flashckpt.format.shm import Slot
from flashckpt.format.storage import CorruptCheckpointError
from flashckpt.state.rng import capture_rng
from flashckpt.trainer.rankctx import RankContext
from flashckpt.trainer.restore.pipeline import SOURCES, agree
from flashckpt.trainer.restore.saved import RestoreEnv, RestorePlan, SavedStep


class _Offers:
    """A fake source offering fixed steps (a whole-world one offers only wanted steps)."""

    def __init__(self, name: str, steps: list[int], whole_world: bool = False) -> None:
        self.name, self.steps, self.whole_world = name, steps, whole_world
        self.asked: list[int] = []

    def offer(self, excluded: set[int], wanted: Callable[[int], bool]) -> list[int]:
        out = []
        for s in sorted(self.steps, reverse=True):
            if s in excluded:
                continue
            self.asked.append(s)
            if not wanted(s):
                break
            out.append(s)
            if self.whole_world:
                break
        return out

    def prepare(self, plan: RestorePlan) -> None:
        pass

    def read(self, plan: RestorePlan) -> SavedStep:
        raise AssertionError("not read in planning")

    def drop(self, step: int) -> None:
        pass


def _env() -> RestoreEnv:
    env = RestoreEnv.__new__(RestoreEnv)  # planning only uses the rank context
    env.ctx = RankContext()
    return env


def test_newest_step_wins_and_earlier_sources_are_preferred() -> None:
    mem, st = _Offers("memory", [5, 3]), _Offers("storage", [7, 5, 3])
    plan = agree(_env(), [mem, st], set())
    assert plan is not None and (plan.step, plan.sources) == (7, {0: "storage"})
    plan = agree(_env(), [mem, st], {7})
    assert plan is not None and (plan.step, plan.sources, plan.tier) == (5, {0: "memory"}, 0)
    assert agree(_env(), [mem, st], {7, 5, 3}) is None


def test_a_whole_world_source_beats_a_less_preferred_plan_only() -> None:
    # At the same step: own memory beats a rebuild from all ranks' memory, which beats storage.
    peer = _Offers("memory-reshard", [5], whole_world=True)
    plan = agree(_env(), [_Offers("memory", [5]), peer, _Offers("storage", [5])], set())
    assert plan is not None and plan.sources == {0: "memory"}
    assert peer.asked == [5]  # asked, and told that 5 is not wanted
    peer = _Offers("memory-reshard", [5], whole_world=True)
    plan = agree(_env(), [_Offers("memory", [3]), peer, _Offers("storage", [5])], set())
    assert plan is not None and (plan.step, plan.sources) == (5, {0: "memory-reshard"})
    # A newer step from memory: the whole-world source is not wanted at an older one.
    peer = _Offers("memory-reshard", [4], whole_world=True)
    plan = agree(_env(), [_Offers("memory", [6]), peer], set())
    assert plan is not None and plan.step == 6 and peer.asked == [4]


def test_the_registered_sources_in_order_of_preference() -> None:
    assert [s.name for s in SOURCES] == [  # type: ignore[attr-defined]
        "memory",
        "memory-reshard",
        "replica",
        "peer-memory",
        "storage",
    ]


def test_a_peer_replica_is_preferred_to_storage_and_own_memory_to_it() -> None:
    """A peer's replica of a step serves before storage; this rank's own memory before it."""

    def plan(mem: list[int], peer: list[int], st: list[int]) -> tuple[int, dict[int, str]]:
        sources = [_Offers("memory", mem), _Offers("peer-memory", peer), _Offers("storage", st)]
        got = agree(_env(), sources, set())
        assert got is not None
        return got.step, got.sources

    assert plan([], [8], [6]) == (8, {0: "peer-memory"})
    assert plan([8], [8], [8]) == (8, {0: "memory"})
    assert plan([], [8], [8]) == (8, {0: "peer-memory"})
    assert plan([6], [], [6]) == (6, {0: "memory"})


class _DiskSource:
    """A new source (a local-disk tier, say): states kept by step; some of them corrupt."""

    name = "disk"
    whole_world = False
    states: dict[int, dict[str, Any]] = {}
    corrupt: set[int] = set()

    def __init__(self, env: RestoreEnv) -> None:
        self.env = env

    def offer(self, excluded: set[int], wanted: Callable[[int], bool]) -> list[int]:
        return sorted(set(self.states) - excluded, reverse=True)

    def prepare(self, plan: RestorePlan) -> None:
        pass

    def read(self, plan: RestorePlan) -> SavedStep:
        if plan.step in self.corrupt:
            raise CorruptCheckpointError(f"disk/{plan.step}", "fails its checksum (corrupted)")
        saved = self.states[plan.step]
        private = {"rng": capture_rng(), "extras": {"pos": plan.step}}
        return SavedStep(plan.step, self.name, saved, private)

    def drop(self, step: int) -> None:
        pass


def _state_of(model: torch.nn.Module, opt: Any, sched: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
    }


def test_a_new_source_is_one_class_in_one_list(
    fc_env: FcEnv, agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt, sched = make(0)
    states = {}
    for step in range(6):
        train_step(model, opt, sched, step)
        if step + 1 in (4, 6):
            states[step + 1] = _state_of(model, opt, sched)
    want = {k: v.clone() for k, v in states[4]["model"].items()}
    monkeypatch.setattr(_DiskSource, "states", states)
    monkeypatch.setattr(_DiskSource, "corrupt", {6})
    monkeypatch.setattr(flashckpt.trainer.restore.pipeline, "SOURCES", (*SOURCES, _DiskSource))
    model2, opt2, sched2 = make(1)
    extras: dict[str, Any] = {}
    kw = fc_env.ckpt_kwargs(agent="connect", storage=None)
    # Step 6 fails its read: the pipeline says so and takes the next older step it can obtain.
    with pytest.warns(UserWarning, match="cannot restore step 6: .*corrupted.*; trying an older"):
        ck = flashckpt.checkpointing(model2, opt2, scheduler=sched2, extras=extras, **kw)
        ck.__enter__()
    try:
        assert (ck.restored_from, ck.start_step) == ("disk", 4)
        assert extras == {"pos": 4}
        assert ck.status()["restore"]["source"] == "disk"
        got = model2.state_dict()
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        assert sched2.state_dict()["last_epoch"] == states[4]["scheduler"]["last_epoch"]
    finally:
        ck.__exit__(None, None, None)


def test_a_slot_whose_description_fails_its_checks_is_ignored(
    fc_env: FcEnv, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing read from shared memory is trusted: a complete snapshot whose description lacks
    a field (here its private state) is skipped by the memory source, not read (a KeyError at
    entry before). Memory only: an agent with storage would hold the step there, and a start
    from step 0 over it is refused without overwrite=True."""
    agent = RunningAgent(fc_env.agent_config(storage=None))
    try:
        _a_bad_description_is_ignored(fc_env, caplog)
    finally:
        agent.stop()


def _a_bad_description_is_ignored(fc_env: FcEnv, caplog: pytest.LogCaptureFixture) -> None:
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(agent="connect", storage=None)
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        train_step(model, opt, sched, 0)
        ck.step()
        ck.save(mode="sync")
        path = next(sm.slot.path for sm in ck._snap.slots if sm is not None and sm.step == 1)
    slot = Slot(path)
    try:
        info = slot.header()
        assert info is not None and info.complete
        meta = slot.read_meta(info)
        assert meta is not None
        del meta["private"]
        raw = json.dumps(meta, separators=(",", ":")).encode()
        seq = slot.begin_write()
        slot.write_meta(raw)
        slot.end_write(seq, 1, raw, info.data_len)
    finally:
        slot.close()
    model2, opt2, sched2 = make(1)
    ck2 = flashckpt.checkpointing(model2, opt2, scheduler=sched2, **kw)
    with caplog.at_level(logging.WARNING, logger="flashckpt"), ck2:
        assert (ck2.restored_from, ck2.start_step) == (None, 0)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"the snapshot of step 1 in {path} is not used: its description is invalid" in text
    # Nothing else to restore from (no storage): said with the snapshot and its damage.
    assert "restored nothing and starts from step 0: the snapshot of step 1" in text, text


@pytest.mark.parametrize(("restarts", "with_storage"), [("0", False), ("2", False), ("2", True)])
def test_a_restart_that_finds_nothing_to_restore_warns_that_the_work_is_lost(
    fc_env: FcEnv,
    agent: RunningAgent,
    monkeypatch: pytest.MonkeyPatch,
    restarts: str,
    with_storage: bool,
) -> None:
    """A restarted job that restores nothing (memory only, the machine holding a step gone)
    starts from step 0: a warning says the work before the failure is lost, not an info line;
    a first start says nothing of the kind. The advice fits the job: "give the job storage="
    only to a job without storage (one with storage is told its storage holds no step)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restarts)
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(agent="connect", **({} if with_storage else {"storage": None}))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ck = flashckpt.checkpointing(model, opt, scheduler=sched, **kw)
        ck.__enter__()
    try:
        assert (ck.restored_from, ck.start_step) == (None, 0)
        lost = [str(w.message) for w in seen if "starts from step 0 on restart" in str(w.message)]
        if restarts == "0":
            assert lost == []
        else:
            assert len(lost) == 1 and "restart 2 of the job" in lost[0], lost
            if with_storage:
                assert "give the job storage=" not in lost[0], lost[0]
                assert "holds no committed step" in lost[0] and fc_env.storage in lost[0]
            else:
                assert "give the job storage=" in lost[0], lost[0]
    finally:
        ck.__exit__(None, None, None)
