"""Slow storage vs the training loop (issue 30): a trainer snapshots every step with the default
``persist_every`` ("5m") while the node agent persists to storage throttled to ``--rate`` MB/s
(a storage wrapper in the agent's process: every chunk of a shard write, 1 MiB here, waits as
long as a link of that rate would take). Prints the loop's wall time against the same run on
unthrottled storage and with no storage at all, the persists written during the loop per
``persist_every`` interval begun, and the steps the agent persisted (or gave up for a trainer
wanting the slot: its ``persisted_high``) with the steps and seconds between them.

    python benchmarks/slow_storage_persist.py --rate 3 --width 50000 --steps 300

The agent runs in this process (a thread), so the wrapper applies to it; the trainer is
``tests/support/tinytrain.py`` in a process of its own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))

import flashckpt.agent.persist as agent_persist  # noqa: E402
from flashckpt.agent.daemon import AgentConfig, NodeAgent  # noqa: E402
from flashckpt.format.storage import Storage  # noqa: E402
from flashckpt.trainer.config import parse_persist_every  # noqa: E402

CHUNK = 1 << 20


def throttle(rate_mb_s: float) -> None:
    """Every chunk of a shard write takes at least CHUNK / rate (the pause sits in the write's
    own between-chunk callback, where the agent also gives way to a trainer)."""
    agent_persist.WRITE_CHUNK = CHUNK
    real = Storage.write_buffer

    def write_buffer(
        self: Storage, path: str, head: bytes, data: Any, check: Any = None, **kw: Any
    ) -> Any:
        def slow() -> None:
            time.sleep(CHUNK / (rate_mb_s * 1e6))
            if check is not None:
                check()

        return real(self, path, head, data, slow, **kw)

    Storage.write_buffer = write_buffer  # type: ignore[method-assign]


def run(args: argparse.Namespace, tmp: Path, slow: bool, keep: bool = True) -> dict[str, Any]:
    """One run; ``keep=False``: no storage at all (the agent holds the snapshots in memory,
    the trainer marks nothing): the loop's floor."""
    job = "bslow" + uuid.uuid4().hex[:8]
    run_dir = str(tmp / f"run-{job}")
    storage = f"file://{tmp}/ckpt-{job}" if keep else ""
    cfg = AgentConfig(job=job, node="n0", storage=storage or None, run_dir=run_dir)
    agent = NodeAgent(cfg)
    agent.start()
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    log = tmp / f"{job}.log"
    cmd = [
        sys.executable,
        str(HERE.parent / "tests" / "support" / "tinytrain.py"),
        "--storage",
        storage,
        "--job",
        job,
        "--run-dir",
        run_dir,
        "--log",
        str(log),
        "--steps",
        str(args.steps),
        "--every",
        "1",
        "--width",
        str(args.width),
        "--step-sleep",
        str(args.step_sleep),
        "--persist-every",
        args.persist_every,
        "--quiet",
        "--report",
        str(log) + ".start",
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # The loop's time: from its first logged step to its last (entry and exit excluded).
    first = last = None
    written = 0
    persisted: list[tuple[float, int]] = []
    seen = -1
    while p.poll() is None:
        n = len(log.read_bytes().splitlines()) if log.exists() else 0
        now = time.monotonic()
        if n and first is None:
            first = now
        if n >= args.steps and last is None:
            last = now
            written = sum(agent.st.shard_writes.values())  # persists written in the loop
        high = agent.st.persisted_high
        if high > seen:
            persisted.append((now, high))
            seen = high
        time.sleep(0.01)
    err = p.stderr.read().decode() if p.stderr else ""
    assert p.returncode == 0, err[-3000:]
    if last is None:
        last = time.monotonic()
        written = sum(agent.st.shard_writes.values())
    agent.request_stop()
    t.join(120)
    steps = [s for _, s in persisted]
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    times = [b - a for (a, _), (b, _) in itertools.pairwise(persisted)]
    # persist_every's bound: the persists written while the loop ran (the give-ways and the
    # exit's final persist left out) per interval begun.
    _, every_s = parse_persist_every(args.persist_every)
    loop_s = last - (first or last)
    intervals = math.ceil(max(loop_s, 1e-9) / every_s) if every_s is not None else None
    return {
        "slow": slow,
        "storage": keep,
        "loop_s": loop_s,
        "persists": steps,
        "written_during_loop": written,
        "intervals": intervals,
        "written_per_interval": written / intervals if intervals else None,
        "max_steps_between": max(gaps, default=0),
        "max_s_between": max(times, default=0.0),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=3.0, help="storage MB/s (throttled run)")
    ap.add_argument("--width", type=int, default=50_000, help="tinytrain width (~230 B each)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    ap.add_argument("--persist-every", default="5m")
    ap.add_argument("--out", default=None, help="write the results as JSON to this file")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fc-slow-"))
    try:
        none = run(args, tmp, slow=False, keep=False)
        fast = run(args, tmp, slow=False)
        throttle(args.rate)
        slow = run(args, tmp, slow=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f" no storage: loop {none['loop_s']:.1f} s")
    for r in (fast, slow):
        print(
            f"{'throttled' if r['slow'] else 'unthrottled':>11}: loop {r['loop_s']:.1f} s, "
            f"{len(r['persists'])} steps persisted or given way ({r['persists'][:8]}...), "
            "at most "
            f"{r['max_steps_between']} steps / {r['max_s_between']:.1f} s between two; "
            f"{r['written_during_loop']} written during the loop "
            f"({r['intervals']} persist_every interval(s) begun)"
        )
    ratio = slow["loop_s"] / max(fast["loop_s"], 1e-9)
    floor = max(none["loop_s"], 1e-9)
    vs_none = {"unthrottled": fast["loop_s"] / floor, "throttled": slow["loop_s"] / floor}
    print(
        f"slowdown x{ratio:.2f} at {args.rate} MB/s; against no storage: unthrottled "
        f"x{vs_none['unthrottled']:.2f}, throttled x{vs_none['throttled']:.2f}"
    )
    if args.out:
        result = {
            "args": vars(args),
            "no_storage": none,
            "unthrottled": fast,
            "throttled": slow,
            "slowdown": ratio,
            "vs_no_storage": vs_none,
        }
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
