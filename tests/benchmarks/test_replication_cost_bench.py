"""The replication-cost benchmark (benchmarks/replication_cost.py) run tiny: two simulated
machines, each an agent and a trainer, one round of its three variants. Checks the JSON's shape
and that pushes happen with replicas on and never with them off; nothing here is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "replication_cost.py"


def test_help_names_the_options() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for opt in ("--dim", "--layers", "--steps", "--rounds", "--pin", "--no-pin", "--out"):
        assert opt in out.stdout


def test_steps_fewer_than_every_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--steps", "3", "--every", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--every" in out.stderr


def test_a_tiny_run_pushes_only_with_replicas(tmp_path: Path) -> None:
    out = tmp_path / "rc.json"
    cmd = [sys.executable, str(BENCH), "--dim", "256", "--layers", "2", "--batch", "4"]
    cmd += ["--steps", "10", "--every", "5", "--warmup", "1", "--rounds", "1", "--out", str(out)]
    # 1.5 MiB of state per machine: the agent logs each push's size to 0.1 MiB.
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["errors"] == []
    assert res["pinned"] is (len(os.sched_getaffinity(0)) >= 2)
    assert "load_start" in res and "load_end" in res
    runs = {r["variant"]: r for r in res["runs"]}
    assert set(runs) == {"plain", "replicas0", "replicas1"}
    for r in runs.values():
        assert set(r["machines"]) == {"a", "b"}
        for m in r["machines"].values():
            assert m["plain_s"] > 0 and m["loop_s"] > 0
    for v in ("replicas0", "replicas1"):
        r = runs[v]
        assert all(m["ckpts"] == 2 for m in r["machines"].values())
        assert r["lost_per_ckpt_s"] is not None
        for a in r["agents"].values():
            assert a["cpu"]["threads_cpu_s"], "no per-thread CPU of the agent"
            assert "flashckpt-agent-hash" in a["cpu"]["threads_cpu_s"]
    assert "agents" not in runs["plain"] and runs["plain"]["noise_per_ckpt_s"] is not None
    off, on = runs["replicas0"]["agents"], runs["replicas1"]["agents"]
    assert all(a["pushes"] == 0 and a["push_bytes"] == 0 for a in off.values())
    assert all(a["replication_status"] is None for a in off.values())
    for node, a in on.items():
        assert a["pushes"] > 0 and a["push_bytes"] > 0, (node, a)
        status = a["replication_status"]
        assert status["replicas"] == 1 and status["targets"] == [{"a": "b", "b": "a"}[node]]
        assert status["sent"], status
    rnd = res["summary"]["per_round"][0]
    for k in ("lost_per_ckpt_replicas0_s", "lost_per_ckpt_replicas1_s", "difference_s"):
        assert rnd[k] is not None
    assert res["summary"]["target"]["what"].startswith("replication adds")
    assert res["summary"]["median_sender_cpu_s_per_push"] is not None
    assert res["summary"]["median_receiver_cpu_s_per_push"] is not None


def test_spare_core_puts_both_agents_beside_b_and_measures_only_a() -> None:
    rc = _bench_module()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        out = subprocess.run(
            [sys.executable, str(BENCH), "--spare-core"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and "two cores" in out.stderr
        return
    m = rc.Machines(True, 10.0, spare_core=True)
    try:
        assert m.cpu == {"a": cpus[0], "b": cpus[1]}
        assert m.agent_cpu == {"a": cpus[1], "b": cpus[1]}
    finally:
        m.close()
    assert not os.path.exists(m.root)
    plain = rc.Machines(True, 10.0)
    try:
        assert plain.agent_cpu == plain.cpu == {"a": cpus[0], "b": cpus[1]}
    finally:
        plain.close()
    assert rc._measured(rc.parse_args(["--spare-core"])) == ("a",)
    assert rc._measured(rc.parse_args([])) == ("a", "b")
    with pytest.raises(SystemExit):
        rc.parse_args(["--spare-core", "--no-pin"])


def _bench_module() -> Any:  # the benchmark module, imported from benchmarks/
    sys.path.insert(0, str(BENCH.parent))
    try:
        import replication_cost as rc
    finally:
        sys.path.remove(str(BENCH.parent))
    return rc


def test_the_target_is_undecided_inside_the_noise_or_on_negative_figures() -> None:
    rc = _bench_module()
    assert rc._verdict(1.05, 0.5, 0.01)["met"] is True
    assert rc._verdict(1.5, 0.5, 0.01)["met"] is False
    assert rc._verdict(1.05, 0.5, 0.2)["met"] is None  # allowance 0.05 s < noise 0.2 s
    assert rc._verdict(-1.4, 0.4, 0.01)["met"] is None
    assert rc._verdict(None, None, None)["met"] is None
    assert rc._verdict(0.6, 0.49, 0.05, [-1.4, 2.19])["met"] is None  # a negative round
    assert rc._verdict(1.2, 0.5, 0.01, [0.9, 1.5])["met"] is None  # rounds on both sides
    assert rc._verdict(1.5, 0.5, 0.01, [1.4, 1.6])["met"] is False
    # Replicas clearly add more than the allowance + noise, the figure without them negative.
    assert rc._verdict(34.9, 0.03, 0.27, [None, 5.9, 36.7], difference=0.94)["met"] is False
    assert rc._verdict(1.05, 0.5, 0.01, [1.05], difference=0.025)["met"] is True
