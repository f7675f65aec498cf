"""Training time lost per checkpoint inside each framework's own loop: flashckpt's adapter
against the framework's own checkpointing, side by side in one run (issue 29).

For each framework (the Hugging Face ``Trainer``, a Lightning ``Trainer``, torchtitan's
components in the loop of its ``Trainer.train``), the same training command
(``tests/support/hftrain.py`` / ``pltrain.py`` / ``tttrain.py``) runs three ways, one after the
other, several rounds interleaved: without checkpoints (``none``), with
``flashckpt.integrations.<framework>.FlashCheckpoint(every=N, persist_every=1)`` (every snapshot
also persisted to storage by the node agent, as the framework's own checkpoint is written every
time), and with the framework's own checkpoint every N steps (HF ``save_steps=N``; Lightning
``ModelCheckpoint(every_n_train_steps=N)``; torchtitan's ``CheckpointManager`` with
``interval=N``, its DCP save, and also in its ``async_mode="async"`` (``native-async``) and
``"async_with_pinned_mem"`` (``native-pinned``)), to the same local disk. Lightning also runs
with its ``AsyncCheckpointIO`` plugin (``native-async``), and sharded (issue 42:
``lightning-fsdp2``, ``ModelParallelStrategy`` with FSDP2 on 2 ranks under ``torchrun``), against
its ``ModelCheckpoint`` (the strategy's DCP save) and DCP ``async_save`` with one cached
``DefaultStager`` (``dcp-async``); each Lightning entry records the memory copy of the state a
rank snapshots and the issue's target (``copy_target``). torchtitan runs from
``.venv/torchtitan-site`` (``scripts/setup.sh`` installs it there; ``--torchtitan-site``
elsewhere): without it, torchtitan is skipped with a line saying so, or refused when
``--frameworks`` names it. Each run logs every
step's wall time; the time lost per checkpoint is the mean of the step intervals that hold a
checkpoint less the median of the others (``none``, measured on the same intervals, is the noise
floor), the median over the rounds. A save in the background also slows the steps after it:
``loop_lost_per_checkpoint_s`` is the whole loop's time (the steps after the warm-up) less that
of ``none`` in the same round, per checkpoint, the median over the rounds.

``torchtitan-sharded`` (issue 42) is torchtitan's Llama 3 model code and ``parallelize_llama``
with FSDP2 on ``--tts-world`` forked ranks (``tests/support/ttshard.py``, gloo on CPU), against
its ``CheckpointManager`` in DCP sync, ``async`` (``dcp.async_save``) and
``async_with_pinned_mem`` (its pinned-memory stager: an accelerator only). torchtitan's runs also
time a memory copy of the state one rank snapshots (``memcpy_s``): flash's
``lost_over_memcpy`` and ``within_copy_target`` (max(1.5x, +20 ms)) are set against it.

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
    "torchtitan": ROOT / "tests" / "support" / "tttrain.py",
    "lightning-fsdp2": ROOT / "tests" / "support" / "pltrain.py",
    "torchtitan-sharded": ROOT / "tests" / "support" / "ttshard.py",
}
MODES = {
    "huggingface": ("none", "flash", "native"),
    "lightning": ("none", "flash", "native", "native-async"),
    "lightning-fsdp2": ("none", "flash", "native", "dcp-async"),
    "torchtitan": ("none", "flash", "native", "native-async", "native-pinned"),
    # torchtitan sharded (issue 42): its Llama 3 code and parallelize_llama, FSDP2 on 2 forked
    # ranks (gloo, CPU); its CheckpointManager in DCP sync, async (dcp.async_save) and
    # async_with_pinned_mem (async_save with its pinned-memory stager: an accelerator only)
    "torchtitan-sharded": (
        "none",
        "flash",
        "native",
        "native:async",
        "native:async_with_pinned_mem",
    ),
}
WIDTH = {
    "huggingface": "hf_width",
    "lightning": "pl_width",
    "torchtitan": "tt_width",
    "lightning-fsdp2": "pl_width",
    "torchtitan-sharded": "tts_width",
}
# Lightning's sharded runs (issue 42): pltrain.py under torchrun, ModelParallelStrategy with
# FSDP2 in configure_model() on 2 CPU ranks (gloo). Their own best modes: ModelCheckpoint (the
# strategy's DCP save, synchronous) and DCP async_save with one cached DefaultStager.
SHARDED = {"lightning-fsdp2": (2, "fsdp2")}


def torchtitan_sharded_args(a: argparse.Namespace) -> list[str]:
    """ttshard.py's flags beside the common ones: the ranks, the mesh, the model's depth."""
    return ["--fork-world", str(a.tts_world), "--tp", str(a.tts_tp), "--layers", str(a.tts_layers)]


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
        str(getattr(a, WIDTH[framework])),
        "--step-times",
        str(times),
        "--storage",
        f"file://{tmp}/{tag}-ckpt",
        "--job",
        job,
        "--run-dir",
        f"/tmp/fcb-{job}",
    ]
    if framework.startswith("torchtitan"):
        cmd += ["--torchtitan-site", a.torchtitan_site]
    if framework in SHARDED:
        cmd = _sharded_command(framework, cmd)
    if framework == "torchtitan-sharded":
        cmd += torchtitan_sharded_args(a)
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
    # ends, before the checkpoint callbacks, so the checkpoint of step s is in interval s + 1;
    # torchtitan's run logs the interval that ends after step s's save(), which holds it.
    shift = 1 if framework.startswith("lightning") else 0
    held = {s + shift for s in range(a.every, a.steps, a.every)}
    warm = 2  # the first steps warm up (allocator, lazy optimizer state)
    at_ckpt = [t for s, t in times_by_step.items() if s in held and s > warm]
    others = [t for s, t in times_by_step.items() if s not in held and s > warm]
    med = statistics.median(others)
    lost = statistics.mean(at_ckpt) - med
    ckpts = len(at_ckpt) if mode != "none" else 0
    extra: dict = {}
    copy = Path(str(times) + ".copy")  # torchtitan's runs: a memory copy of the snapshot's state
    if copy.exists():
        seconds, nbytes = copy.read_text().split()
        extra = {"memcpy_s": float(seconds), "state_bytes": int(nbytes)}
    return {
        **extra,
        "wall_s": wall,
        "median_step_s": med,
        "lost_per_checkpoint_s": lost,
        "checkpoints": ckpts,
        "loop_s": sum(t for s, t in times_by_step.items() if s > warm),
    }


def _sharded_command(framework: str, cmd: list[str]) -> list[str]:
    """``cmd`` (one process) as a torchrun launch of ``SHARDED[framework]``'s ranks."""
    world, parallel = SHARDED[framework]
    script = cmd.index(str(SCRIPTS[framework]))
    args = ["--steps-log" if x == "--log" else x for x in cmd[script + 1 :]]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "--max-restarts",
        "0",
        str(SCRIPTS[framework]),
        *args,
        "--parallel",
        parallel,
    ]


