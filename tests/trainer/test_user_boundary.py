"""The user boundary (issue 10): a step count the library owns, loud lost work, a run that never
takes an older run's steps for its own, and the habits PyTorch users bring."""

from __future__ import annotations

import itertools
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from interrupts import SimulatedInterrupt
from tinytrain import make, train_step
from waiting import wait_until

import flashckpt
from flashckpt.protocol.channel import AgentClient, AgentError, socket_path
from flashckpt.trainer.checkpointer import CheckpointConfig


def _env(fc_env: FcEnv, storage_path: Path) -> FcEnv:
    return FcEnv(
        job=fc_env.job,
        node="n0",
        run_dir=fc_env.run_dir,
        storage=f"file://{storage_path}",
        storage_path=storage_path,
    )


def _equal_models(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v), k


def _train(env: FcEnv, steps: int, *, stop_at: int | None = None, seed: int = 0, **kw):
    """A loop written the ecosystem's way: ``ckpt.step(global_step)``, 1-based."""
    model, opt, sched = make(seed)
    ck = flashckpt.checkpointing(
        model, opt, scheduler=sched, **env.ckpt_kwargs(agent="connect", **kw)
    )
    try:
        with ck:
            for i in range(ck.start_step, steps):
                if i == stop_at:
                    raise SimulatedInterrupt
                train_step(model, opt, sched, i)
                ck.step(i + 1)  # global_step: steps completed
    except SimulatedInterrupt:
        pass
    return model, ck


# -- 1. the library owns the step count ---------------------------------------------------------
def test_uninterrupted_n_step_run_commits_step_n(fc_env: FcEnv, agent: RunningAgent) -> None:
    _, ck = _train(fc_env, 10, every=4)
    assert ck.steps_done == 10
    assert ck.stats.last_committed_step == 10
    assert flashckpt.load(fc_env.storage).step == 10
    # Every step directory holds a snapshot of this run (step 8 may be superseded by 10 before
    # the agent gets to it: it persists the newest complete snapshot).
    dirs = sorted(int(p.name[5:]) for p in fc_env.storage_path.glob("step-*"))
    assert dirs[-1] == 10 and set(dirs) <= {4, 8, 10}, dirs


def test_global_step_loop_resumes_bitwise(fc_env: FcEnv, agent: RunningAgent, tmp_path) -> None:
    ref_env = _env(fc_env, tmp_path / "ref")
    ref_env.job += "r"
    ref_agent = RunningAgent(ref_env.agent_config())
    try:
        ref, _ = _train(ref_env, 14, every=3)
    finally:
        ref_agent.stop()
    _, ck1 = _train(fc_env, 14, every=3, stop_at=8)  # killed in iteration 8: 6 steps snapshotted
    assert ck1.stats.last_snapshot_step == 6
    model, ck2 = _train(fc_env, 14, every=3, seed=5)
    assert ck2.start_step == 6 and ck2.restored_from == "memory"
    _equal_models(ref, model)


def test_step_convention_mistakes_raise_naming_both_conventions(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every=0, **fc_env.ckpt_kwargs(agent="connect")
    ) as ck:
        with pytest.raises(ValueError, match=r"ckpt.step\(0\) looks like a 0-based") as ei:
            ck.step(0)  # the 0-based habit: right after iteration 0
        msg = str(ei.value)
        assert "ckpt.step() with no argument" in msg and "global_step" in msg
        assert "ckpt.step(i + 1)" in msg
        assert ck.steps_done == 0  # a refused call counts nothing
        assert ck.step(1) is None and ck.step() is None and ck.step(3) is None
        with pytest.raises(ValueError, match=r"ckpt.step\(3\) after 3 steps done"):
            ck.step(3)
        with pytest.raises(ValueError, match=r"ckpt.step\(2\) after 3 steps done"):
            ck.step(2)
        with pytest.raises(ValueError, match=r"skips 2 step"):
            ck.step(6)
        with pytest.raises(TypeError, match="an int"):
            ck.step(4.5)  # type: ignore[arg-type]
        assert ck.steps_done == 3
        with pytest.raises(ValueError, match=r"save\(step=7\): 3 steps are done"):
            ck.save(7)
        assert ck.save(3).step == 3 and ck.save().step == 3
    assert flashckpt.load(fc_env.storage).step == 3
    with pytest.raises(RuntimeError, match="outside"):
        ck.step()  # after the block: nothing counts it
    # The count goes on from the restored step: start_step is both the steps done and the
    # index of the next iteration.
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every=0, **fc_env.ckpt_kwargs(agent="connect")
    ) as ck:
        assert ck.start_step == 3 and ck.steps_done == 3
        with pytest.raises(ValueError, match=r"ckpt.step\(3\) looks like a 0-based"):
            ck.step(ck.start_step)
        ck.step(ck.start_step + 1)
    assert flashckpt.load(fc_env.storage).step == 4  # the exit snapshot


