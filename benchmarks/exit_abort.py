"""How often a finished two-rank gloo run aborts at interpreter exit, beside CPU-bound processes.

torch 2.13's gloo process group drops a finished collective's work on its worker thread a moment
after the caller's ``wait()`` returned; when that drop frees the caller's Python tensors during
interpreter shutdown, the process aborts with SIGABRT ("terminate called without an active
exception") although the run ended well. A run that ends with a collective and exits without
``destroy_process_group()`` is exposed; a loaded machine widens the window.

Variants, each run the same number of times, interleaved, in the same run of this script:

- ``torch``: plain torch, ``all_gather`` then ``sys.exit(0)`` (the peer: what torch alone does);
- ``torch-destroyed``: the same with ``destroy_process_group()`` before the exit;
- ``flashckpt``: ``flashckpt.checkpointing`` over a tiny model (its exit runs the checkpointer's
  own collectives: the final save's agreement), then ``sys.exit(0)`` without
  ``destroy_process_group()``: whether the checkpointer's exit adds to torch's own exposure.

Output: JSON (runs, aborted, other failures per variant). Example::

    python benchmarks/exit_abort.py --runs 40 --burners 2 --out benchmarks/runs/exit-abort.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine_info

VARIANTS = ("torch", "torch-destroyed", "flashckpt")

_WORKER = r"""
import os, sys
import torch, torch.distributed as dist
variant, workdir = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo")
if variant.startswith("torch"):
    t = torch.tensor([dist.get_rank()])
    out = [torch.zeros(1, dtype=t.dtype) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    del t, out
    if variant == "torch-destroyed":
        dist.destroy_process_group()
    sys.exit(0)
import flashckpt
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with flashckpt.checkpointing(
    model, opt, storage="file://" + workdir + "/ckpt", run_dir=workdir + "/run", job="j",
    restore=False, every=1,
) as ckpt:
    for _ in range(ckpt.start_step, 2):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step()
sys.exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(variant: str, workdir: str, timeout: float) -> tuple[list[int | None], str]:
    """Runs the worker as two ranks; returns their exit codes (None: killed at the timeout) and
    the tail of their stderr."""
    port = _free_port()
    procs, errs = [], []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
        }
        err = open(os.path.join(workdir, f"err{rank}"), "w+b")  # noqa: SIM115 (closed below)
        errs.append(err)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _WORKER, variant, workdir],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
        )
    codes: list[int | None] = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
            p.wait()
            codes.append(None)
    tail = []
    for err in errs:
        err.seek(0)
        tail.append(err.read().decode(errors="replace")[-400:])
        err.close()
    return codes, "\n".join(tail)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=30, help="launches per variant")
    p.add_argument("--burners", type=int, default=2, help="CPU-bound processes beside")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--timeout", type=float, default=120.0, help="per launch")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}: choose from {', '.join(VARIANTS)}")
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.burners)
    ]
    results: dict[str, dict[str, Any]] = {
        v: {"runs": 0, "aborted": 0, "other_failures": 0, "examples": []} for v in variants
    }
    root = tempfile.mkdtemp(prefix="fcabrt.")
    t0 = time.time()
    try:
        for i in range(a.runs):
            for v in variants:
                workdir = os.path.join(root, f"{v}.{i}")
                os.makedirs(workdir)
                codes, tail = _launch(v, workdir, a.timeout)
                r = results[v]
                r["runs"] += 1
                aborted = any(c in (-6, 134) for c in codes) or "terminate called" in tail
                if aborted:
                    r["aborted"] += 1
                elif any(c != 0 for c in codes):
                    r["other_failures"] += 1
                    if len(r["examples"]) < 3:
                        r["examples"].append({"codes": codes, "stderr_tail": tail[-600:]})
                shutil.rmtree(workdir, ignore_errors=True)
            print(
                f"run {i + 1}/{a.runs}: "
                + ", ".join(f"{v} {results[v]['aborted']} aborted" for v in variants),
                file=sys.stderr,
                flush=True,
            )
    finally:
        for b in burners:
            b.kill()
            b.wait()
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "benchmark": "exit_abort",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "seconds": round(time.time() - t0, 1),
        "burners": a.burners,
        "load_avg_end": os.getloadavg(),
        "machine": machine_info(),
        "variants": results,
    }
    text = json.dumps(out, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
