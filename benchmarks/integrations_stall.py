"""Training time lost per checkpoint inside each framework's own loop: flashckpt's adapter
against the framework's own checkpointing, side by side in one run (issue 29).

For each framework (the Hugging Face ``Trainer``, a Lightning ``Trainer``), the same training
command (``tests/support/hftrain.py`` / ``pltrain.py``) runs three ways, one after the
other, several rounds interleaved: without checkpoints (``none``), with
``flashckpt.integrations.<framework>.FlashCheckpoint(every=N, persist_every=1)`` (every snapshot
also persisted to storage by the node agent, as the framework's own checkpoint is written every
time), and with the framework's own checkpoint every N steps (HF ``save_steps=N``; Lightning
``ModelCheckpoint(every_n_train_steps=N)``), to the same local disk. Each run logs every
step's wall time; the time lost per checkpoint is the mean of the step intervals that hold a
checkpoint less the median of the others (``none``, measured on the same intervals, is the noise
floor), the median over the rounds.

    python benchmarks/integrations_stall.py --out benchmarks/runs/integrations.json

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "huggingface": ROOT / "tests" / "support" / "hftrain.py",
    "lightning": ROOT / "tests" / "support" / "pltrain.py",
}


def one_run(framework: str, mode: str, a: argparse.Namespace, tmp: Path) -> dict:
    tag = f"{framework}-{mode}-{uuid.uuid4().hex[:6]}"
    times = tmp / f"{tag}.times"
    job = "b" + uuid.uuid4().hex[:12]
    cmd = [
        sys.executable,
        str(SCRIPTS[framework]),
        "--mode",
        mode,
        "--out",
        str(tmp / tag),
        "--log",
        str(tmp / f"{tag}.log"),
        "--steps",
        str(a.steps),
        "--every",
        str(a.every),
        "--width",
        str(a.hf_width if framework == "huggingface" else a.pl_width),
        "--step-times",
        str(times),
        "--storage",
        f"file://{tmp}/{tag}-ckpt",
        "--job",
        job,
        "--run-dir",
        f"/tmp/fcb-{job}",
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t0
    shutil.rmtree(f"/tmp/fcb-{job}", ignore_errors=True)
    if p.returncode != 0:
        raise RuntimeError(f"{tag} failed:\n{p.stderr[-3000:]}")
    times_by_step = {
        int(line.split()[0]): float(line.split()[1]) for line in times.read_text().splitlines()
    }
    # The step interval that holds the checkpoint of step s: HF logs the interval from step s's
    # start to step s+1's start (its checkpoint comes between); Lightning logs when a batch
    # ends, before the checkpoint callbacks, so the checkpoint of step s is in interval s + 1.
    shift = 0 if framework == "huggingface" else 1
    held = {s + shift for s in range(a.every, a.steps, a.every)}
    warm = 2  # the first steps warm up (allocator, lazy optimizer state)
    at_ckpt = [t for s, t in times_by_step.items() if s in held and s > warm]
    others = [t for s, t in times_by_step.items() if s not in held and s > warm]
    med = statistics.median(others)
    lost = statistics.mean(at_ckpt) - med
    ckpts = len(at_ckpt) if mode != "none" else 0
    return {
        "wall_s": wall,
        "median_step_s": med,
        "lost_per_checkpoint_s": lost,
        "checkpoints": ckpts,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default="huggingface,lightning")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hf-width", type=int, default=512, help="GPT-2 n_embd (~75 MB of state)")
    p.add_argument("--pl-width", type=int, default=2048, help="MLP width (~50 MB of state)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fc-integ-bench-"))
    results: dict = {
        "args": vars(a),
        "load_avg_start": os.getloadavg(),
        "frameworks": {},
    }
    try:
        for fw in a.frameworks.split(","):
            runs: dict[str, list[dict]] = {"none": [], "flash": [], "native": []}
            for _ in range(a.rounds):
                for mode in runs:  # interleaved: a load change hits every mode alike
                    runs[mode].append(one_run(fw, mode, a, tmp))
            summary: dict = {}
            for mode, rs in runs.items():
                lost = statistics.median(r["lost_per_checkpoint_s"] for r in rs)
                summary[mode] = {
                    "lost_per_checkpoint_s": lost,  # the median over rounds
                    "median_step_s": statistics.median(r["median_step_s"] for r in rs),
                    "rounds": rs,
                }
            f, n = (
                summary["flash"]["lost_per_checkpoint_s"],
                summary["native"]["lost_per_checkpoint_s"],
            )
            summary["native_over_flash"] = n / f if f > 0 else None
            results["frameworks"][fw] = summary
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_avg_end"] = os.getloadavg()
    print(f"{'framework':12} {'mode':7} {'median step':>12} {'lost/ckpt':>10}  rounds")
    for fw, s in results["frameworks"].items():
        for mode in ("none", "flash", "native"):
            r = s[mode]
            rounds = " ".join(f"{x['lost_per_checkpoint_s']:.3f}" for x in r["rounds"])
            print(
                f"{fw:12} {mode:7} {r['median_step_s']:12.4f} "
                f"{r['lost_per_checkpoint_s']:10.4f}  {rounds}"
            )
        ratio = s["native_over_flash"]
        print(
            f"{fw:12} native/flash lost per checkpoint: {'-' if ratio is None else f'{ratio:.1f}x'}"
        )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
