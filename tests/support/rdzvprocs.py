"""Real rendezvous processes on our etcd handler: their environment and the failover of
``tests/elastic/rendezvous/test_rendezvous_multiprocess.py`` (also run through a secured etcd by
``tests/elastic/etcd/test_etcd_security.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import flashckpt.elastic

WORKER = Path(__file__).with_name("_rdzv_worker.py")
ROUNDS_WORKER = Path(__file__).with_name("_rdzv_rounds_worker.py")
SOURCE_ROOT = Path(flashckpt.elastic.__file__).resolve().parents[2]


def rdzv_env() -> dict[str, str]:
    env = dict(os.environ)
    # Workers import `elastic` from this checkout whether or not the package is installed.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH", "")) if p
    )
    env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only: never touch another network
    env["OMP_NUM_THREADS"] = "1"
    return env


def log_tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs)


def _rounds(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_failover(etcd_url: str, tmp_path: Path, env: dict[str, str]) -> None:
    """The rounds of :func:`test_rank_0_dies_a_new_node_joins_and_the_survivor_keeps_its_rank`
    against the etcd at ``etcd_url``, the nodes run with ``env``."""
    run_id = f"mpr-{uuid.uuid4().hex[:8]}"
    go = tmp_path / "go"
    go.mkdir()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: list[Path] = []

    def start(name: str, rounds: int) -> Path:
        out, log = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.log"
        logs.append(log)
        args = [etcd_url, run_id, "2", str(rounds), str(out), str(go)]
        with open(log, "wb") as log_file:
            procs[name] = subprocess.Popen(
                [sys.executable, str(ROUNDS_WORKER), *args],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return out

    def wait_rounds(out: Path, n: int, timeout: float = 120) -> list[dict[str, object]]:
        deadline = time.monotonic() + timeout
        while len(_rounds(out)) < n:
            dead = [k for k, p in procs.items() if p.poll() not in (None, 0, -signal.SIGKILL)]
            if dead or time.monotonic() > deadline:
                pytest.fail(f"no round {n} in {out.name} (failed: {dead}):\n{log_tails(logs)}")
            time.sleep(0.1)
        return _rounds(out)

    try:
        outs = {name: start(name, 2) for name in ("p0", "p1")}
        first = {name: wait_rounds(out, 1)[0] for name, out in outs.items()}
        assert sorted(r["rank"] for r in first.values()) == [0, 1], first
        assert all(r["world_size"] == 2 and r["sum"] == 3 for r in first.values()), first
        victim = next(n for n, r in first.items() if r["rank"] == 0)
        survivor = next(n for n, r in first.items() if r["rank"] == 1)
        os.killpg(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait()
        outs["p2"] = start("p2", 1)  # it waits as a standby: the round is full
        (go / "go-1").touch()

        again = wait_rounds(outs[survivor], 2)[1]
        newcomer = wait_rounds(outs["p2"], 1)[0]
        for name in (survivor, "p2"):
            assert procs[name].wait(timeout=60) == 0, log_tails(logs)
        # The newcomer waited as a standby, and its log says so; the survivor never was one.
        logs_of = {log.stem: log.read_text(errors="replace") for log in logs}
        assert "standby: job" in logs_of["p2"], logs_of["p2"][-2000:]
        assert "standby: job" not in logs_of[survivor]
        assert again["node"] == first[survivor]["node"] != newcomer["node"]
        assert again["rank"] == 1, (first, again, newcomer)
        assert newcomer["rank"] == 0, newcomer
        assert again["world_size"] == newcomer["world_size"] == 2
        # Both all-reduced over the new world through the TCPStore the newcomer hosts at the
        # address it published.
        assert again["sum"] == newcomer["sum"] == 3
        assert (again["master_addr"], again["master_port"]) == (
            newcomer["master_addr"],
            newcomer["master_port"],
        )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
