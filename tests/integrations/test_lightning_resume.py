"""A Lightning ``Trainer`` with ``FlashCheckpoint``, judged as a user would: a tiny run
(``tests/support/pltrain.py``: an MLP with dropout, a shuffled ``StatefulDataLoader``)
SIGKILLed at a random step and started again with the same command trains every later step on
the same batches with the same loss as the uninterrupted run, and ends with the same parameters
and optimizer state, bit for bit; from memory, and from storage with the snapshot at an epoch's
end. Lightning's own ``ModelCheckpoint`` + ``fit(ckpt_path=...)`` on the same run is measured
beside it. Misuse that would diverge silently is refused, naming the fix."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
import torch
from fchelpers import FcEnv
from killresume import (
    TrainScript,
    different,
    final,
    kill_at,
    log_lines,
    lose_machine,
    reference_env,
    reference_job,
    run,
    starts,
)

pytestmark = pytest.mark.slow

SCRIPT = TrainScript("pltrain.py", steps=24)  # 10 steps per epoch: crosses two epochs' ends
STEPS, EVERY = SCRIPT.steps, 4


def _steps(out: Path) -> list[tuple[int, str, str]]:
    """Every ``step loss data`` line logged, from every run of the command."""
    return [(int(s), loss, data) for s, loss, data in (ln.split() for ln in log_lines(out))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The uninterrupted run: final tensors and ``{step: (loss, data)}``."""
    tmp = tmp_path_factory.mktemp("plref")
    out = tmp / "ref"
    with reference_job(tmp) as env:
        run(SCRIPT.command(env, out))
        tensors, report = final(out)
        assert report["global_step"] == STEPS and report["restored_from"] is None
        steps = {s: (loss, data) for s, loss, data in _steps(out)}
        assert sorted(steps) == list(range(1, STEPS + 1))
        yield tensors, steps


def _assert_same_run(ref, out: Path) -> dict:  # type: ignore[no-untyped-def]
    ref_tensors, ref_steps = ref
    tensors, report = final(out)
    assert report["global_step"] == STEPS
    logged = _steps(out)
    assert {s for s, _, _ in logged} == set(range(1, STEPS + 1))
    for step, loss, data in logged:  # every line, from every run, is the uninterrupted run's
        assert (loss, data) == ref_steps[step], f"step {step}"
    assert different(ref_tensors, tensors) == []
    assert any(k.endswith("exp_avg_sq") for k in tensors)
    return report


def test_kills_at_random_steps_resume_bitwise_from_memory_then_storage(
    tmp_path: Path, fc_env: FcEnv, reference
) -> None:  # type: ignore[no-untyped-def]
    """Killed at a random step, resumed from the node agent's memory; killed again, with the
    agent and the machine's shared memory this time, resumed from storage. every=5: the
    snapshot of step 10 is taken at an epoch's end."""
    rng = random.Random(29)
    out = tmp_path / "run"
    cmd = SCRIPT.command(fc_env, out, "--every", "5", "--step-sleep", "0.05")
    kill_at(cmd, out, rng.randrange(6, 12))
    kill_at(cmd, out, len(_steps(out)) + rng.randrange(4, 8))  # resumed, then killed again
    lose_machine(fc_env)  # the node agent too, and the machine's memory with it
    run(cmd)
    _assert_same_run(reference, out)
    started = starts(out)
    assert [src for _, src in started] == ["None", "memory", "storage"], started
    assert all(int(step) % 5 == 0 for step, _ in started[1:]), started


def test_lightnings_own_resume_on_the_same_run(tmp_path: Path, fc_env: FcEnv, reference) -> None:  # type: ignore[no-untyped-def]
    """The baseline: ModelCheckpoint(every_n_train_steps=4) and fit(ckpt_path="last"), killed
    after step 13 (resumes at 12, mid-epoch 1). Lightning's checkpoint holds no RNG state, so the
    resumed steps draw other dropout masks: the losses differ from the first resumed step on, and
    so do the final parameters and optimizer moments (measured: every one of them), where
    FlashCheckpoint's resume is bitwise."""
    ref_tensors, ref_steps = reference
    out = tmp_path / "native"
    cmd = SCRIPT.command(
        fc_env, out, "--mode", "native", "--every", str(EVERY), "--step-sleep", "0.05"
    )
    kill_at(cmd, out, 13)
    run(cmd)
    tensors, report = final(out)
    assert report["restored_step"] == "last" and report["global_step"] == STEPS
    last = {s: (loss, data) for s, loss, data in _steps(out)}  # the resumed run's lines
    assert last[13][0] != ref_steps[13][0]  # the first resumed step: another dropout mask
    differ = different(ref_tensors, tensors)
    assert [k for k in differ if k.startswith("model.")] == sorted(
        k for k in tensors if k.startswith("model.")
    )


