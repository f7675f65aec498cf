"""The node agent fails (crashes mid-persist, gets stray requests, outlives its trainers): the
trainer and the next agent carry on, nothing is lost, nothing waits forever."""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import pytest
import torch
from fchelpers import FcEnv, RunningAgent, agent_process, sized_tmpfs
from interrupts import SimulatedInterrupt
from tinytrain import make, train_steps, trained_run
from waiting import wait_until

import flashckpt
from flashckpt.format.shm import Slot
from flashckpt.format.storage import Storage
from flashckpt.protocol.channel import AgentClient, AgentError


def _slot_files(env: FcEnv) -> list[str]:
    return [f"{env.shm_dir}/{n}" for n in env.segments() if ".r00000.s" in n]


def test_next_agent_clears_the_pins_of_an_agent_that_died_mid_persist(
    fc_env_private: FcEnv,
) -> None:
    """Finding 2: the pin flag a crashed agent left set made every restarted trainer wait
    agent_timeout for a free slot and die (a crash loop)."""
    fc_env = fc_env_private
    a = agent_process(fc_env)
    try:
        trained_run(fc_env)  # its agent holds steps 2 and 4
        paths = _slot_files(fc_env)
        assert len(paths) == 2
        # The agent dies while persisting: both slots of the step it read stay pinned.
        for p in paths:
            s = Slot(p)
            s.pin(s.seq())
            s.want(True)
            s.close()
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=30)
    b = agent_process(fc_env)
    try:
        for p in paths:  # adopted with the flags cleared, before it listens
            s = Slot(p)
            assert not s.pinned() and not s.wanted(), p
            s.close()
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model,
            opt,
            scheduler=sched,
            every=2,
            **fc_env.ckpt_kwargs(agent="connect", agent_timeout=5),
        ) as ck:
            assert (ck.start_step, ck.restored_from) == (4, "memory")
            train_steps(ck, model, opt, sched, 4, 10)  # both slots are written again
            assert ck.stats.skips == 0
            assert ck.flush() == 10
    finally:
        b.send_signal(signal.SIGTERM)
        assert b.wait(timeout=60) == 0


def test_a_stray_alloc_cannot_stop_persistence(fc_env: FcEnv, agent: RunningAgent) -> None:
    """Finding 9: an alloc for a local rank no trainer runs created a position that never held
    a snapshot, and the newest committed step stayed behind while training went on."""
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every=2, **fc_env.ckpt_kwargs(agent="connect")
    ) as ck:
        train_steps(ck, model, opt, sched, 0, 2)
        assert ck.flush() == 2
        stray = AgentClient(agent.agent.socket_path)
        refused = None
        try:
            stray.request("alloc", rank=3, local_rank=3, meta_cap=4096, data_cap=4096)
        except AgentError as e:
            refused = str(e)
        finally:
            stray.close()
        train_steps(ck, model, opt, sched, 2, 6)
        committed = ck.flush(timeout=30)
        assert committed == 6, f"newest committed stayed at {committed} while training reached 6"
        assert refused is not None and "local rank 3 refused" in refused, refused
        assert sorted(agent.agent.status()["ranks"]) == ["0"]


def test_alloc_is_refused_to_a_trainer_of_a_stale_world(fc_env: FcEnv, agent: RunningAgent):
    hello = {"world_size": 2, "local_world_size": 2, "local_rank": 1, "rank": 1}
    old, new = AgentClient(agent.agent.socket_path), AgentClient(agent.agent.socket_path)
    try:
        old.request("hello", world_id="w-old", **hello)
        new.request("hello", world_id="w-new", **hello)  # the position changed hands
        with pytest.raises(AgentError, match="another trainer holds it"):
            old.request("alloc", meta_cap=4096, data_cap=4096, **hello)
        assert new.request("alloc", meta_cap=4096, data_cap=4096, **hello)["ok"]
        # Out of bounds: a local rank beyond the machine's ranks, absurd sizes.
        with pytest.raises(AgentError, match="outside this machine's 2 ranks"):
            new.request("hello", world_id="w-new", **{**hello, "local_rank": 2})
        with pytest.raises(AgentError, match="slot sizes"):
            new.request("alloc", meta_cap=4096, data_cap=1 << 60, **hello)
    finally:
        old.close()
        new.close()


