"""The HF ``Trainer`` asked for FSDP on CPU: accelerate (1.15) enables FSDP only for GPU-type
distributed types, so with ``use_cpu=True`` the run trains unsharded (``is_fsdp_enabled`` False)
without a word. ``FlashCheckpoint`` refuses it, naming what happened, instead of checkpointing it
as the sharded run its user thinks it is. A one-rank distributed world (torchrun's environment,
gloo) is enough: the Trainer refuses ``fsdp=`` outside distributed training itself. The FSDP2 run
on GPUs is in ``benchmarks/gpu_check.sh``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

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