# -- 2. every="auto" by default -----------------------------------------------------------------
def test_default_every_is_auto(fc_env: FcEnv, agent: RunningAgent) -> None:
    assert CheckpointConfig().every == "auto"
    model, opt, sched = make(0)
    taken = []
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect")
    ) as ck:
        for i in range(12):
            train_step(model, opt, sched, i)
            h = ck.step()
            if h is not None:
                taken.append(h.step)
        assert ck.status()["every"]["mode"] == "auto"
    assert taken and taken[0] == 10  # the first periodic snapshot, with no every= given


# -- 3. the habits: a scheduler left out, a misnamed keyword ------------------------------------
def test_scheduler_left_out_is_refused_with_the_fix(fc_env: FcEnv) -> None:
    model, opt, sched = make(0)
    with pytest.raises(ValueError, match=r"initial_lr.*scheduler=.*allow_unsaved_scheduler=True"):
        flashckpt.checkpointing(model, opt, **fc_env.ckpt_kwargs())
    # Given in scheduler= or stateful=, or left out on purpose: accepted.
    flashckpt.checkpointing(model, opt, scheduler=sched, **fc_env.ckpt_kwargs())
    flashckpt.checkpointing(model, opt, stateful={"lr": sched}, **fc_env.ckpt_kwargs())
    flashckpt.checkpointing(model, opt, allow_unsaved_scheduler=True, **fc_env.ckpt_kwargs())
    plain = torch.optim.SGD(model.parameters(), lr=0.1)  # no scheduler ever touched it
    flashckpt.checkpointing(model, plain, **fc_env.ckpt_kwargs())


def test_bad_values_of_the_new_options_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="overwrite='yes': use True or False"):
        CheckpointConfig(overwrite="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_persist_failure='ignore'"):
        CheckpointConfig(on_persist_failure="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode='async': use 'auto', 'overlap' or 'sync'"):
        CheckpointConfig(mode="async")  # type: ignore[arg-type]
    assert CheckpointConfig().mode == "auto"  # the copy strategy follows the device


def test_unknown_keywords_suggest_the_right_one() -> None:
    model, opt, sched = make(0)
    with pytest.raises(TypeError) as ei:
        flashckpt.checkpointing(model, opt, lr_scheduler=sched, storag="file:///x")
    msg = str(ei.value)
    assert "'lr_scheduler' (did you mean 'scheduler'?)" in msg
    assert "'storag' (did you mean 'storage'?)" in msg
    for name in ("scheduler", "stateful", "extras", "process_group", "every", "overwrite"):
        assert name in msg.split("It takes:")[1], name


# -- 4. lost work is loud -----------------------------------------------------------------------
def _storage_fails_mid_run(fc_env: FcEnv, root: Path, **kw) -> flashckpt.Checkpointer:
    """Commits step 2, then the storage goes away (a file where its parent directory was: a
    real failure of every write), then trains 2 more steps and leaves the ``with`` block."""
    env = _env(fc_env, root / "store" / "ckpt")
    a = RunningAgent(env.agent_config())
    try:
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, every=2, **env.ckpt_kwargs(agent="connect", **kw)
        ) as ck:
            for i in range(2):
                train_step(model, opt, sched, i)
                ck.step()
            assert ck.flush() == 2
            shutil.rmtree(root / "store")
            (root / "store").write_text("not a directory")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for i in range(2, 4):  # training goes on from memory
                    train_step(model, opt, sched, i)
                    ck.step()
    finally:
        a.stop()
    return ck