def test_misuse_is_refused_naming_the_fix(tmp_path: Path, fc_env: FcEnv, agent) -> None:  # type: ignore[no-untyped-def]
    import lightning.pytorch as pl
    import pltrain  # tests/support (on sys.path)

    from flashckpt.integrations.lightning import FlashCheckpoint

    with pytest.raises(TypeError, match="did you mean 'every'"):
        FlashCheckpoint(evry=3)
    kw = fc_env.ckpt_kwargs(every=2)
    storage = kw.pop("storage")
    model, ds = pltrain.build()
    loader = torch.utils.data.DataLoader(ds, batch_size=8)

    def trainer(*callbacks, **over):  # type: ignore[no-untyped-def]
        opts = dict(
            max_steps=4,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
        )
        opts.update(over)
        return pl.Trainer(callbacks=list(callbacks), **opts)

    # two resume sources: Lightning's own checkpoint and flashckpt's snapshots
    t = trainer(enable_checkpointing=False)
    t.fit(model, loader)
    t.save_checkpoint(tmp_path / "own.ckpt")
    t = trainer(FlashCheckpoint(storage, **kw), enable_checkpointing=False)
    with pytest.raises(ValueError, match="Drop ckpt_path="):
        t.fit(model, loader, ckpt_path=str(tmp_path / "own.ckpt"), weights_only=False)

    # a snapshot asked for in the middle of a gradient accumulation
    fc = FlashCheckpoint(storage, **kw, restore=False, overwrite=True)

    class SaveMidAccumulation(pl.Callback):
        def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
            fc.save()

    t = trainer(fc, SaveMidAccumulation(), enable_checkpointing=False, accumulate_grad_batches=2)
    with pytest.raises(RuntimeError, match="accumulated gradients are in no snapshot"):
        t.fit(model, loader)

    # a resume mid-epoch from a loader without a resumable position: Lightning would train the
    # epoch's first batches again
    fc = FlashCheckpoint(storage, **{**kw, "every": 3}, restore=False, overwrite=True)
    trainer(fc, enable_checkpointing=False, max_steps=3).fit(model, loader)
    assert fc.ckpt is not None and fc.ckpt.stats.last_committed_step == 3  # of 10 per epoch
    t = trainer(FlashCheckpoint(storage, **kw), enable_checkpointing=False, max_steps=6)
    with pytest.raises(ValueError, match=r"no resumable position.*StatefulDataLoader"):
        t.fit(model, loader)


def test_two_ranks_ddp_killed_resume_bitwise(tmp_path: Path, fc_env: FcEnv) -> None:
    """2 ranks (DDP, gloo, under torchrun: each rank its part of the data), both SIGKILLed
    mid-run, the same command again: every later step of rank 0 trains the same batch with the same
    loss, and the final state is the uninterrupted 2-rank run's, bitwise."""
    ref_env = reference_env(fc_env)
    run(SCRIPT.torchrun_command(ref_env, tmp_path / "ref", "--every", str(EVERY)))
    ref_tensors, _ = final(tmp_path / "ref")
    ref_steps = {s: (loss, data) for s, loss, data in _steps(tmp_path / "ref")}
    assert sorted(ref_steps) == list(range(1, 13))
    out = tmp_path / "run"
    cmd = SCRIPT.torchrun_command(fc_env, out, "--every", str(EVERY), "--step-sleep", "0.05")
    # 5 steps per epoch (2 ranks x 8 samples, 80 samples): killed in epoch 1. The machine dies:
    # both training processes and torchrun, SIGKILLed (killing rank 1 alone leaves rank 0 in
    # Lightning's SIGTERM handler, blocked in a collective with the dead rank until torchrun's
    # shutdown timeout).
    code = SCRIPT.kill_torchrun_at(cmd, out, 6, ranks=(1, 0), launcher=True)
    assert code == -signal.SIGKILL
    run(cmd)  # the same command: both ranks resume
    tensors, report = final(out)
    started = starts(out)
    # torchrun --standalone starts a new world (another master port) per launch: the ranks
    # restore the newest step of the old world from storage (persisted at every snapshot here).
    assert started[0] == ["None", "None"] and started[-1][1] in ("memory", "storage"), started
    assert started[-1][0] in ("4", "8"), started
    for step, loss, data in _steps(out):
        assert (loss, data) == ref_steps[step], f"step {step}"
    assert report["global_step"] == 12
    assert different(ref_tensors, tensors) == []