def _pl_state_bytes(width: int, ranks: int) -> int:
    """Bytes of pltrain.py's model and AdamW moments (fp32) per rank (sharded evenly)."""
    params = 16 * width + width + width * width + width + width + 1
    return 3 * 4 * params // ranks


def _memcpy_s(nbytes: int, reps: int = 15) -> float:
    """The median time of one copy of ``nbytes`` into memory already faulted in: the floor of
    any snapshot of that much state."""
    import torch

    torch.set_num_threads(1)  # as the training processes run (pltrain.py)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_target(framework: str, a: argparse.Namespace) -> dict | None:
    """The issue-42 target for a Lightning run: the time lost per checkpoint at most
    max(1.5x, +20 ms) a memory copy of the state each rank snapshots."""
    if not framework.startswith("lightning"):
        return None
    ranks = SHARDED[framework][0] if framework in SHARDED else 1
    nbytes = _pl_state_bytes(a.pl_width, ranks)
    copy = _memcpy_s(nbytes)
    return {
        "state_bytes_per_rank": nbytes,
        "memcpy_s": copy,
        "target_s": max(1.5 * copy, copy + 0.02),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default=None, help="default: all (torchtitan if installed)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hf-width", type=int, default=512, help="GPT-2 n_embd (~75 MB of state)")
    p.add_argument("--pl-width", type=int, default=2048, help="MLP width (~50 MB of state)")
    p.add_argument("--tt-width", type=int, default=768, help="TinyLM dim (~57 MB of state)")
    p.add_argument("--tts-width", type=int, default=512, help="sharded Llama 3 dim")
    p.add_argument("--tts-layers", type=int, default=2, help="sharded Llama 3 layers")
    p.add_argument("--tts-world", type=int, default=2, help="sharded ranks (forked)")
    p.add_argument("--tts-tp", type=int, default=1, help="sharded tensor-parallel degree")
    p.add_argument("--torchtitan-site", default=str(ROOT / ".venv" / "torchtitan-site"))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    frameworks = (a.frameworks or ",".join(SCRIPTS)).split(",")
    skipped: dict[str, str] = {}
    tt = [f for f in frameworks if f.startswith("torchtitan")]
    for fw in tt if not (Path(a.torchtitan_site) / "torchtitan").is_dir() else []:
        why = (
            f"no torchtitan in {a.torchtitan_site} (scripts/setup.sh installs torchtitan 0.3.0 "
            "there; or pass --torchtitan-site DIR, a pip --target install of it)"
        )
        if a.frameworks:  # asked for by name: refused
            print(f"{fw}: {why}", file=sys.stderr)
            return 2
        print(f"{fw}: skipped: {why}")
        frameworks.remove(fw)
        skipped[fw] = why
    tmp = Path(tempfile.mkdtemp(prefix="fc-integ-bench-"))
    results: dict = {
        "args": vars(a),
        "load_avg_start": os.getloadavg(),
        "frameworks": {},
        "skipped": skipped,
        "unavailable": {},
    }
    try:
        for fw in frameworks:
            runs: dict[str, list[dict]] = {m: [] for m in MODES[fw]}
            for _ in range(a.rounds):
                for mode in list(runs):  # interleaved: a load change hits every mode alike
                    try:
                        runs[mode].append(one_run(fw, mode, a, tmp))
                    except RuntimeError as e:
                        if mode in ("none", "flash"):
                            raise
                        # a mode of the framework's own that does not run here (torchtitan's
                        # pinned-memory async needs an accelerator): recorded with its error
                        last = str(e).strip().splitlines()[-1]
                        print(f"{fw} {mode}: does not run here: {last}", file=sys.stderr)
                        results["unavailable"].setdefault(fw, {})[mode] = last
                        del runs[mode]
            summary: dict = {}
            for mode, rs in runs.items():
                lost = statistics.median(r["lost_per_checkpoint_s"] for r in rs)
                summary[mode] = {
                    "lost_per_checkpoint_s": lost,  # the median over rounds
                    "median_step_s": statistics.median(r["median_step_s"] for r in rs),
                    "rounds": rs,
                }
                if mode != "none":  # whole loop against none's in the same round, per ckpt:
                    # what a background save costs the steps after the checkpoint too
                    summary[mode]["loop_lost_per_checkpoint_s"] = statistics.median(
                        (r["loop_s"] - n["loop_s"]) / r["checkpoints"]
                        for r, n in zip(rs, runs["none"], strict=False)
                    )
            copies = [r["memcpy_s"] for r in runs["flash"] if "memcpy_s" in r]
            if copies:  # the target: lost per checkpoint within max(1.5x, +20 ms) of a copy
                copy_s = statistics.median(copies)
                lost = summary["flash"]["lost_per_checkpoint_s"]
                summary["flash"]["memcpy_s"] = copy_s
                summary["flash"]["state_bytes"] = runs["flash"][0]["state_bytes"]
                summary["flash"]["lost_over_memcpy"] = lost / copy_s if copy_s > 0 else None
                summary["flash"]["within_copy_target"] = lost <= max(1.5 * copy_s, copy_s + 0.02)
            f = summary["flash"]["lost_per_checkpoint_s"]
            for mode in runs:
                if mode not in ("none", "flash"):  # the framework's own modes
                    n = summary[mode]["lost_per_checkpoint_s"]
                    summary[f"{mode}_over_flash"] = n / f if f > 0 else None
            target = _copy_target(fw, a)
            if target is not None:
                summary["copy_target"] = target
            results["frameworks"][fw] = summary
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_avg_end"] = os.getloadavg()
    for fw, s in results["frameworks"].items():
        if "copy_target" in s:
            t = s["copy_target"]
            print(
                f"{fw:12} memory copy of {t['state_bytes_per_rank'] / 1e6:.0f} MB per rank: "
                f"{t['memcpy_s'] * 1e3:.1f} ms; target lost/ckpt <= {t['target_s'] * 1e3:.1f} ms"
            )
    print(
        f"{'framework':12} {'mode':13} {'median step':>12} {'lost/ckpt':>10} "
        f"{'loop-none/ckpt':>14}  rounds"
    )
    for fw, s in results["frameworks"].items():
        for mode in MODES[fw]:
            if mode not in s:
                print(f"{fw:12} {mode:13} does not run here: {results['unavailable'][fw][mode]}")
                continue
            r = s[mode]
            rounds = " ".join(f"{x['lost_per_checkpoint_s']:.3f}" for x in r["rounds"])
            whole = r.get("loop_lost_per_checkpoint_s")
            print(
                f"{fw:12} {mode:13} {r['median_step_s']:12.4f} "
                f"{r['lost_per_checkpoint_s']:10.4f} "
                f"{'-' if whole is None else f'{whole:.4f}':>14}  {rounds}"
            )
        if "memcpy_s" in s.get("flash", {}):
            fl = s["flash"]
            print(
                f"{fw:12} flash: a memory copy of its {fl['state_bytes'] / 1e6:.0f} MB "
                f"{fl['memcpy_s']:.4f} s, lost/ckpt {fl['lost_over_memcpy']:.2f}x of it "
                f"(target max(1.5x, +20 ms): {'met' if fl['within_copy_target'] else 'NOT met'})"
            )
        for mode in MODES[fw]:
            if mode not in ("none", "flash") and mode in s:
                ratio = s[f"{mode}_over_flash"]
                shown = "-" if ratio is None else f"{ratio:.1f}x"
                print(f"{fw:12} {mode}/flash lost per checkpoint: {shown}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
