"""The HF ``Trainer`` with FSDP. As shipped, accelerate (1.15) enables FSDP only for GPU-type
distributed types, so with ``use_cpu=True`` the run trains unsharded (``is_fsdp_enabled`` False)
without a word: ``FlashCheckpoint`` refuses it, naming what happened, instead of checkpointing it
as the sharded run its user thinks it is (a one-rank distributed world is enough: the Trainer
refuses ``fsdp=`` outside distributed training itself). With that one gate lifted, accelerate's
FSDP2 path runs on gloo, and the Trainer's sharded run is killed and resumed bitwise on 2 CPU
ranks. The same run on GPUs, and FSDP1's refusal (its plugin will not build without a GPU), are
in ``benchmarks/gpu_check.sh``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fchelpers import FcEnv
from killresume import TrainScript, different, reference_env, run

pytestmark = pytest.mark.slow

SCRIPT = TrainScript("hftrain.py", steps=24)  # 2 ranks x 4 samples of 40: 5 steps per epoch

_SCRIPT = r"""
import sys
import torch
from transformers import Trainer, TrainingArguments
from flashckpt.integrations.huggingface import FlashCheckpoint

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        return {"loss": torch.nn.functional.mse_loss(self.lin(x), labels)}

args = TrainingArguments(
    output_dir=sys.argv[1], use_cpu=True, fsdp=True, fsdp_config={"fsdp_version": 2},
    report_to=[], max_steps=2,
)
t = Trainer(model=M(), args=args)
print("plain", t.is_fsdp_enabled, t.accelerator.state.distributed_type.value)
try:
    Trainer(model=M(), args=args, callbacks=[FlashCheckpoint(None, every=1)])
    print("ACCEPTED")
except ValueError as e:
    print("REFUSED", e)
import torch.distributed as dist
dist.destroy_process_group()
"""


def test_fsdp_asked_on_cpu_is_refused_not_checkpointed_unsharded(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    p = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    plain, verdict = p.stdout.strip().splitlines()[-2:]
    assert plain == "plain False MULTI_CPU"  # accelerate: no FSDP on CPU, and no error
    assert verdict.startswith("REFUSED"), p.stdout
    assert "did not enable it (distributed type MULTI_CPU)" in verdict
    assert "trains the whole model on every rank, unsharded" in verdict
    assert 'fsdp_config={"fsdp_version": 2}' in verdict  # the fix named


def _rank_files(out: Path) -> list[dict[str, torch.Tensor]]:
    return [
        safetensors.torch.load_file(str(out / name))
        for name in ("final.safetensors", "final.rank1.safetensors")
    ]


def test_fsdp2_two_ranks_killed_rank_resumes_bitwise(tmp_path: Path, fc_env: FcEnv) -> None:
    """The Trainer with accelerate's FSDP2 plugin on 2 CPU ranks (gloo; accelerate's device-type
    gate lifted in the script, the rest of its FSDP2 path as it is: ``fully_shard`` per block,
    the optimizer pointed at the DTensor parameters): rank 1 SIGKILLed at step 6, the same
    command resumes, and every rank's pieces of every parameter and optimizer moment, the LR and
    the log history end equal to the uninterrupted run's."""
    ref_env = reference_env(fc_env)
    extra = ("--every", "4", "--fsdp2-cpu")
    out = tmp_path / "run"
    cmd = SCRIPT.torchrun_command(fc_env, out, *extra, "--step-sleep", "0.05")
    # The uninterrupted run (a job of its own) beside the killed one: most of each launch is
    # imports and process start, so side by side they take little more than one.
    ref_cmd = SCRIPT.torchrun_command(ref_env, tmp_path / "ref", *extra)
    with subprocess.Popen(
        ref_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    ) as p:
        try:
            assert SCRIPT.kill_torchrun_at(cmd, out, 6, ranks=(1,), launcher=False) != 0
            _, err = p.communicate(timeout=240)
        finally:
            if p.poll() is None:  # torchrun and its ranks (a session of their own)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert p.returncode == 0, err.decode()[-4000:]
    ref, ref_report = (
        _rank_files(tmp_path / "ref"),
        json.loads((tmp_path / "ref" / "final.json").read_text()),
    )
    assert ref_report["global_step"] == 12 and ref_report["restored_from"] is None
    # sharded: each rank holds its half of each parameter (GPT-2's wte: 64 x 32)
    wte = "model.transformer.wte.weight"
    assert ref[0][wte].shape == (32, 32) and not torch.equal(ref[0][wte], ref[1][wte])
    run(cmd)  # the same command: both ranks resume their own pieces
    got, report = _rank_files(out), json.loads((out / "final.json").read_text())
    assert report["restored_from"] in ("memory", "storage"), report
    assert report["restored_step"] in (4, 8), report
    for r in (0, 1):
        assert different(ref[r], got[r]) == [], r
        assert any(k.endswith("exp_avg_sq") for k in got[r])
    strip = [{k: v for k, v in e.items() if k != "train_loss"} for e in ref_report["log_history"]]
    assert [
        {k: v for k, v in e.items() if k != "train_loss"} for e in report["log_history"]
    ] == strip
