"""Two trainers with different job names entering ``checkpointing()`` at the same instant on one
storage URL of a slow file system (issue 41, row 1: both entered, and the second job's rank files
overwrote the first's committed steps): exactly one enters and commits its steps, sound; the
other exits non-zero with the error naming the owner. A writer of the other job is refused
inside the winner's committed step too (defence in depth: a step with another job's manifest is
never written into).

The storage is ``slowfile://`` (:mod:`slowfs`: every mutating call 0.3 s late), seen by the
trainers and by the node agents they start (``sitecustomize`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import slowfs
from fchelpers import FcEnv

from flashckpt.errors import PersistError
from flashckpt.format.storage import Storage
from flashckpt.format.storage_owner import guard_step

TINYTRAIN = Path(__file__).resolve().parents[1] / "support" / "tinytrain.py"


def test_two_trainers_entering_at_the_same_instant_on_slow_storage_one_enters(
    fc_env: FcEnv, tmp_path: Path
) -> None:
    root = tmp_path / "shared"
    url = f"{slowfs.SCHEME}://{root}"
    gate = tmp_path / "gate"
    gate.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(slowfs.site_dir(tmp_path)), *filter(None, [env.get("PYTHONPATH")])]
    )
    env[slowfs.DELAY_ENV] = "0.3"
    jobs = {name: f"{fc_env.job}{name}" for name in "ab"}
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                str(TINYTRAIN),
                *("--storage", url, "--job", job, "--run-dir", fc_env.run_dir),
                *("--steps", "1", "--every", "1", "--quiet", "--barrier", str(gate)),
                *("--log", str(tmp_path / f"{name}.log")),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, job in jobs.items()
    }
    out = {name: p.communicate(timeout=240)[0] for name, p in procs.items()}
    codes = {name: p.returncode for name, p in procs.items()}
    entered = [name for name, code in codes.items() if code == 0]
    assert len(entered) == 1, (codes, out)  # never both (the issue: 2 of 2), never neither
    (won,) = entered
    lost = "b" if won == "a" else "a"
    winner, loser = jobs[won], jobs[lost]
    text = out[lost]
    assert codes[lost] != 0 and "StorageRootRefused: storage " in text, text
    assert f"is in use by job {winner!r}" in text or f"committed steps of job {winner!r}" in text
    assert f"this is job {loser!r}" in text and "takeover=True" in text, text
    assert (root.stat().st_mode & 0o777) == 0o700  # as private as its files (0600)
    # The winner's steps are all there, sound, and its own.
    st = Storage(f"file://{root}")
    committed = st.committed_steps()
    assert committed and committed[-1] == 1, (committed, out[won])  # (a slow persist skips)
    for step in committed:
        assert st.check_step(step).status == "ok", st.check_step(step).problems
        assert st.manifest(step).job == winner
    # Defence in depth: the other job's writer is refused inside the winner's committed step.
    with pytest.raises(PersistError) as err:
        guard_step(st, 1, loser)
    assert f"step 1 in file://{root} is committed by job {winner!r}" in str(err.value)
    assert guard_step(st, 1, winner) and not guard_step(st, 2, loser)
