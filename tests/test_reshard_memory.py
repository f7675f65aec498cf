"""Resharding from memory: a sharded (FSDP2) job that changes size on one machine rebuilds its
state from the snapshots the node agent still holds, not from storage.

4 ranks die after the snapshot of step 4; 2 ranks resume (each reads its own old slot and the one
of a local rank no trainer uses any more), die after the snapshot of step 6; 3 ranks resume (the
new rank gets its pieces from the other two over gloo). At each resume the gathered full model
and optimizer state equal the dying job's, and the loss goes on as the unsharded reference's.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

import psutil
import pytest
from fchelpers import FcEnv
from test_sharded import _assert_same_state, _losses, _reference, _run


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_shrinks_and_grows_from_memory(tmp_path: Path, fc_env: FcEnv) -> None:
    chain = [("w4", 4, 3, None), ("w2", 2, 5, 4), ("w3", 3, 8, 6)]
    for tag, world, exit_at, _ in chain:
        code = 3 if tag != "w3" else 0
        extra = ["--every", "2"] + (["--exit-at", str(exit_at)] if code else [])
        _run(fc_env, tmp_path, tag, world, 8, *extra, code=code)

    report = sorted((tmp_path / "report.txt").read_text().splitlines())
    assert report == sorted(
        [f"{r} 0 None" for r in range(4)]
        + [f"{r} 4 memory-reshard" for r in range(2)]
        + [f"{r} 6 memory-reshard" for r in range(3)]
    ), report

    for (prev, *_), (tag, *_) in itertools.pairwise(chain):
        _assert_same_state(
            tmp_path / f"{prev}.log.crash.safetensors", tmp_path / f"{tag}.log.restored.safetensors"
        )
    ref = _reference(8)
    got: dict[int, float] = {}
    for tag, *_ in chain:
        got.update(_losses(tmp_path / f"{tag}.log"))
    assert sorted(got) == list(range(8))
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=1e-5, abs=1e-7), step


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hsdp_survivors_rebuild_the_state_of_a_lost_replica_machine(
    tmp_path: Path, fc_env: FcEnv
) -> None:
    # 4 ranks, HSDP on a (2, 2) mesh, two machines of 2 ranks: machine n0-0 holds replica 0
    # (shards 0 and 1), machine n0-1 replica 1. All die after the snapshot of step 4, and
    # machine n0-1 is lost with its node agent and shared memory.
    _run(fc_env, tmp_path, "w4", 4, 8, "--mesh", "2,2", "--per-node", "2", "--every", "2",
         "--exit-at", "3", code=3)  # fmt: skip
    lost = f"--node {fc_env.node}-1"
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if fc_env.job in " ".join(p.info["cmdline"]) and lost in " ".join(p.info["cmdline"]):
                p.kill()
    for name in fc_env.segments():
        if f".{fc_env.node}-1." in name:
            os.unlink(os.path.join(fc_env.shm_dir, name))
    # The survivors go on as one replica of 2 shards, from their machine's memory.
    _run(fc_env, tmp_path, "w2", 2, 8, "--mesh", "1,2", "--per-node", "2", "--every", "2")
    report = sorted((tmp_path / "report.txt").read_text().splitlines())
    assert report == sorted(
        [f"{r} 0 None" for r in range(4)] + [f"{r} 4 memory-reshard" for r in range(2)]
    ), report
    _assert_same_state(
        tmp_path / "w4.log.crash.safetensors", tmp_path / "w2.log.restored.safetensors"
    )
    ref = _reference(8)
    got = _losses(tmp_path / "w4.log")
    got.update(_losses(tmp_path / "w2.log"))
    assert sorted(got) == list(range(8))
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=1e-5, abs=1e-7), step
