"""Strided sharding: FSDP2 + tensor parallelism on the same tensor dim (CPU, gloo).

4 ranks on a (dp=2, tp=2) mesh (tptrain.py) train with the first layer's weight and bias placed
``(_StridedShard(0, split_factor=2), Shard(0))`` (10 rows: uneven), die after the snapshot of
step 4, resume it at the same layout from the node agent's memory and finish cleanly (step 6 is
committed); then 2 ranks of plain 1-D FSDP2 (shardtrain.py) resume step 6, resharded from storage.
At each resume the gathered full model and optimizer state equal the saver's, and the loss goes on
as the unsharded single-process reference computes it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fchelpers import FcEnv, run_ranks
from shardruns import assert_same_state as _assert_same_state
from shardruns import losses as _losses
from shardruns import reference as _reference
from shardruns import run as _run_fsdp

import flashckpt
from flashckpt.state.sharded import walk_pieces

HERE = Path(__file__).resolve().parents[1] / "support"


def _run_tp(env: FcEnv, tmp: Path, tag: str, steps: int, *extra: str, code: int = 0) -> None:
    """Runs the 4 ranks of tptrain.py (forked from one launcher) to the end; they must all exit
    with ``code``."""
    run_ranks("tptrain.py", env, tmp, tag, "--steps", str(steps), *extra, code=code)


@pytest.mark.slow
@pytest.mark.timeout(600)  # 3 runs of 4, 4, 2 forked ranks
def test_fsdp2_tp_strided_resumes_from_memory_and_as_plain_fsdp2(
    tmp_path: Path, fc_env: FcEnv
) -> None:
    _run_tp(fc_env, tmp_path, "crash", 6, "--exit-at", "3", code=3)
    _run_tp(fc_env, tmp_path, "again", 6)
    _run_fsdp(fc_env, tmp_path, "w2", 2, 9)

    report = sorted((tmp_path / "report.txt").read_text().splitlines())
    assert report == sorted(
        [f"{r} 0 None" for r in range(4)]
        + [f"{r} 4 memory" for r in range(4)]
        + [f"{r} 6 storage" for r in range(2)]
    ), report

    # The layout under test: FSDP2 strided over TP on dim 0 (asserted in the ranks too).
    placements = json.loads((tmp_path / "crash.log.placements.json").read_text())
    assert placements["0.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", placements
    assert placements["0.bias"] == placements["0.weight"]
    assert placements["2.weight"] == "(Shard(dim=0), Shard(dim=1))", placements

    # Storage holds a piece per rank (both mesh dims shard something), with the strided placement.
    m = json.loads((fc_env.storage_path / "step-000000006" / "manifest.json").read_text())
    assert m["num_shards"] == 4, m
    rows = []
    for shard in range(4):
        ck = flashckpt.load(fc_env.storage, 6, shard=shard)
        for _, piece in walk_pieces(ck.state):
            if piece.name == "model/0.weight":
                assert piece.meta["placements"] == [{"shard": 0, "split_factor": 2}, {"shard": 0}]
                rows.append((piece.meta["offset"][0], piece.meta["local"][0]))
    # Uneven: each TP rank's 5 rows split 3 + 2 between the FSDP ranks.
    assert sorted(rows) == [(0, 3), (3, 2), (5, 3), (8, 2)], rows

    _assert_same_state(
        tmp_path / "crash.log.crash.safetensors", tmp_path / "again.log.restored.safetensors"
    )
    _assert_same_state(
        tmp_path / "again.log.final.safetensors", tmp_path / "w2.log.restored.safetensors"
    )

    ref = _reference(9)
    got = _losses(tmp_path / "crash.log")
    assert sorted(got) == [0, 1, 2, 3]
    got.update(_losses(tmp_path / "again.log"))
    got.update(_losses(tmp_path / "w2.log"))
    assert sorted(got) == list(range(9))
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=1e-5, abs=1e-7), step


_FAKE = r"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore
from flashckpt.state.codec import flatten_state
from flashckpt.state.sharded import describe, mesh_layout, placement_objects, target_box

def mesh(dims, rank):
    if dist.is_initialized():
        dist.destroy_process_group()
    n = dims[0] * dims[1]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    return init_device_mesh("cpu", dims, mesh_dim_names=("dp", "tp"))

pl = (_StridedShard(0, split_factor=2), Shard(0))
# (2, 2), 10 rows: rank 3 holds rows 8..9, saved with the strided placement that reads back.
m = mesh((2, 2), 3)
t = DTensor.from_local(torch.zeros(2, 4), m, pl, run_check=False, shape=(10, 4), stride=(4, 1))
local, meta = describe(t, "model/w")
print(meta["offset"], meta["local"], meta["placements"], placement_objects(meta) == list(pl))
print(target_box((10, 4), m, pl))
# Only strided DTensors: both mesh dims shard, so each rank is a shard of its own (no replica).
print(mesh_layout([t], range(4)))
# (3, 2), 7 rows: torch's placement puts row 6 on coordinate (2, 0), FSDP2 on (2, 1).
m = mesh((3, 2), 4)
t = DTensor.from_local(torch.zeros(0, 4), m, pl, run_check=False, shape=(7, 4), stride=(4, 1))
for f in (lambda: flatten_state({"model": {"w": t}}), lambda: target_box((7, 4), m, pl)):
    try:
        f()
    except (TypeError, ValueError) as e:
        print("ERR", type(e).__name__, e)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_strided_placement_round_trips_and_a_layout_off_the_blocks_is_refused() -> None:
    r = subprocess.run([sys.executable, "-c", _FAKE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    box, target, layout, save_err, restore_err = r.stdout.strip().splitlines()
    assert box == "[8, 0] [2, 4] [{'shard': 0, 'split_factor': 2}, {'shard': 0}] True", box
    assert target == "((8, 0), (2, 4))", target
    assert layout == "(3, 4, 0)", layout
    assert save_err.startswith("ERR TypeError state key 'model/w': strided sharding"), save_err
    assert "does not give each rank one block" in save_err
    assert "mesh coordinate {0: 2, 1: 0} holds indices []" in save_err
    assert "placements say [6]" in save_err
    assert restore_err.startswith("ERR ValueError restoring a DTensor: strided sharding")
