"""The demo: a 2-rank GPT training job with flash checkpointing survives a SIGKILL of one rank.

1. Runs the job uninterrupted (the reference).
2. Runs it again under torchrun with flashckpt snapshotting every 5 steps, SIGKILLs rank 1 in the
   middle of the run; torchrun restarts the workers, which reload their state from shared memory
   (held by the flashckpt node agent, which outlived them) and finish.
3. Prints where each rank resumed from and checks that the final model is bitwise identical to the
   reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import safetensors.torch
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(
    out: str, storage: str, job: str, steps: int, every: int, extra: list[str], work: str
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.2",
        os.path.join(HERE, "gpt_train.py"),
        "--storage",
        storage,
        "--job",
        job,
        "--steps",
        str(steps),
        "--every",
        str(every),
        "--out",
        out,
        *extra,
    ]
    # A restart must not reuse the rendezvous TCP store (and its port): gloo of the new workers
    # would otherwise try the dead worker's old address and hang or fail (`flashckpt run` sets
    # the same).
    # The node agent's socket, log and events, and its snapshot slots, go under the demo's work
    # directory and a /dev/shm directory of its own: removed at the end, nothing left behind.
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        FLASHCKPT_RUN_DIR=os.path.join(work, "agent"),
        FLASHCKPT_SHM_DIR=shm_dir(work),
    )
    print("   $ " + shlex.join(["torchrun", *cmd[3:]]), flush=True)
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def shm_dir(work: str) -> str:
    """The demo's own directory of snapshot slots in /dev/shm."""
    return os.path.join("/dev/shm", os.path.basename(work))


def read_progress(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5)
    p.add_argument(
        "--kill-at", type=int, default=32, help="SIGKILL rank 1 once it passed this step"
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="flashckpt-demo-")
    os.makedirs(shm_dir(work), mode=0o700)
    job = "demo" + uuid.uuid4().hex[:8]
    ok = False
    try:
        print(
            f"== reference run: {a.steps} steps, 2 ranks, no interruption ({work}/ref)", flush=True
        )
        ref = torchrun(
            f"{work}/ref",
            f"file://{work}/ref-ckpt",
            job + "ref",
            a.steps,
            a.every,
            ["--no-checkpoint"],
            work,
        )
        out, _ = ref.communicate(timeout=900)
        if ref.returncode != 0:
            print(out)
            return 1

        print(
            f"== torchrun with flashckpt (flashckpt.checkpointing in the script): snapshot every "
            f"{a.every} steps, SIGKILL rank 1 after step {a.kill_at}",
            flush=True,
        )
        run_dir = f"{work}/run"
        proc = torchrun(run_dir, f"file://{work}/ckpt", job, a.steps, a.every, [], work)
        killed = None
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            rows = read_progress(f"{run_dir}/progress-r1.txt")
            if killed is None and rows and rows[-1]["step"] >= a.kill_at:
                killed = rows[-1]
                os.kill(killed["pid"], signal.SIGKILL)
                print(
                    f"   killed rank 1 (pid {killed['pid']}) with SIGKILL after step "
                    f"{killed['step']}",
                    flush=True,
                )
            time.sleep(0.02)
        out, _ = proc.communicate(timeout=60)
        if proc.returncode != 0 or killed is None:
            print(out)
            print("demo FAILED: the run did not complete" if killed else "demo FAILED: no kill")
            return 1
        for line in out.splitlines():
            if "[rank 0]" in line:
                print("  ", line.split("]:", 1)[-1].strip())
        with open(f"{run_dir}/report.txt") as f:
            starts = [json.loads(line) for line in f]
        for r in starts[2:]:
            print(
                f"   rank {r['rank']} restarted (pid {r['pid']}): resumed at step "
                f"{r['start_step']} from {r['restored_from']}"
            )
        lost = killed["step"] + 1 - min(r["start_step"] for r in starts[2:])
        print(f"   steps recomputed after the kill: {lost} (snapshot interval {a.every})")

        want = safetensors.torch.load_file(f"{work}/ref/final.safetensors")
        got = safetensors.torch.load_file(f"{run_dir}/final.safetensors")
        same = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        ref_loss = read_progress(f"{work}/ref/progress-r0.txt")[-1]["loss"]
        run_loss = read_progress(f"{run_dir}/progress-r0.txt")[-1]["loss"]
        print(f"   final loss: reference {ref_loss:.6f}, resumed run {run_loss:.6f}")
        from_memory = all(r["restored_from"] == "memory" for r in starts[2:])
        if same and from_memory:
            print(
                "== OK: resumed from shared memory; the final model is bitwise identical to the "
                "uninterrupted run"
            )
            ok = True
        else:
            print(f"== FAILED: identical={same}, resumed from memory={from_memory}")
        subprocess.run(
            [sys.executable, "-m", "flashckpt", "ls", f"file://{work}/ckpt"], check=False
        )
        return 0 if ok else 1
    finally:
        if a.keep or not ok:
            print(f"(work directory kept: {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
        # The slots' directory goes either way: it is memory.
        shutil.rmtree(shm_dir(work), ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
