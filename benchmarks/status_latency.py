"""How long ``flashckpt status`` takes with live node agents and dead sockets in the run dir,
next to the Python interpreter's own start-up (its floor: ``python -c pass``) in the same run.

Starts ``--agents`` real node agents (``flashckpt agent --detach``, each a job of its own) and
binds ``--dead`` sockets nobody listens on (a crashed agent's, a finished job's leftovers), then
times, interleaved, ``--trials`` runs each of: the floor, ``flashckpt status`` (the live agents
only) and ``flashckpt status --all`` (the dead sockets too). Every agent and file goes at the end,
even on failure.

    .venv/bin/python benchmarks/status_latency.py --agents 3 --dead 20 --trials 10 --out s.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - t0
    if done.returncode not in (0, 1):
        raise SystemExit(f"{cmd} failed ({done.returncode}): {done.stderr}")
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=3, help="live node agents")
    p.add_argument("--dead", type=int, default=20, help="sockets of dead agents")
    p.add_argument("--trials", type=int, default=10, help="runs of each command")
    p.add_argument("--out", help="JSON output file (default: stdout only)")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="fc-status-bench-")
    shm = tempfile.mkdtemp(prefix="fc-status-bench-", dir="/dev/shm")
    run_dir = os.path.join(root, "run")
    os.mkdir(run_dir, 0o700)
    pids: list[int] = []
    try:
        for i in range(args.agents):
            pid_file = os.path.join(root, f"agent{i}.pid")
            subprocess.run(
                [sys.executable, "-m", "flashckpt", "agent", "--job", f"bench{i}", "--node",
                 f"n{i}", "--storage", f"file://{root}/ckpt{i}", "--run-dir", run_dir,
                 "--shm-dir", shm, "--idle-timeout", "600", "--detach", "--pid-file", pid_file],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
            with open(pid_file) as f:
                pids.append(int(f.read()))
        for i in range(args.dead):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(os.path.join(run_dir, f"gone{i}.n{i}.sock"))
            s.close()
        status = [sys.executable, "-m", "flashckpt", "status", "--run-dir", run_dir]
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "flashckpt status": status,
            "flashckpt status --all": [*status, "--all"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        load_before = os.getloadavg()
        for _ in range(args.trials):
            for name, cmd in commands.items():
                times[name].append(_timed(cmd))
        floor = statistics.median(times["python -c pass"])
        result: dict[str, Any] = {
            "agents": args.agents,
            "dead_sockets": args.dead,
            "trials": args.trials,
            "load_average": [load_before, os.getloadavg()],
            "commands": {
                name: {
                    "median_s": statistics.median(ts),
                    "min_s": min(ts),
                    "max_s": max(ts),
                    "over_floor_s": statistics.median(ts) - floor,
                    "ratio_to_floor": statistics.median(ts) / floor,
                }
                for name, ts in times.items()
            },
        }
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in pids:  # each agent removes its slots and socket before it exits
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
