"""The loader recipe of docs/training-loop.md resumes bitwise (issues 30, 41): a rank SIGKILLed
mid-epoch and resumed from memory ends with the uninterrupted run's model, across the epoch
boundaries after the resume, with ``num_workers`` 0 and 2, with or without the loader's own
generator; under ``flashckpt run``, a rank whose loader workers outlive it is restarted and
resumes (the workers do not keep its lock)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import safetensors.torch
import torch
from fchelpers import FcEnv, agent_process
from waiting import wait_until

from flashckpt.testing.elastic import kill_job, loopback_env

pytest.importorskip("torchdata")

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "loader_recipe_train.py"


def _cmd(env: FcEnv | None, log: Path, recipe: str, workers: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        *(env.cli_flags() if env is not None else []),
        "--steps-log",  # not --log: flashckpt run's parser refuses it (--log-dir?)
        str(log),
        "--recipe",
        recipe,
        "--num-workers",
        str(workers),
        *extra,
    ]


def _run(cmd: list[str], err: Path) -> None:
    with open(err, "wb") as f:
        p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=f, timeout=240)
    assert p.returncode == 0, err.read_text()[-4000:]


def _wait_held(log: Path, proc: subprocess.Popen[bytes], out: Path) -> int:
    """The pid of the trainer held at step 13 (it wrote ``<log>.held``)."""
    held = Path(str(log) + ".held")

    def reached() -> bool:
        assert proc.poll() is None, out.read_text(errors="replace")[-4000:]
        return held.exists()

    wait_until(reached, f"the run to reach step 13 ({held})", 180, 0.05)
    return int(held.read_text())


def _killed_and_resumed(env: FcEnv, tmp: Path, recipe: str, workers: int) -> Path:
    """Runs to step 13 (snapshots every 5), SIGKILLs the rank there (its loader workers die with
    it), reruns it to the end; the log of both runs. The job's agent is started by hand (no
    exit_when_done), so the slow restart of a loaded machine still finds the snapshot in memory."""
    agent = agent_process(env)
    log = tmp / f"{recipe}-run.log"
    err = tmp / f"{recipe}-run.stderr"
    with open(err, "wb") as f:
        p = subprocess.Popen(
            [*_cmd(env, log, recipe, workers), "--hold-at", "13"],
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    try:
        assert _wait_held(log, p, err) == p.pid
        loader_workers = psutil.Process(p.pid).children(recursive=True)
        p.send_signal(signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL
        psutil.wait_procs(loader_workers, timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    _run(_cmd(env, log, recipe, workers), tmp / f"{recipe}-resume.stderr")
    agent.terminate()
    agent.wait(timeout=60)
    return log


def _ref(fc_env: FcEnv, tmp: Path, recipe: str, workers: int) -> Path:
    env = fc_env.reference(tmp, f"ref-{recipe}")
    log = tmp / f"{recipe}-ref.log"
    _run(_cmd(env, log, recipe, workers), tmp / f"{recipe}-ref.stderr")
    return log


def _compare(ref: Path, run: Path) -> tuple[bool, float]:
    """Whether every step's loss and every final tensor are bitwise equal; the largest
    difference of the final tensors. The run restarted from memory at step 10: mid-epoch (12
    batches an epoch), with the boundaries at steps 12 and 24 still to cross."""
    lines = run.read_text().splitlines()
    assert lines[0] == "start 0 None" and "start 10 memory" in lines, lines
    steps = [int(ln.split()[0]) for ln in lines if ln[0].isdigit()]
    assert steps == [*range(1, 14), *range(11, 31)], steps
    want = dict(ln.split() for ln in ref.read_text().splitlines()[1:])
    losses_equal = all(want[s] == v for s, v in (ln.split() for ln in lines if ln[0].isdigit()))
    got = safetensors.torch.load_file(str(run) + ".final.safetensors")
    exp = safetensors.torch.load_file(str(ref) + ".final.safetensors")
    assert got.keys() == exp.keys()
    equal = losses_equal and all(torch.equal(got[k], exp[k]) for k in exp)
    return equal, max((got[k] - exp[k]).abs().max().item() for k in exp)


@pytest.mark.parametrize(("recipe", "workers"), [("new", 0), ("old", 2)])
def test_loader_recipe_with_dropout_resumes_bitwise_after_sigkill(
    tmp_path: Path, fc_env: FcEnv, recipe: str, workers: int
) -> None:
    """``new`` with 0 workers: the sampler's generator was left short of the epoch's seed draw
    by torchdata's restore, and every epoch after the resumed one diverged (issue 41). ``old``
    (no generator of the loader's own): the restored iterator is built before the RNG states
    are restored, so its seed draw from the global RNG no longer shifts the dropout masks."""
    ref = _ref(fc_env, tmp_path, recipe, workers)
    run = _killed_and_resumed(fc_env, tmp_path, recipe, workers)
    equal, diff = _compare(ref, run)
    print(f"loader recipe {recipe}, {workers} workers: bitwise {equal}, max abs diff {diff:.3g}")
    assert equal, f"the loader recipe diverged after a resume: max abs diff {diff}"


@pytest.mark.etcd
def test_a_rank_whose_loader_workers_outlive_it_resumes_under_flashckpt_run(
    tmp_path: Path, fc_env: FcEnv
) -> None:
    """Issue 41: the rank's loader workers inherited its lock and every restart was refused
    while they lived. Here they outlive the SIGKILLed rank until the job has ended (blocked on
    a FIFO), and the restarted rank resumes from memory, bitwise."""
    ref = _ref(fc_env, tmp_path, "new", 2)
    tag = f"fclw-{uuid.uuid4().hex[:10]}"
    run_dir, shm = Path("/tmp") / tag, Path("/dev/shm") / tag  # short: the socket path's limit
    fifo = tmp_path / f"{tag}.fifo"
    os.mkfifo(fifo, 0o600)
    hold = os.open(fifo, os.O_RDWR)  # the orphans' reads block until this closes
    log, out = tmp_path / f"{tag}.log", tmp_path / "launcher.out"
    cmd = [
        sys.executable, "-m", "flashckpt", "run", "--standalone", "--rdzv-id", tag,
        "--nproc-per-node", "1", "--max-restarts", "3", "--run-dir", str(run_dir),
        "--shm-dir", str(shm), "--storage", fc_env.storage,
        *_cmd(None, log, "new", 2, "--hold-at", "13", "--orphan-fifo", str(fifo))[1:],
    ]  # fmt: skip
    with open(out, "wb") as f:
        launcher = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=loopback_env(), start_new_session=True
        )
    orphans: list[psutil.Process] = []
    try:
        rank = psutil.Process(_wait_held(log, launcher, out))
        workers = rank.children()
        assert len(workers) == 2, workers
        rank.send_signal(signal.SIGKILL)
        assert launcher.wait(timeout=240) == 0, out.read_text(errors="replace")[-4000:]
        # The workers outlived the rank, its restart and the whole job: they still live.
        pids = sorted(int(p) for p in Path(f"{fifo}.orphans").read_text().split())
        assert pids == sorted(w.pid for w in workers), pids
        orphans = [w for w in workers if w.is_running()]
        assert len(orphans) == 2, "a loader worker exited before the job ended"
    finally:
        os.close(hold)  # lets the orphans go
        psutil.wait_procs(orphans, timeout=30)
        kill_job([launcher], tag)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    equal, diff = _compare(ref, log)
    print(f"loader workers outliving the rank: bitwise {equal}, max abs diff {diff:.3g}")
    assert equal, f"the resumed run diverged: max abs diff {diff}"
