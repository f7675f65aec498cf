"""HSDP (FSDP2 on a 2-D mesh: a replicate dim and a shard dim, CPU/gloo): one replica persists.

4 ranks on a (2, 2) mesh save; storage then holds 2 shard files (the pieces of replica 0, each
piece once) plus a small file per rank. The same layout resumes from them (the ranks of replica 1
read the shard of their shard coordinate), then 2 ranks on (1, 2), then 3 ranks on (1, 3), which
reshards the pieces. Nobody passes ``replicated``: sharding is detected (one run passes
``replicated=False`` as before). A ``stateful=`` object holding DTensors (an EMA of the
parameters) is saved and restored with the model.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fchelpers import FcEnv
from shardruns import HERE
from shardruns import assert_same_state as _assert_same_state
from shardruns import losses as _losses
from shardruns import reference as _reference
from shardruns import run as _run

import flashckpt
from flashckpt.offline.reading import load_full
from flashckpt.state.sharded import walk_pieces


def _manifest(env: FcEnv, step: int) -> dict:
    return json.loads((env.storage_path / f"step-{step:09d}" / "manifest.json").read_text())


def _check_one_replica_stored(env: FcEnv, step: int) -> None:
    """A step of 4 ranks on a (2, 2) mesh: 2 shard files (not one per rank), each DTensor piece
    stored once, and the small private file of every rank (replica 1 included)."""
    m = _manifest(env, step)
    assert m["world_size"] == 4 and m["num_shards"] == 2, m
    assert sorted(m["shards"]) == ["0", "1"], m["shards"]
    assert sorted(m["ranks"], key=int) == ["0", "1", "2", "3"], m["ranks"]
    files = sorted(p.name for p in (env.storage_path / f"step-{step:09d}").iterdir())
    assert sum(f.startswith("shard-") for f in files) == 2, files
    stored: dict[str, int] = {}
    whole: dict[str, int] = {}
    for shard in (0, 1):
        ck = flashckpt.load(env.storage, step, shard=shard)
        for _, piece in walk_pieces(ck.state):
            stored[piece.name] = stored.get(piece.name, 0) + piece.tensor.numel()
            whole[piece.name] = int(torch.Size(piece.meta["shape"]).numel())
    # 4 model tensors, their 2 Adam moments each, 4 EMA tensors.
    assert len(stored) == 16, sorted(stored)
    assert stored == whole  # with every replica writing, each piece would be stored twice
    assert sorted(ck.ranks) == [0, 1, 2, 3]
    assert all("rng" in p for p in ck.ranks.values())


@pytest.mark.slow
@pytest.mark.timeout(900)  # 4 runs of 4, 4, 2, 3 forked ranks: 40 s on a loaded 2-core host
def test_hsdp_persists_one_replica_and_resumes(tmp_path: Path, fc_env: FcEnv) -> None:
    chain = [
        ("h4", 4, "2,2", 6, ()),
        ("h4b", 4, "2,2", 9, ("--replicated", "false")),
        ("h2", 2, "1,2", 12, ()),
        ("h3", 3, "1,3", 14, ()),
    ]
    for i, (tag, world, mesh, steps, extra) in enumerate(chain):
        _run(fc_env, tmp_path, tag, world, steps, "--mesh", mesh, "--ema", *extra)
        if i == 1:  # the HSDP steps, before the next runs' commits retire them (keep=3)
            _check_one_replica_stored(fc_env, 6)
            _check_one_replica_stored(fc_env, 9)

    report = sorted((tmp_path / "report.txt").read_text().splitlines())
    assert report == sorted(
        [f"{r} 0 None" for r in range(4)]
        + [f"{r} 6 storage" for r in range(4)]
        + [f"{r} 9 storage" for r in range(2)]
        + [f"{r} 12 storage" for r in range(3)]
    ), report

    # Model, Adam moments and the EMA (a stateful object of DTensors) after each resume are the
    # saver's, gathered whole.
    for (prev, *_), (tag, *_) in itertools.pairwise(chain):
        _assert_same_state(
            tmp_path / f"{prev}.log.final.safetensors", tmp_path / f"{tag}.log.restored.safetensors"
        )
    # Offline, the stored EMA gathers whole to the last run's.
    want = safetensors.torch.load_file(str(tmp_path / "h3.log.final.safetensors"))
    shadow = load_full(fc_env.storage, 14).state["stateful"]["ema"]["shadow"]
    assert sorted(shadow) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for n, t in shadow.items():
        assert torch.equal(t, want[f"ema/{n}"]), n

    ref = _reference(14)
    got: dict[int, float] = {}
    for tag, *_ in chain:
        got.update(_losses(tmp_path / f"{tag}.log"))
    assert sorted(got) == list(range(14))
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=1e-5, abs=1e-7), step

    # 2 and 3 ranks with one replica: a shard per rank.
    for step, world in ((12, 2), (14, 3)):
        m = _manifest(fc_env, step)
        assert m["num_shards"] == world and len(m["shards"]) == world, m


_REPLICATED_TRUE = r"""
import socket, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import flashckpt

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = fully_shard(torch.nn.Linear(4, 2), mesh=init_device_mesh("cpu", (1,)))
try:
    with flashckpt.checkpointing(model, storage=sys.argv[1], job=sys.argv[2], run_dir=sys.argv[3],
                                 replicated=True, agent="connect") as ck:
        print("ENTERED")
