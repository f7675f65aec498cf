"""Two DDP ranks (gloo) on one machine: one replica persists, and ranks agree on the resume step."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import FcEnv

from flashckpt.storage import Storage

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


def _launch(
    env: FcEnv,
    tmp: Path,
    tag: str,
    steps: int,
    kill: dict[int, int] | None = None,
    storage: str | None = None,
) -> list[subprocess.Popen]:
    init = tmp / f"init-{tag}-{time.monotonic_ns()}"
    procs = []
    for rank in range(2):
        cmd = [
            sys.executable,
            str(HERE / "ddptrain.py"),
            "--rank",
            str(rank),
            "--storage",
            storage or env.storage,
            "--job",
            env.job,
            "--run-dir",
            env.run_dir,
            "--log",
            str(tmp / f"{tag}-r{rank}.log"),
            "--init-file",
            str(init),
            "--steps",
            str(steps),
            "--report",
            str(tmp / f"{tag}-report.txt"),
        ]
        if kill and rank in kill:
            cmd += ["--kill-in-copy", str(kill[rank])]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return procs


def _wait_all(procs: list[subprocess.Popen], timeout: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)  # a survivor stuck in a collective, as torchrun would
            p.wait(timeout=30)
        codes.append(p.returncode)
    return codes


def _log(path: Path) -> list[tuple[int, str]]:
    return [(int(a), b) for a, b in (ln.split() for ln in path.read_text().splitlines())]


def test_ddp_kill_mid_copy_resumes_at_common_step(tmp_path: Path, fc_env: FcEnv) -> None:
    steps = 20
    ref_env = FcEnv(
        job=fc_env.job + "ref",
        node="n0",
        run_dir=fc_env.run_dir,
        storage=f"file://{tmp_path}/ref",
        storage_path=tmp_path / "ref",
    )
    procs = _launch(ref_env, tmp_path, "ref", steps)
    assert _wait_all(procs) == [0, 0], [p.stderr.read().decode()[-2000:] for p in procs if p.stderr]

    # Rank 1 dies by SIGKILL halfway through its 3rd snapshot copy (label 9): rank 0 holds 9,
    # rank 1 only 6. They must both resume at 6.
    procs = _launch(fc_env, tmp_path, "run", steps, kill={1: 3})
    codes = _wait_all(procs, timeout=60)
    assert codes[1] == -signal.SIGKILL
    procs = _launch(fc_env, tmp_path, "run", steps)
    assert _wait_all(procs) == [0, 0], [p.stderr.read().decode()[-2000:] for p in procs if p.stderr]

    report = (tmp_path / "run-report.txt").read_text().splitlines()
    assert sorted(report[:2]) == ["0 0 None", "1 0 None"], report  # the first, fresh start
    assert sorted(report[2:]) == ["0 6 memory", "1 6 memory"], report
    for rank in range(2):
        ref = dict(_log(tmp_path / f"ref-r{rank}.log"))
        for step, loss in _log(tmp_path / f"run-r{rank}.log"):
            assert loss == ref[step], (rank, step)
    for rank in range(2):
        got = safetensors.torch.load_file(str(tmp_path / f"run-r{rank}.log") + ".final.safetensors")
        want = safetensors.torch.load_file(
            str(tmp_path / f"ref-r{rank}.log") + ".final.safetensors"
        )
        for k in want:
            assert torch.equal(got[k], want[k]), (rank, k)

    # One replica persisted the replicated shard: one tensor file per step, a rank file per rank.
    st = Storage(fc_env.storage)
    last = st.committed_steps()[-1]
    assert last == steps
    manifest = json.loads((fc_env.storage_path / f"step-{last:09d}" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == [
        "rank-00000-of-00002.json",
        "rank-00001-of-00002.json",
        "shard-00000-of-00001.safetensors",
    ]
    assert st.verify(last) == []
