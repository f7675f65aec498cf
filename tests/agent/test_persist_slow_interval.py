"""Slow storage keeps ``persist_every`` (issue 30): while the node agent writes a marked
snapshot from a copy (it let the slot go so the trainer need not wait for storage), the trainer
counts that mark as pending, not lost, and marks no other snapshot in its place. Before, the
mark passed to each new snapshot as soon as the marked one left its slot, so the agent started
the next persist as soon as one ended: one persist per write time, whatever the interval.

Storage is slowed in the agent's process (every 1 MiB chunk of a shard write waits), as in
``benchmarks/slow_storage_persist.py``; the agent runs in a thread of this process."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from fchelpers import FcEnv, RunningAgent
from slowfs import slow_storage_writes
from tinytrain import make, train_step
from waiting import wait_until

import flashckpt
from flashckpt.agent.persist import Persister


def test_no_mark_is_passed_on_while_the_agent_writes_from_a_copy(
    fc_env: FcEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_storage_writes(monkeypatch, 0.1)  # a ~4.5 MB shard takes ~0.5 s: many steps
    # The agent's persists written from a copy: `staged` names the one in flight (None: none
    # is), `done` counts those that ended.
    flight: dict[str, Any] = {"n": 0, "staged": None, "done": 0}
    real_stage, real_persist = Persister._stage, Persister.persist

    def stage(self: Persister, slot: Any, info: Any) -> Any:
        buf = real_stage(self, slot, info)
        flight["n"] += 1
        flight["staged"] = flight["n"]
        return buf

    def persist(self: Persister, step: int, picks: Any) -> None:
        try:
            real_persist(self, step, picks)
        finally:
            if flight["staged"] is not None:
                flight["staged"] = None
                flight["done"] += 1

    monkeypatch.setattr(Persister, "_stage", stage)
    monkeypatch.setattr(Persister, "persist", persist)
    agent = RunningAgent(fc_env.agent_config())
    try:
        model, opt, sched = make(0, 20_000)
        # A short interval, but longer than a write: one persist per interval at most.
        kw = fc_env.ckpt_kwargs(every=1, persist_every="3s", when_busy="wait")
        passed_on = steps_in_flight = 0
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            for i in range(5000):
                train_step(model, opt, sched, i)
                before, carried = flight["staged"], ck.stats.persist_carried
                ck.step()  # snapshots (every=1), and marks it for storage or not
                if before is not None and flight["staged"] == before:
                    steps_in_flight += 1  # this snapshot was taken while one write ran
                    passed_on += ck.stats.persist_carried - carried
                if flight["done"] >= 1 and steps_in_flight >= 3:
                    break
            status = agent.agent.status()
        assert flight["done"] >= 1 and steps_in_flight >= 3, (flight, steps_in_flight, status)
        # The marks passed on to a new snapshot while the agent wrote the marked one: each
        # would have started a persist as soon as that write ended.
        assert passed_on == 0, (passed_on, steps_in_flight, ck.stats, status)
    finally:
        agent.stop()


def test_status_and_events_name_the_step_being_written(
    fc_env: FcEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the agent writes a step its status names it and its trainer hears it (the
    ``persisting`` event); once written, both say none (``persisted`` clears it)."""
    seen: list[tuple[int | None, int | None]] = []
    holder: dict[str, Any] = {}
    real_write = Persister.write_shard

    def write_shard(self: Persister, *a: Any, **kw: Any) -> Any:
        ck = holder["ck"]
        # The event reaches the trainer's reader thread; a timeout shows in ``seen`` (not
        # raised here: this runs in the agent's persist thread).
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: ck.stats.persisting_step is not None,
                "the persisting event at the trainer",
                30,
                0.01,
            )
        seen.append((self.st.persisting, ck.stats.persisting_step))
        return real_write(self, *a, **kw)

    monkeypatch.setattr(Persister, "write_shard", write_shard)
    agent = RunningAgent(fc_env.agent_config())
    try:
        model, opt, sched = make(0, 2_000)
        kw = fc_env.ckpt_kwargs(every=1, persist_every=1)
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            holder["ck"] = ck
            train_step(model, opt, sched, 0)
            ck.step()
            ck.flush()
            assert ck.stats.last_persisted_step == 1
            assert ck.stats.persisting_step is None
        assert seen and seen[0] == (1, 1), seen
        assert agent.agent.status()["persisting"] is None
    finally:
        agent.stop()