def _wait_dead(ra: RunningAgent, seconds: float) -> bool:
    ra.thread.join(timeout=seconds)
    return not ra.thread.is_alive()


def test_auto_agent_leaves_after_a_failed_entry(fc_env: FcEnv) -> None:
    """Finding 11: an auto-started agent lingered its whole idle timeout (600 s) after its
    trainer failed at entry."""
    ra = RunningAgent(
        fc_env.agent_config(exit_when_done=True, unused_timeout=10.0, idle_timeout=600)
    )
    try:
        model, opt, sched = make(0)

        class Broken:
            def state_dict(self) -> dict:
                return {}

            def load_state_dict(self, sd: dict) -> None:
                raise RuntimeError("cannot load")

        # The first trainer leaves without "done" (a clean exit would let the agent leave at
        # once, before the next trainer connects): the agent waits unused_timeout for it.
        with (
            pytest.raises(SimulatedInterrupt),
            flashckpt.checkpointing(
                model, opt, scheduler=sched, every=1, **fc_env.ckpt_kwargs(agent="connect")
            ) as ck,
        ):
            ck.step()  # every=1: snapshots step 1
            assert ck.flush() == 1
            raise SimulatedInterrupt
        # The next trainer fails at entry (restore): it leaves without "done".
        model, opt, sched = make(0)
        with (
            pytest.raises(ValueError, match="stateful"),
            flashckpt.checkpointing(
                model,
                opt,
                scheduler=sched,
                stateful={"b": Broken()},
                **fc_env.ckpt_kwargs(agent="connect"),
            ),
        ):
            pass
        assert _wait_dead(ra, 60), "the agent lingers after its trainer failed at entry"
        assert fc_env.segments() == []
    finally:
        if ra.thread.is_alive():
            ra.stop()


def test_auto_agent_leaves_after_its_trainer_died_once_everything_is_persisted(
    fc_env: FcEnv,
) -> None:
    ra = RunningAgent(
        fc_env.agent_config(exit_when_done=True, unused_timeout=1.0, idle_timeout=600)
    )
    try:
        model, opt, sched = make(0)
        # As a SIGTERM turned into an exception would: the trainer leaves without "done".
        kw = fc_env.ckpt_kwargs(agent="connect")
        with (
            pytest.raises(SimulatedInterrupt),
            flashckpt.checkpointing(model, opt, scheduler=sched, every=2, **kw) as ck,
        ):
            train_steps(ck, model, opt, sched, 0, 4)
            assert ck.flush() == 4
            raise SimulatedInterrupt
        assert _wait_dead(ra, 60), "the agent lingers after its trainer died"
        assert Storage(fc_env.storage).committed_steps()[-1] == 4
    finally:
        if ra.thread.is_alive():
            ra.stop()


def test_memory_only_agent_keeps_snapshots_its_dead_trainer_left(fc_env: FcEnv) -> None:
    """Without storage the snapshots exist only in memory: the agent keeps them (idle timeout)."""
    ra = RunningAgent(
        fc_env.agent_config(storage=None, exit_when_done=True, unused_timeout=0.5, idle_timeout=600)
    )
    try:
        model, opt, sched = make(0)
        with (
            pytest.raises(SimulatedInterrupt),
            flashckpt.checkpointing(
                model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect", storage=None)
            ) as ck,
        ):
            ck.step()
            ck.save(mode="sync")
            raise SimulatedInterrupt
        assert not _wait_dead(ra, 3), "the agent left with the only copy of a snapshot"
    finally:
        ra.stop()