def test_storage_failing_mid_run_raises_persist_error_on_exit(fc_env: FcEnv, tmp_path) -> None:
    with pytest.raises(flashckpt.PersistError) as ei:
        _storage_fails_mid_run(fc_env, tmp_path)
    err = ei.value
    assert isinstance(err, flashckpt.FlashckptError)
    assert err.step == 4 and err.errors, err
    msg = str(err)
    assert f"file://{tmp_path}/store/ckpt" in msg and "Not a directory" in msg, msg
    assert "newest committed step is 2" in msg and "on_persist_failure='warn'" in msg


def test_persist_failure_opt_out_only_warns(fc_env: FcEnv, tmp_path) -> None:
    with pytest.warns(UserWarning, match=r"step 4 \(the final snapshot\) was not committed"):
        ck = _storage_fails_mid_run(fc_env, tmp_path, on_persist_failure="warn")
    assert ck.steps_done == 4 and ck.stats.last_committed_step == 2


# -- 5. a run never takes an older run's steps for its own --------------------------------------
def test_fresh_run_over_an_older_runs_root(fc_env: FcEnv, agent: RunningAgent) -> None:
    _train(fc_env, 10, every=5)
    assert flashckpt.load(fc_env.storage).step == 10
    # restore=False over committed steps: refused at entry, nothing touched.
    model, opt, sched = make(7)
    ck = flashckpt.checkpointing(
        model, opt, scheduler=sched, restore=False, **fc_env.ckpt_kwargs(agent="connect")
    )
    # [5, 10], or [10] where step 5's persist was still running when step 10 superseded it
    # (seen in fresh-ci): the refusal is what this checks.
    with pytest.raises(ValueError, match=r"holds committed steps \[(5, )?10\].*overwrite=True"):
        ck.__enter__()
    assert flashckpt.load(fc_env.storage).step == 10
    # overwrite=True: the old steps go, this run's steps persist and commit, flush() reports
    # this run's step, and `latest` points at it.
    with flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        every=2,
        restore=False,
        overwrite=True,
        **fc_env.ckpt_kwargs(agent="connect"),
    ) as ck:
        assert ck.start_step == 0
        for i in range(4):
            train_step(model, opt, sched, i)
            ck.step()
        assert ck.flush() == 4
    loaded = flashckpt.load(fc_env.storage)
    assert loaded.step == 4
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state["model"][k], v), k
    dirs = sorted(int(p.name[5:]) for p in fc_env.storage_path.glob("step-*"))
    assert dirs[-1] == 4 and set(dirs) <= {2, 4}, dirs  # the old run's step 10 is gone
    assert '"step": 4' in (fc_env.storage_path / "latest").read_text()
    # The next run resumes this run's step, not the older run's.
    resumed, ck = _train(fc_env, 4, every=2, seed=3)
    assert ck.start_step == 4
    _equal_models(model, resumed)


def test_nothing_restorable_over_committed_steps_needs_overwrite(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    _train(fc_env, 3, every=3)
    agent.stop()  # the memory snapshots go with it
    shard = fc_env.storage_path / "step-000000003" / "shard-00000-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x01
    shard.write_bytes(bytes(raw))
    again = RunningAgent(fc_env.agent_config())
    try:
        model, opt, sched = make(0)
        ck = flashckpt.checkpointing(
            model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect")
        )
        with (
            pytest.warns(UserWarning, match="fails its checksum"),
            pytest.raises(ValueError, match=r"\[3\].*none of them could be restored"),
        ):
            ck.__enter__()
        with (
            pytest.warns(UserWarning, match="fails its checksum"),
            flashckpt.checkpointing(
                model,
                opt,
                scheduler=sched,
                every=0,
                overwrite=True,
                **fc_env.ckpt_kwargs(agent="connect"),
            ) as ck,
        ):
            assert ck.start_step == 0 and ck.restored_from is None
            ck.step()
            ck.save()
            assert ck.flush() == 1
        assert flashckpt.load(fc_env.storage).step == 1
        assert [p.name for p in fc_env.storage_path.glob("step-*")] == ["step-000000001"]
    finally:
        again.stop()


# -- 7. where each rank restored from, and how long it took ------------------------------------
def test_entry_logs_the_restore_source_and_time(
    fc_env: FcEnv, agent: RunningAgent, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="flashckpt"):
        _, ck = _train(fc_env, 2, every=2)
        assert any(
            "rank 0 starts at step 0: nothing to restore" in r.message for r in caplog.records
        )
        caplog.clear()
        _, ck = _train(fc_env, 3, every=2)
    lines = [r.message for r in caplog.records if "restored step" in r.message]
    assert len(lines) == 1 and lines[0].startswith(
        "flashckpt: rank 0 restored step 2 from memory in "
    )
    assert lines[0].endswith(" s")
    assert isinstance(ck._restore_s, float) and ck._restore_s >= 0
    st = ck.status()
    assert st["restore_s"] == ck._restore_s and st["restore"]["source"] == "memory"


# -- 6. the data position -----------------------------------------------------------------------
def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 16, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())  # 12 batches of 4


