"""Lightning's ``ModelParallelStrategy`` with ``FlashCheckpoint``, judged as a user would: the
tiny run of ``tests/support/pltrain.py`` sharded in ``configure_model()`` (FSDP2 ``fully_shard``
on 2 ranks; FSDP2 x tensor parallelism on a 2x2 mesh of 4 ranks; gloo on CPU, DTensor
parameters and optimizer state) under ``torchrun``, a rank and the launcher SIGKILLed at a random
step, the machine's memory lost (node agent and shared memory), and the same command started
again: every later step trains the same batch with the same loss as the uninterrupted run, and
every rank ends with the same parameter shards, optimizer moments and LR, bit for bit.

Lightning's ``FSDPStrategy`` refuses a CPU accelerator itself (its own reason is checked here); its
GPU run and DeepSpeed's are refused by the adapter naming ModelParallelStrategy (see
``benchmarks/gpu_check.sh``)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import safetensors.torch
from fchelpers import FcEnv
from killresume import TrainScript, different, log_lines, lose_machine, reference_env, run, starts
from waiting import wait_until

pytestmark = pytest.mark.slow

SCRIPT = TrainScript("pltrain.py", steps=12)
STEPS, EVERY = 12, 4  # 80 samples, 8 per data-parallel rank and step: 5 steps per epoch


def _command(env: FcEnv, out: Path, world: int, parallel: str) -> list[str]:
    cmd = SCRIPT.torchrun_command(env, out, "--every", str(EVERY), "--parallel", parallel)
    cmd[cmd.index("--nproc-per-node") + 1] = str(world)
    return cmd


def _steps(out: Path) -> list[tuple[int, str, str]]:
    """Every ``step loss data`` line logged, from every run of the command."""
    return [(int(s), loss, data) for s, loss, data in (ln.split() for ln in log_lines(out))]


def _committed(env: FcEnv) -> int:
    latest = env.storage_path / "latest"
    try:
        return int(json.loads(latest.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def _kill_rank_and_launcher(cmd: list[str], out: Path, env: FcEnv, step: int, rank: int) -> None:
    """Starts the run, its ranks stopping once ``step`` is logged; once it is, and storage holds
    a committed step, SIGKILLs the training process of ``rank``, then torchrun (the machine
    dies)."""
    p = subprocess.Popen(
        [*cmd, "--pause-at", str(step)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_until(
            lambda: (
                (len(log_lines(out)) >= step and _committed(env) >= EVERY) or p.poll() is not None
            ),
            f"step {step} logged and step {EVERY} committed",
            240,
        )
        assert p.poll() is None, p.stderr.read().decode()[-4000:] if p.stderr else ""
        procs = {
            int(c.environ().get("RANK", -1)): c
            for c in psutil.Process(p.pid).children(recursive=True)
            if str(SCRIPT.path) in " ".join(c.cmdline())
        }
        procs[rank].send_signal(signal.SIGKILL)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGKILL


def _rank_tensors(out: Path, world: int) -> list[dict]:
    return [
        safetensors.torch.load_file(str(out / f"final.rank{r}.safetensors")) for r in range(world)
    ]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world", "parallel"), [(2, "fsdp2"), (4, "fsdp2tp")])
def test_model_parallel_killed_machine_lost_resumes_bitwise(
    tmp_path: Path, fc_env: FcEnv, world: int, parallel: str
) -> None:
    """The uninterrupted run, then the same run killed at a random step of epoch 1 (a rank and
    torchrun SIGKILLed), its machine's memory lost, and resumed from storage."""
    ref_env = reference_env(fc_env)
    run(_command(ref_env, tmp_path / "ref", world, parallel))
    ref_steps = {s: (loss, data) for s, loss, data in _steps(tmp_path / "ref")}
    assert sorted(ref_steps) == list(range(1, STEPS + 1))
    ref = _rank_tensors(tmp_path / "ref", world)
    # The state is sharded: the ranks hold different pieces of the first layer's weight, as
    # DTensors' local shards (FSDP2 on dim 0 of each; TP before it for fsdp2tp).
    w0 = "model.net.0.weight"
    assert ref[0][w0].shape[0] < 64 and not ref[0][w0].equal(ref[1][w0])
    assert any(k.endswith("exp_avg_sq") for k in ref[0])

    out = tmp_path / "run"
    cmd = _command(fc_env, out, world, parallel)
    rng = random.Random(world)
    _kill_rank_and_launcher(cmd, out, fc_env, rng.randrange(EVERY + 1, 2 * EVERY), world - 1)
    lose_machine(fc_env)  # the node agent and the machine's shared memory with it
    run(cmd)  # the same command: every rank resumes
    started = starts(out)
    assert started[0] == ["None", "None"], started
    assert started[-1][1] == "storage" and int(started[-1][0]) % EVERY == 0, started
    manifest = fc_env.storage_path / f"step-{STEPS:09d}" / "manifest.json"
    assert json.loads(manifest.read_text())["num_shards"] == world  # a piece per rank
    logged = _steps(out)
    assert {s for s, _, _ in logged} == set(range(1, STEPS + 1))
    for step, loss, data in logged:  # every line, from every run, is the uninterrupted run's
        assert (loss, data) == ref_steps[step], f"step {step}"
    got = _rank_tensors(out, world)
    for r in range(world):
        assert different(ref[r], got[r]) == [], f"rank {r}"


def test_fsdp_strategy_refused_on_cpu_by_lightning_deepspeed_by_the_adapter() -> None:
    """FSDPStrategy on CPU: Lightning's own refusal. The FSDP1 and DeepSpeed strategies reaching
    the adapter (on a GPU machine): refused, naming ModelParallelStrategy."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    from flashckpt.integrations.lightning import _check_strategy

    with pytest.raises(Exception, match="requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=1, strategy="fsdp")
    for cls in (FSDPStrategy, DeepSpeedStrategy):
        with pytest.raises(NotImplementedError, match="ModelParallelStrategy"):
            _check_strategy(cls.__new__(cls))
