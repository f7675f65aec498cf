"""A restore that fails on some ranks raises on every rank, naming each failed rank and its error
(as torch DCP's ``CheckpointException``), where a rank used to say only that "another rank
failed"."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fchelpers import FcEnv

from flashckpt.errors import FlashckptError, RestoreError
from flashckpt.trainer.rankctx import RankContext

WORKER = Path(__file__).resolve().parents[2] / "support" / "_restore_fail_worker.py"


def _ranks(env: FcEnv, tmp: Path, phase: str, world: int, misfit: str = "") -> dict[int, dict]:
    out = tmp / phase
    out.mkdir()
    cmd = [
        sys.executable,
        str(WORKER),
        "--storage",
        env.storage,
        "--job",
        env.job,
        "--run-dir",
        env.run_dir,
        "--init-file",
        str(tmp / f"init-{phase}-{time.monotonic_ns()}"),
        "--out",
        str(out),
        "--world",
        str(world),
        "--phase",
        phase,
        "--misfit",
        misfit,
    ]
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=240)
    assert p.returncode == 0, p.stderr.decode()[-6000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


@pytest.mark.slow
def test_every_rank_raises_naming_each_failed_rank_and_its_error(
    fc_env: FcEnv, tmp_path: Path
) -> None:
    saved = _ranks(fc_env, tmp_path, "save", 3)
    assert all("error" not in s for s in saved.values()), saved
    got = _ranks(fc_env, tmp_path, "restore", 3, misfit="1,2")
    for rank, g in got.items():
        assert g.get("error") == "RestoreError", g
        assert g["flashckpt_error"] and g["value_error"], g  # ValueError: as a misfit was before
        assert g["step"] == 2, g
        assert sorted(g["failures"]) == ["1", "2"], g
        assert g["failures"]["1"].startswith("ValueError: checkpoint does not fit the model")
        assert "shape mismatches" in g["failures"]["1"]
        assert (
            "missing keys (in model, not in checkpoint): ['5.bias', '5.weight']"
            in (g["failures"]["2"])
        )
        assert "rank 1: ValueError" in g["message"] and "rank 2: ValueError" in g["message"]
        # a failed rank's exception is raised from its own error; rank 0 did not fail
        assert g["cause"] == ("ValueError" if rank in (1, 2) else None), g


def test_a_world_of_one_raises_it_too_from_its_own_error() -> None:
    err = ValueError("checkpoint does not fit the model")
    from flashckpt.trainer.restore.pipeline import _failed

    e = _failed(RankContext(), 7, err, "pass restore=False to start from scratch")
    assert isinstance(e, RestoreError) and isinstance(e, FlashckptError)
    assert e.failures == {0: "ValueError: checkpoint does not fit the model"}
    assert e.step == 7 and e.__cause__ is err
    assert "rank 0: ValueError: checkpoint does not fit the model" in str(e)
    assert str(e).endswith(
        "fix the cause on each rank named, or pass restore=False to start from scratch"
    )


def test_texts_are_cut_to_the_limit_on_a_character_boundary() -> None:
    assert RankContext().gather_texts("ab" * 10, 5) == ["ababa"]
    assert RankContext().gather_texts("é" * 3, 3) == ["é\ufffd"]  # cut inside a character