def _data_run(env: FcEnv, pattern: str, total: int, stop_at: int | None = None, seed: int = 0):
    """Trains ``total`` steps over a shuffled loader with 2 workers (epochs of 12 batches),
    snapshotting every 5 steps; returns the model and the batch of each step."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kw = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    extras = {"epoch": 0, "batch": 0}
    stateful, per_rank = {}, {}
    if pattern in ("stateful", "per_rank"):  # torchdata's loader keeps its own position
        loader = StatefulDataLoader(_dataset(), **kw)
        (stateful if pattern == "stateful" else per_rank)["loader"] = loader
    else:  # a plain DataLoader: the epoch seeds its order; extras keep the position
        gen = torch.Generator()
        loader = torch.utils.data.DataLoader(_dataset(), generator=gen, **kw)
    seen: dict[int, torch.Tensor] = {}
    ck = flashckpt.checkpointing(
        model,
        opt,
        stateful=stateful,
        per_rank=per_rank,
        extras=extras,
        every=5,
        **env.ckpt_kwargs(agent="connect"),
    )
    epochs = []  # the loader's iterators, each with its 2 worker processes
    try:
        with ck:
            while ck.steps_done < total:
                if pattern != "plain":
                    epochs.append(iter(loader))
                    batches = epochs[-1]
                else:
                    gen.manual_seed(1234 + extras["epoch"])
                    epochs.append(iter(loader))
                    batches = itertools.islice(epochs[-1], extras["batch"], None)
                for x, y in batches:
                    i = ck.steps_done
                    if i == stop_at:
                        raise SimulatedInterrupt
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    seen[i] = x.clone()
                    extras["batch"] += 1
                    ck.step()
                    if ck.steps_done == total:
                        break
                else:
                    extras["epoch"] += 1
                    extras["batch"] = 0
    except SimulatedInterrupt:
        pass
    finally:
        # Stopped here, not by the garbage collector: ``ck`` keeps the loader (and a torchdata
        # loader its last iterator) alive, and workers stopped from a collection later, inside
        # another test, were seen taking torch's whole 5 s join timeout each (30-50 s a test).
        for it in epochs:
            it._shutdown_workers()  # type: ignore[attr-defined]
    return model, seen, ck


@pytest.mark.parametrize("pattern", ["per_rank", "stateful", "plain"])
def test_shuffled_loader_with_workers_resumes_mid_epoch_bitwise(
    fc_env: FcEnv, agent: RunningAgent, tmp_path, pattern: str
) -> None:
    ref_env = _env(fc_env, tmp_path / "ref")
    ref_env.job += "r"
    ref_agent = RunningAgent(ref_env.agent_config())
    try:
        ref, ref_seen, _ = _data_run(ref_env, pattern, 20)
    finally:
        ref_agent.stop()
    assert sorted(ref_seen) == list(range(20))
    # Killed in step 13: the snapshot of step 10 is mid-epoch (epochs are 12 batches).
    _, _, ck1 = _data_run(fc_env, pattern, 20, stop_at=13)
    assert ck1.stats.last_snapshot_step == 10
    torch.manual_seed(99)  # the global RNG moved on: the restore brings it back
    model, seen, ck2 = _data_run(fc_env, pattern, 20, seed=5)
    assert ck2.start_step == 10 and ck2.restored_from == "memory"
    assert sorted(seen) == list(range(10, 20))
    for i in range(10, 20):  # the rest of epoch 0, then all of epoch 1's order
        assert torch.equal(seen[i], ref_seen[i]), f"batch of step {i} differs"
    _equal_models(ref, model)


def test_per_rank_state_round_trips_as_json_and_is_validated() -> None:
    import json

    from flashckpt.state.jsonstate import decode_state, encode_state

    state = {
        "pos": 7,
        "gen": torch.randint(0, 255, (40,), dtype=torch.uint8),
        "empty": torch.zeros(0, 3),
        "pair": (1, [2.5, None, "x"]),
        "flag": torch.tensor([True, False]),
    }
    back = decode_state(json.loads(json.dumps(encode_state(state, "s"))), "s")
    assert back["pos"] == 7 and back["pair"] == (1, [2.5, None, "x"])
    for k in ("gen", "empty", "flag"):
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k
    with pytest.raises(TypeError, match=r"s/workers: key 0 is a int"):
        encode_state({"workers": {0: 1}}, "s")
    with pytest.raises(TypeError, match=r"s/f: a builtin_function_or_method cannot"):
        encode_state({"f": print}, "s")
    bad = encode_state({"t": torch.arange(4)}, "s")
    bad["t"]["__flashckpt_tensor__"]["shape"] = [5]  # storage is not trusted
    with pytest.raises(ValueError, match=r"s/t: tensor data does not match|bytes of tensor data"):
        decode_state(bad, "s")
    bad["t"]["__flashckpt_tensor__"].update(shape=[4], dtype="object")
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        decode_state(bad, "s")


_PER_RANK_WORKER = r"""
import sys, torch, torch.distributed as dist
import flashckpt

