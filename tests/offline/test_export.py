"""`flashckpt export`: one consolidated safetensors file, and a torch.distributed.checkpoint
directory that `dcp.load` reads, from a sharded (FSDP2) and from a replicated checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fchelpers import FcEnv, RunningAgent
from shardruns import run as _run
from tinytrain import make, train_step

import flashckpt


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flashckpt", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_export_sharded_to_safetensors_and_dcp(tmp_path: Path, fc_env: FcEnv) -> None:
    import torch.distributed.checkpoint as dcp

    _run(fc_env, tmp_path, "w2", 2, 4)
    want = safetensors.torch.load_file(str(tmp_path / "w2.log.final.safetensors"))
    model_want = {k[len("model/") :]: v for k, v in want.items() if k.startswith("model/")}
    assert len(model_want) == 4

    out = tmp_path / "export" / "model.safetensors"
    r = _cli("export", fc_env.storage, "--step", "4", "--to", str(out))
    assert r.returncode == 0, r.stderr
    assert "step 4: wrote 4 tensors" in r.stdout
    got = safetensors.torch.load_file(str(out))
    assert sorted(got) == sorted(model_want)
    for k, v in model_want.items():
        assert torch.equal(got[k], v), k

    d = tmp_path / "dcp"
    r = _cli("export", fc_env.storage, "--to", str(d), "--format", "dcp")
    assert r.returncode == 0, r.stderr
    assert "['model', 'optimizer']" in r.stdout
    fqns = sorted(model_want)
    target = {
        "model": {k: torch.zeros_like(v) for k, v in model_want.items()},
        "optimizer": {
            "state": {
                fqn: {
                    "exp_avg": torch.zeros_like(model_want[fqn]),
                    "exp_avg_sq": torch.zeros_like(model_want[fqn]),
                    "step": torch.zeros(()),
                }
                for fqn in fqns
            }
        },
    }
    dcp.load(target, checkpoint_id=str(d), no_dist=True)
    for k, v in model_want.items():
        assert torch.equal(target["model"][k], v), k
    for fqn in fqns:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(target["optimizer"]["state"][fqn][key], want[f"optim/{fqn}/{key}"])

    r = _cli("export", fc_env.storage, "--to", str(d), "--format", "dcp")
    assert r.returncode == 1 and "not empty" in r.stderr


def test_export_replicated_checkpoint(tmp_path: Path, fc_env: FcEnv) -> None:
    a = RunningAgent(fc_env.agent_config())
    try:
        model, opt, sched = make(0)
        kw = fc_env.ckpt_kwargs(agent="connect", every=2)
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            for step in range(2):
                train_step(model, opt, sched, step)
                ck.step()
            ck.flush()
    finally:
        a.stop()
    out = tmp_path / "m.safetensors"
    r = _cli("export", fc_env.storage, "--to", str(out))
    assert r.returncode == 0, r.stderr
    got = safetensors.torch.load_file(str(out))
    want = model.state_dict()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    r = _cli("export", fc_env.storage, "--step", "7", "--to", str(out))
    assert r.returncode == 1 and "step 7 is not committed" in r.stderr


def test_export_replicated_optimizer_to_dcp(tmp_path: Path, fc_env: FcEnv) -> None:
    """The DCP export of a data-parallel checkpoint has the optimizer state too, in the layout of
    ``get_state_dict``: ``set_state_dict`` after ``dcp.load`` gives an equal optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    a = RunningAgent(fc_env.agent_config())
    try:
        model, opt, sched = make(0)
        kw = fc_env.ckpt_kwargs(agent="connect", every=8)
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            assert ck.config.replicated is True  # detected: no DTensor
            for step in range(8):  # StepLR has halved the learning rate at step 7
                train_step(model, opt, sched, step)
                ck.step()
            ck.flush()
    finally:
        a.stop()
    d = tmp_path / "dcp"
    r = _cli("export", fc_env.storage, "--to", str(d), "--format", "dcp")
    assert r.returncode == 0, r.stderr
    assert "step 8" in r.stdout and "['model', 'optimizer']" in r.stdout

    model2, opt2, _ = make(1)  # other weights, no optimizer state yet
    msd, osd = get_state_dict(model2, opt2)
    target = {"model": msd, "optimizer": osd}
    dcp.load(target, checkpoint_id=str(d), no_dist=True)
    set_state_dict(
        model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optimizer"]
    )
    want, got = opt.state_dict(), opt2.state_dict()
    assert sorted(got["state"]) == sorted(want["state"]) == list(range(len(want["state"])))
    for i, st in want["state"].items():
        assert sorted(got["state"][i]) == sorted(st) == ["exp_avg", "exp_avg_sq", "step"]
        for key, v in st.items():
            assert torch.equal(got["state"][i][key], v), (i, key)
    assert got["param_groups"] == want["param_groups"]
    assert want["param_groups"][0]["lr"] == pytest.approx(5e-3)
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v), k


def test_export_of_an_untrusted_step_is_a_clear_error(tmp_path: Path) -> None:
    """A step whose manifest points outside its directory is not exported (nor read)."""
    import json

    from stephelpers import SHARD, file_record, shard_bytes, write_step

    from flashckpt.format.storage import Storage

    st = Storage(f"file://{tmp_path}/ckpt")
    st.commit(1, write_step(st, 1))
    manifest = write_step(st, 2)
    st.commit(2, manifest)
    evil = shard_bytes(b"E" * 1000)
    (tmp_path / "evil.safetensors").write_bytes(evil)
    doc = json.loads((tmp_path / "ckpt" / "step-000000002" / "manifest.json").read_text())
    doc["files"]["../../evil.safetensors"] = file_record(evil)
    del doc["files"][SHARD]
    doc["shards"]["0"]["file"] = "../../evil.safetensors"
    (tmp_path / "ckpt" / "step-000000002" / "manifest.json").write_text(json.dumps(doc))
    out = tmp_path / "out.safetensors"
    r = _cli("export", st.url, "--step", "2", "--to", str(out))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r
    assert "step-000000002/manifest.json" in r.stderr and "format says" in r.stderr, r
    assert not out.exists()
    r = _cli("export", st.url, "--step", "1", "--to", str(out))
    assert r.returncode == 0, r
    assert bytes(safetensors.torch.load_file(str(out))["w"].numpy()) == b"x" * 1000
