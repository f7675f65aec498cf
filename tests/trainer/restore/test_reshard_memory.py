"""Resharding from memory: a sharded (FSDP2) job that changes size rebuilds its state from the
snapshots its machines' node agents still hold, not from storage. Pieces on the same machine are
read from its shared memory; pieces on another machine come over gloo.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import psutil
import pytest
from fchelpers import FcEnv
from shardruns import assert_same_state as _assert_same_state
from shardruns import losses as _losses
from shardruns import node_agents
from shardruns import reference as _reference
from shardruns import run as _run


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_shrinks_and_grows_from_memory(tmp_path: Path, fc_env: FcEnv) -> None:
    # 4 ranks on machine n0-0 die after the snapshot of step 4. 3 ranks come back, 2 on n0-0
    # (each also reads the slots of the local ranks 2 and 3 that no trainer uses now) and 1 on a
    # new machine n0-1, which receives its pieces from n0-0 over gloo. They die after the
    # snapshot of step 6, and 2 ranks come back, one per machine: rank 1 on n0-1 takes rows
    # 5..9 from old rank 1 (n0-0, over gloo) and old rank 2 (its own machine's memory). These
    # die before their first snapshot: the snapshots of step 6 of the 3-rank world must still be
    # there (their slots are too small for the new layout, but they are not replaced until a
    # newer snapshot exists), and 2 ranks come back from them again.
    chain = [("w4", 4, "4", 3), ("w3", 3, "2", 5), ("w2a", 2, "1", 6), ("w2", 2, "1", None)]
    with node_agents(fc_env, f"{fc_env.node}-0", f"{fc_env.node}-1"):
        for tag, world, per_node, exit_at in chain:
            extra = ["--every", "2", "--per-node", per_node]
            extra += ["--exit-at", str(exit_at)] if exit_at is not None else []
            _run(fc_env, tmp_path, tag, world, 8, *extra, code=3 if exit_at is not None else 0)

    report = sorted((tmp_path / "report.txt").read_text().splitlines())
    assert report == sorted(
        [f"{r} 0 None" for r in range(4)]
        + [f"{r} 4 memory-reshard" for r in range(3)]
        + [f"{r} 6 memory-reshard" for r in range(2)] * 2
    ), report

    # Which snapshots sent pieces over gloo: only those not on the receiver's machine (the new
    # machine's rank also takes the unsharded values, step counters and scheduler, from old
    # rank 0's).
    received = {}
    for tag in ("w3", "w2a", "w2"):
        for line in (tmp_path / f"{tag}.log.restore.jsonl").read_text().splitlines():
            info = json.loads(line)
            received[tag, info["rank"]] = info["received_from_old_ranks"]
    assert received == {
        ("w3", 0): [],
        ("w3", 1): [],
        ("w3", 2): [0, 2, 3],
        ("w2a", 0): [],
        ("w2a", 1): [1],
        ("w2", 0): [],
        ("w2", 1): [1],
    }, received

    crash_of = {"w3": "w4", "w2a": "w3", "w2": "w3"}
    for tag, prev in crash_of.items():
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
    # The surviving machine n0-0 keeps a hand-started agent (see node_agents); n0-1's is
    # the one its ranks start, and the test kills it.
    with node_agents(fc_env, f"{fc_env.node}-0"):
        _run(fc_env, tmp_path, "w4", 4, 8, "--mesh", "2,2", "--per-node", "2", "--every", "2",
             "--exit-at", "3", code=3)  # fmt: skip
        lost = f"--node {fc_env.node}-1"
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error, TypeError):
                if fc_env.job in " ".join(p.info["cmdline"]) and lost in " ".join(
                    p.info["cmdline"]
                ):
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_crash_before_the_first_snapshot_of_a_new_layout_keeps_the_old_one(
    tmp_path: Path, fc_env: FcEnv
) -> None:
    # A state of 12 MiB: each rank's piece doubles from 4 ranks to 2, so the new world's
    # snapshots do not fit the old slots. 4 ranks die after the snapshot of step 4; 2 ranks
    # resume from it and die before their first snapshot: the slot that held step 4 must not
    # have been replaced (only the older one is, for the next snapshot). 2 ranks resume again.
    args = ["--every", "2", "--per-node", "4", "--hidden", "50000"]
    with node_agents(fc_env, f"{fc_env.node}-0"):
        _run(fc_env, tmp_path, "w4", 4, 6, *args, "--exit-at", "3", code=3)
        args[3] = "2"
        _run(fc_env, tmp_path, "w2a", 2, 6, *args, "--exit-at", "4", code=3)
        _run(fc_env, tmp_path, "w2", 2, 6, *args)
    report = sorted((tmp_path / "report.txt").read_text().splitlines())
    assert report == sorted(
        [f"{r} 0 None" for r in range(4)] + [f"{r} 4 memory-reshard" for r in range(2)] * 2
    ), report
    for tag in ("w2a", "w2"):
        _assert_same_state(
            tmp_path / "w4.log.crash.safetensors", tmp_path / f"{tag}.log.restored.safetensors"
        )