def test_shm_space_error_comes_at_entry_for_an_optimizer_with_three_buffers(
    fc_env: FcEnv, tmp_path: Path
) -> None:
    """Finding 11: the entry estimate assumed <= 2 optimizer tensors per parameter, so Adam
    with amsgrad=True passed entry and died of ShmSpaceError at the first snapshot."""
    # 1 Mi float32 parameters (4 MiB): the state is 4 x 4 MiB, two slots ~44 MiB with their
    # headroom; the old estimate (3 x 4 MiB, two slots ~36 MiB) fit in 40 MiB.
    with sized_tmpfs(tmp_path / "shm", "40m", required=True) as mnt:
        env = dataclasses.replace(fc_env, shm_dir=str(mnt))
        ra = RunningAgent(env.agent_config(storage=None))
        try:
            model = torch.nn.Linear(1024, 1024, bias=False)
            opt = torch.optim.Adam(model.parameters(), amsgrad=True)
            entered = False
            kw = env.ckpt_kwargs(agent="connect", storage=None)
            with (
                pytest.raises(flashckpt.ShmSpaceError),
                flashckpt.checkpointing(model, opt, **kw) as ck,
            ):
                entered = True
                for _ in range(3):  # the old estimate fails here instead
                    model(torch.randn(2, 1024)).sum().backward()
                    opt.step()
                    ck.step()
                    ck.save(mode="sync")
            assert not entered, "ShmSpaceError came at a snapshot, after entry: training dies"
            assert opt.state == {} or all("max_exp_avg_sq" in st for st in opt.state.values()), (
                "the estimate must not touch the real optimizer"
            )
        finally:
            ra.stop()


def test_entry_estimate_matches_the_first_step_of_any_optimizer(fc_env: FcEnv) -> None:
    # Memory only (no --storage): each run starts over with restore=False, which over the
    # committed steps of the run before would need overwrite=True.
    agent = RunningAgent(fc_env.agent_config(storage=None))
    try:
        _estimates_match(fc_env)
    finally:
        agent.stop()


def _estimates_match(fc_env: FcEnv) -> None:
    makers = {
        "adam-amsgrad": lambda p: torch.optim.Adam(p, amsgrad=True),
        "rmsprop-centered-momentum": lambda p: torch.optim.RMSprop(p, momentum=0.5, centered=True),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adagrad": lambda p: torch.optim.Adagrad(p),
    }
    for name, mk in makers.items():
        model = torch.nn.Linear(64, 64)
        opt = mk(model.parameters())
        with flashckpt.checkpointing(
            model, opt, **fc_env.ckpt_kwargs(agent="connect", storage=None, restore=False)
        ) as ck:
            est = ck._snap.estimate_bytes()
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            ck.step()
            ck.save(mode="sync")
            assert ck._snap.layout is not None
            # The slots reserved at entry hold the real snapshot: no reallocation needed.
            assert ck._snap.layout.nbytes <= est + 4096, (name, ck._snap.layout.nbytes, est)
            assert ck._snap.layout.nbytes >= est - 4096 * 4, (name, ck._snap.layout.nbytes, est)


@pytest.mark.parametrize("mode", ["connect", "auto"])
def test_trainer_outlives_its_agent_and_links_to_the_next(fc_env_private: FcEnv, mode: str) -> None:
    """Finding 1 in one process: the agent dies; snapshots go on into the slots; the trainer
    links to the next agent, which persists them. An agent the trainer did not start (its
    owner, e.g. a launcher, restarts it) is not replaced by one of the trainer's, even with
    agent='auto': two would race for the job's lock."""
    fc_env = fc_env_private
    a = agent_process(fc_env)
    try:
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, every=2, **fc_env.ckpt_kwargs(agent=mode)
        ) as ck:
            train_steps(ck, model, opt, sched, 0, 2)
            assert ck.flush() == 2
            a.send_signal(signal.SIGKILL)
            a.wait(timeout=30)
            wait_until(
                lambda: ck._link.client is None or not ck._link.client.connected,
                "the trainer to see its agent's link closed",
                30,
                0.01,
            )
            train_steps(ck, model, opt, sched, 2, 4)  # no agent: snapshots go on into the slots
            ck.wait()
            assert ck.stats.last_snapshot_step == 4 and ck.stats.skips == 0
            # save() tried to relink: the agent is not the trainer's to restart
            assert ck._link.agent_proc is None
            a = agent_process(fc_env)
            ck._link.next_reconnect = 0.0
            train_steps(ck, model, opt, sched, 4, 6)
            assert ck._link.agent_proc is None
            assert ck.agent_restarts == 1
            assert ck.flush() == 6
            st = ck.status()["agent"]
            assert st["connected"] and st["errors"] == [], st
    finally:
        a.send_signal(signal.SIGTERM)
        a.wait(timeout=60)
