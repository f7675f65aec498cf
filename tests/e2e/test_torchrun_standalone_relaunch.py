"""The same ``torchrun --standalone`` command run again resumes its job (issue 30).

torchrun --standalone draws a new random run id per launch. Taken as the job's name, each
relaunch was another job: once storage roots checked whose steps they hold, the documented
``torchrun --standalone ... examples/gpt_train.py --storage URL`` refused its own rerun. With
storage given, a random (UUID4) run id no longer names the job; the storage URL does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from fchelpers import FcEnv, kill_job_processes, private_shm
from safetensors.torch import load_file

from flashckpt.trainer.rankctx import _random_run_id

ROOT = Path(__file__).resolve().parents[2]


def test_only_a_random_uuid_is_taken_for_torchruns_random_id() -> None:
    assert _random_run_id(str(uuid.uuid4()))
    assert not _random_run_id("run1")
    assert not _random_run_id(str(uuid.uuid1()))  # time-based: a user's choice, not torchrun's
    assert not _random_run_id(uuid.uuid4().hex)  # not the form torchrun writes


def _torchrun(out: Path, storage: str, env: dict[str, str]) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
        str(ROOT / "examples" / "gpt_train.py"),
        "--storage", storage, "--steps", "6", "--every", "2", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = (out / "report.txt").read_text().splitlines()
    return json.loads(reports[-1])


@pytest.mark.slow
def test_the_same_torchrun_standalone_command_resumes_its_job(
    fc_env: FcEnv, tmp_path: Path
) -> None:
    with private_shm(tmp_path / "shm") as shm:
        env = {
            **os.environ,
            "FLASHCKPT_RUN_DIR": fc_env.run_dir,
            "FLASHCKPT_SHM_DIR": shm,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        try:
            first = _torchrun(tmp_path / "a", fc_env.storage, env)
            assert first["start_step"] == 0
            # The same command again: the same job, so its 6 committed steps are its own.
            again = _torchrun(tmp_path / "b", fc_env.storage, env)
            assert again["start_step"] == 6, again
        finally:
            kill_job_processes(fc_env.run_dir)  # the auto-started agents name their run dir
        a = load_file(str(tmp_path / "a" / "final.safetensors"))
        b = load_file(str(tmp_path / "b" / "final.safetensors"))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
