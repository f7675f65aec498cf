"""The Hugging Face Trainer with ``FlashCheckpoint``, judged as a user would: a tiny GPT-2 run
(``tests/support/hftrain.py``) SIGKILLed at a random step and started again with the same
command ends with the parameters, the optimizer state and the log history of the uninterrupted
run, bit for bit; from memory (the node agent kept the snapshot) and from storage (the machine's
memory lost too). The Trainer's own ``resume_from_checkpoint`` on the same run is measured
beside it. Misuse that would diverge silently is refused, naming the fix."""

from __future__ import annotations

import random
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

SCRIPT = TrainScript("hftrain.py", steps=24)  # 10 steps per epoch: crosses two epochs' ends
STEPS, EVERY = SCRIPT.steps, 4


def _final(out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, report = final(out)
    # train_loss is the Trainer's mean over the steps of *this* train() call (its own resume
    # does the same): after a resume it covers the resumed steps only.
    for entry in report["log_history"]:
        entry.pop("train_loss", None)
    return tensors, report


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The uninterrupted runs (one per command line), shared by the tests of this module."""
    tmp = tmp_path_factory.mktemp("hfref")
    runs: dict[tuple[str, ...], tuple[dict[str, torch.Tensor], dict]] = {}
    with reference_job(tmp) as env:

        def get(*extra: str) -> tuple[dict[str, torch.Tensor], dict]:
            if extra not in runs:
                out = tmp / f"ref{len(runs)}"
                # a job (storage root) per command line: each run starts afresh
                run_env = FcEnv(**{**vars(env), "storage": f"file://{tmp}/ckpt{len(runs)}"})
                run(SCRIPT.command(run_env, out, *extra))
                runs[extra] = _final(out)
                assert runs[extra][1]["global_step"] == STEPS
                assert runs[extra][1]["restored_from"] is None
            return runs[extra]

        yield get


def _assert_same_run(ref: tuple[dict, dict], got: tuple[dict, dict]) -> None:
    (rt, rr), (gt, gr) = ref, got
    assert different(rt, gt) == []
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in gt)
    assert gr["log_history"] == rr["log_history"]
    assert (gr["global_step"], gr["epoch"], gr["total_flos"]) == (
        rr["global_step"],
        rr["epoch"],
        rr["total_flos"],
    )


def test_kills_at_random_steps_resume_bitwise_from_memory_then_storage(
    tmp_path: Path, fc_env: FcEnv, reference
) -> None:  # type: ignore[no-untyped-def]
    """Killed at a random step, resumed from the node agent's memory; killed again, with the
    agent and the machine's shared memory this time, resumed from storage. every=5: the
    snapshot of step 10 is an epoch's last, taken after the epoch's end."""
    ref = reference()
    rng = random.Random(29)
    out = tmp_path / "run"
    cmd = SCRIPT.command(fc_env, out, "--every", "5", "--step-sleep", "0.05")
    kill_at(cmd, out, rng.randrange(6, 12))
    kill_at(cmd, out, len(log_lines(out)) + rng.randrange(4, 8))  # resumed, then killed again
    lose_machine(fc_env)  # the node agent too, and the machine's memory with it
    run(cmd)
    got = _final(out)
    started = starts(out)
    assert [src for _, src in started] == ["None", "memory", "storage"], started
    assert all(int(step) % 5 == 0 for step, _ in started[1:]), started
    _assert_same_run(ref, got)


def test_gradient_accumulation_resumes_bitwise(tmp_path: Path, fc_env: FcEnv, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference("--accum", "2")
    out = tmp_path / "run"
    cmd = SCRIPT.command(fc_env, out, "--accum", "2", "--every", "3", "--step-sleep", "0.05")
    kill_at(cmd, out, 8)  # 5 optimizer steps per epoch: resumes mid-epoch 1 (step 6)
    run(cmd)
    got = _final(out)
    assert got[1]["restored_from"] == "memory" and got[1]["restored_step"] in (6, 9), got[1]
    _assert_same_run(ref, got)


def test_the_trainers_own_resume_on_the_same_run(tmp_path: Path, fc_env: FcEnv, reference) -> None:  # type: ignore[no-untyped-def]
    """The baseline the adapter is held to: the Trainer's own checkpoint (save_steps=4) and
    resume_from_checkpoint, killed at the same step. It is bitwise here too (CPU, one process,
    the default seedable sampler); the adapter must be at least as exact."""
    ref = reference()
    out = tmp_path / "native"
    cmd = SCRIPT.command(
        fc_env, out, "--mode", "native", "--every", str(EVERY), "--step-sleep", "0.05"
    )
    kill_at(cmd, out, 14)
    run(cmd)
    got = _final(out)
    assert str(got[1]["restored_step"]).endswith("checkpoint-12"), got[1]
    _assert_same_run(ref, got)


@pytest.fixture
def hf_trainer_parts():  # type: ignore[no-untyped-def]
    import hftrain  # tests/support (on sys.path)

    return hftrain.build


def _args(tmp: Path, **over):  # type: ignore[no-untyped-def]
    from transformers import TrainingArguments

    kw = dict(
        output_dir=str(tmp / "hf"),
        per_device_train_batch_size=4,
        max_steps=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    kw.update(over)
    return TrainingArguments(**kw)


def test_misuse_is_refused_naming_the_fix(
    tmp_path: Path, fc_env: FcEnv, agent, hf_trainer_parts
) -> None:  # type: ignore[no-untyped-def]
    from transformers import Trainer

    from flashckpt.integrations.huggingface import FlashCheckpoint

    with pytest.raises(TypeError, match="did you mean 'storage'"):
        FlashCheckpoint(storge="file:///x")
    model, ds = hf_trainer_parts()
    kw = fc_env.ckpt_kwargs(every=2)
    storage = kw.pop("storage")

    # two resume sources
    fc = FlashCheckpoint(storage, **kw)
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=ds, callbacks=[fc])
    with pytest.raises(ValueError, match="Drop resume_from_checkpoint="):
        trainer.train(resume_from_checkpoint=str(tmp_path))

    # added after the Trainer was built: it never saw the optimizer being made
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=ds)
    trainer.add_callback(FlashCheckpoint(storage, **kw))
    with pytest.raises(RuntimeError, match=r"Trainer\(\.\.\., callbacks=\[FlashCheckpoint"):
        trainer.train()

    # a shuffle without a seed of its own: a resumed epoch would draw another order
    trainer = Trainer(
        model=model,
        args=_args(tmp_path, accelerator_config={"use_seedable_sampler": False}),
        train_dataset=ds,
        callbacks=[FlashCheckpoint(storage, **kw)],
    )
    with pytest.raises(ValueError, match="use_seedable_sampler"):
        trainer.train()

    # a snapshot asked for in the middle of a step (gradient accumulation)
    from transformers import TrainerCallback

    fc = FlashCheckpoint(storage, **kw, restore=False, overwrite=True)

    class SaveMidStep(TrainerCallback):
        def on_substep_end(self, args, state, control, **k):  # type: ignore[no-untyped-def]
            fc.save()

    trainer = Trainer(
        model=model,
        args=_args(tmp_path, gradient_accumulation_steps=2),
        train_dataset=ds,
        callbacks=[fc, SaveMidStep()],
    )
    with pytest.raises(RuntimeError, match="accumulated gradients are in no snapshot"):
        trainer.train()

    # a resume with another batch geometry: the data position is counted in batches
    fc = FlashCheckpoint(storage, **{**kw, "every": 1}, restore=False, overwrite=True)
    Trainer(
        model=model, args=_args(tmp_path, max_steps=2), train_dataset=ds, callbacks=[fc]
    ).train()
    assert fc.ckpt is not None and fc.ckpt.stats.last_committed_step == 2
    args = _args(tmp_path, max_steps=2, gradient_accumulation_steps=2)
    fc = FlashCheckpoint(storage, **kw)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[fc])
    with pytest.raises(ValueError, match="gradient_accumulation_steps: 1 then, 2 now"):
        trainer.train()


def test_two_ranks_ddp_killed_rank_resumes_bitwise(tmp_path: Path, fc_env: FcEnv) -> None:
    ref_env = reference_env(fc_env)
    run(SCRIPT.torchrun_command(ref_env, tmp_path / "ref", "--every", str(EVERY)))
    ref = _final(tmp_path / "ref")
    assert ref[1]["global_step"] == 12 and ref[1]["restored_from"] is None
    out = tmp_path / "run"
    cmd = SCRIPT.torchrun_command(fc_env, out, "--every", str(EVERY), "--step-sleep", "0.05")
    # 5 steps per epoch (2 ranks x 4 samples, 40 samples): killed in epoch 1. Rank 1's real
    # training process is SIGKILLed; torchrun stops rank 0 and gives up (no restarts).
    assert SCRIPT.kill_torchrun_at(cmd, out, 6, ranks=(1,), launcher=False) != 0
    run(cmd)  # the same command: both ranks resume
    got = _final(out)
    # torchrun --standalone starts a new world (another master port) per launch: the ranks
    # restore the newest step of the old world from storage (persisted at every snapshot here).
    assert got[1]["restored_from"] in ("memory", "storage"), got[1]
    assert got[1]["restored_step"] in (4, 8), got[1]
    _assert_same_run(ref, got)