rank, init, storage, job, run_dir, phase = sys.argv[1:7]
rank = int(rank)
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)


class Cursor:  # a data position that differs by rank (a sharded loader's)
    def __init__(self):
        self.pos, self.seen = 0, torch.zeros(3, dtype=torch.int64)

    def state_dict(self):
        return {"pos": self.pos, "seen": self.seen.clone()}

    def load_state_dict(self, sd):
        self.pos, self.seen = sd["pos"], sd["seen"]


torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
own, shared = Cursor(), Cursor()
kw = dict(storage=storage, job=job, node="n0", run_dir=run_dir, every=3, agent_idle_timeout=60)
with flashckpt.checkpointing(model, per_rank={"cursor": own}, stateful={"shared": shared},
                             **kw) as ck:
    if phase == "train":
        for i in range(3):
            for c in (own, shared):
                c.pos += 100 * rank + 1
                c.seen[i] = 10 * rank + i
            ck.step()
    else:
        print(ck.start_step, ck.restored_from, own.pos, own.seen.tolist(), shared.pos, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_per_rank_state_comes_back_to_each_rank_from_storage(fc_env: FcEnv, tmp_path) -> None:
    import subprocess
    import sys

    def run(phase: str) -> list[str]:
        init = tmp_path / f"init-{phase}"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _PER_RANK_WORKER,
                    str(r),
                    str(init),
                    fc_env.storage,
                    fc_env.job,
                    fc_env.run_dir,
                    phase,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-3000:]
            outs.append(out.strip())
        return outs

    run("train")

    # The ranks flushed step 3 to storage as they left, and their agent leaves when both are
    # done, its memory with it. No other agent is left: both ranks start one at entry, and the
    # second, finding the first serving, exits at once (it used to wait for the lock, take over
    # as the first left and sit out its idle timeout, holding the run's memory).
    def agent_answers() -> bool:
        try:
            client = AgentClient(socket_path(fc_env.run_dir, fc_env.job, "n0"), timeout=0.0)
        except (AgentError, OSError):
            return False
        try:
            client.request("ping", timeout=10)
            return True
        except (AgentError, OSError):
            return False
        finally:
            client.close()

    # No agent left serving after the job ended, the memory snapshots gone: restore from storage.
    wait_until(
        lambda: fc_env.segments() == [] and not agent_answers(),
        "the job's agent gone and its memory snapshots freed",
        120,
        0.2,
        state=lambda: f"segments {fc_env.segments()}, an agent answers: {agent_answers()}",
    )
    r0, r1 = run("restore")
    assert r0 == "3 storage 3 [0, 1, 2] 3", r0
    # Rank 1 gets its own position back; a stateful= object is one replica's (rank 0's).
    assert r1 == "3 storage 303 [10, 11, 12] 3", r1
