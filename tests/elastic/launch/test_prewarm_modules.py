"""The pre-warm zygote imports what a worker's first ``checkpointing()`` call needs: a worker
forked from it pays no import between building its model and its restore (0.2-0.3 s here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import importlib, json, sys
from flashckpt.elastic.launch.prewarm import DEFAULT_MODULES
for name in DEFAULT_MODULES:
    importlib.import_module(name)
before = set(sys.modules)
import torch
import flashckpt
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters())
flashckpt.checkpointing(model, opt, storage=None, job="j", node="n", run_dir=sys.argv[1])
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_a_checkpointer_needs_no_import_the_zygote_has_not_made(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    new = json.loads(out.stdout.strip().splitlines()[-1])
    heavy = [n for n in new if n.split(".")[0] in ("flashckpt", "fsspec", "xxhash", "torch")]
    assert heavy == [], f"imported at the first checkpointing() call: {heavy}"