except ValueError as e:
    print("ERR", e)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_replicated_true_with_a_sharded_model_is_refused_at_entry(fc_env: FcEnv) -> None:
    # agent="connect" with no agent running: the refusal comes before any agent is contacted.
    r = subprocess.run(
        [sys.executable, "-c", _REPLICATED_TRUE, fc_env.storage, fc_env.job, fc_env.run_dir],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip()
    assert out.startswith("ERR model state key 'weight' is a DTensor sharded over ranks"), out
    assert "replicated=False" in out and "drop replicated=True" in out


_REPLICATED_DTENSORS = r"""
import socket, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
import flashckpt

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))


class Table:  # a stateful object whose state holds a sharded and a replicated DTensor
    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.rows = distribute_tensor(torch.randn(5, 3, generator=g), mesh, [Shard(0)])
        self.bias = distribute_tensor(torch.randn(3, generator=g), mesh, [Replicate()])

    def state_dict(self):
        return {"rows": self.rows, "bias": self.bias, "n": 7}

    def load_state_dict(self, sd):
        assert sd["n"] == 7
        self.rows, self.bias = sd["rows"], sd["bias"]


def make(seed):
    torch.manual_seed(seed)
    model = distribute_module(torch.nn.Linear(4, 2), mesh)  # Replicate() parameters
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), Table(seed)


kw = dict(storage=sys.argv[1], job=sys.argv[2], run_dir=sys.argv[3], every=2, mode="sync")
model, opt, table = make(0)
with flashckpt.checkpointing(model, opt, stateful={"t": table}, **kw) as ck:
    print("replicated", ck.config.replicated)
    for step in range(2):
        model(distribute_tensor(torch.ones(3, 4), mesh, [Replicate()])).sum().backward()
        opt.step()
        ck.step()
model2, opt2, table2 = make(1)
with flashckpt.checkpointing(model2, opt2, stateful={"t": table2}, **kw) as ck:
    print("restored", ck.start_step, ck.restored_from)
for a, b in zip(model.parameters(), model2.parameters()):
    assert type(b).__name__ == "DTensor" and torch.equal(a.full_tensor(), b.full_tensor())
for a, b in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"]):
    ma, mb = opt.state[a]["momentum_buffer"], opt2.state[b]["momentum_buffer"]
    assert type(mb).__name__ == "DTensor" and torch.equal(ma.full_tensor(), mb.full_tensor())
for name in ("rows", "bias"):
    a, b = getattr(table, name), getattr(table2, name)
    assert type(b).__name__ == "DTensor" and b.placements == a.placements, name
    assert torch.equal(a.full_tensor(), b.full_tensor()), name
    assert b.to_local().data_ptr() != a.to_local().data_ptr(), name
print("equal")
dist.destroy_process_group()
# The device mesh still holds the group, so gloo's threads outlive destroy_process_group(): end
# without the interpreter's teardown (see tests/support/trainscript.exit_now; CI aborted -6 here).
import atexit, os
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.slow
def test_replicated_dtensors_and_stateful_dtensors_round_trip(fc_env: FcEnv) -> None:
    # Replicate()-only DTensors are no sharding: detected as replicated, saved and restored; a
    # stateful object's DTensors (sharded or not) come back as DTensors of their own memory.
    r = subprocess.run(
        [sys.executable, "-c", _REPLICATED_DTENSORS, fc_env.storage, fc_env.job, fc_env.run_dir],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.split("\n")
    # From the agent's memory, or from storage once the agent has persisted and left.
    assert lines[1] in ("restored 2 memory", "restored 2 storage"), r.stdout
    assert [lines[0], lines[2]] == ["replicated True", "equal"], r.stdout
