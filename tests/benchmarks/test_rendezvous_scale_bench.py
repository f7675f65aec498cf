"""The rendezvous scale benchmark (benchmarks/rendezvous_scale.py) at a tiny N, for real: 4
simulated machines and a standby, flashckpt-etcd and torch's c10d, against an etcd it starts.

Checks the JSON it writes, not its times: every machine got a distinct rank 0..N-1 in round 1,
the round after the kill holds every survivor and the standby with distinct ranks, the counts
are there and not negative, and nothing it started is left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from flashckpt.elastic.etcd.server import EtcdV3ServerError, find_etcd_binary

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "rendezvous_scale.py"
N = 4


def _etcd_or_skip() -> None:
    try:
        find_etcd_binary()
    except EtcdV3ServerError as exc:
        pytest.skip(str(exc))


def _check_rounds(r: dict[str, Any]) -> None:
    assert r.get("failure") is None, r.get("failure")
    assert r["errors"] == [], r["errors"]
    one = r["round1"]
    assert one["formed"] is True and one["machines_with_rank"] == N
    assert sorted(one["ranks"]) == list(range(N))
    assert one["seconds"] > 0
    if r["backend"] == "floor":
        return
    assert r["standby_waiting"] is True
    two = r["round2"]
    assert two["formed"] is True and two["seconds_from_kill"] > 0
    # machine 0 died; 1..N-1 survived; N is the standby
    assert sorted(int(m) for m in two["ranks"]) == list(range(1, N + 1))
    assert sorted(two["ranks"].values()) == list(range(N))
    assert two["standby_rank"] is not None
    for phase in ("cas_round1", "cas_kill_to_round2"):
        counts = r[phase]
        assert counts["set_state"] >= 1 and 0 <= counts["cas_failed"] <= counts["set_state"]
    assert r["per_join_round1"]["set_state_per_machine"] >= 1
    steady = r["steady"]
    assert steady["seconds"] > 0 and steady["cas_failed"] >= 0
    assert steady["set_state_per_s_per_machine"] >= 0
    assert 0 < steady["max_value_bytes"] < 1 << 20


@pytest.mark.slow
@pytest.mark.etcd
def test_tiny_run_of_both_backends_writes_sane_json(tmp_path: Path) -> None:
    _etcd_or_skip()
    out = tmp_path / "scale.json"
    work = tmp_path / "work"
    done = subprocess.run(
        [
            sys.executable, str(BENCH), "--sizes", str(N), "--steady", "1",
            "--round-timeout", "60", "--keep-alive-interval", "1", "--out", str(out),
            "--work-dir", str(work),
        ],
        capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    by = {r["backend"]: r for r in doc["results"]}
    assert set(by) == {"flashckpt", "c10d", "floor"}
    for r in by.values():
        assert r["n"] == N
        _check_rounds(r)
    flash = by["flashckpt"]
    # the one write of torch's whole state, framed: grows with N, but not 1 MiB at N = 4
    assert flash["steady"]["etcd_db_bytes"] > 0
    assert flash["steady"]["etcd_received_bytes_per_s_per_machine"] >= 0
    keys = flash["job_keys"]
    assert keys["after_round1"] >= 1 and keys["after_round2"] >= keys["after_round1"]
    # Every machine left (each on its own, at once): what stays is the finished job's marker.
    assert flash["machines_not_left"] == 0
    assert flash["job_key_kinds_after_job_left"] == {"rdzv/closed": 1}
    assert keys["after_job_left"] == keys["after_leases_lapsed"] == 1
    # Stable ranks: a surviving machine keeps its round-1 rank; the standby takes the dead one's.
    assert flash["round2"]["standby_rank"] == flash["round1"]["ranks"][0]
    # Where the time went: CPU of etcd and of the machines, etcd's calls per machine by kind.
    for name, r in by.items():
        for phase in ("cost_round1",) if name == "floor" else ("cost_round1", "cost_steady"):
            cost = r[phase]
            assert cost["seconds"] > 0 and cost["machines_cpu_s"] >= 0
            if name != "c10d":
                assert cost["etcd_cpu_s"] >= 0
    calls = flash["cost_round1"]["etcd_calls_per_machine"]
    assert calls["Txn"] >= 1 and calls["LeaseGrant"] >= 1 and calls["Watch"] >= 1
    assert flash["cost_steady"]["etcd_calls_per_machine"]["LeaseKeepAlive"] > 0
    row = doc["summary"][0]
    assert row["n"] == N and row["trial"] == 0 and row["round1_flashckpt_over_c10d"] > 0
    spread = {r["backend"]: r for r in doc["spread"]}
    assert set(spread) == {"flashckpt", "c10d", "floor"}
    one = spread["flashckpt"]
    assert one["trials"] == 1 and one["round1_s"]["median"] == round(flash["round1"]["seconds"], 3)
    assert one["kill_to_round2_s"]["n"] == 1 and one["round1_over_floor"]["median"] > 0
    assert row["round1_flashckpt_over_floor"] > 0 and row["kill_flashckpt_over_c10d"] > 0
    # Nothing of the run is left: no host process, no etcd (all name the work dir).
    assert list(work.glob("*/events.jsonl")), "the run did not use --work-dir"
    leftover = [
        p
        for p in psutil.process_iter(["pid", "cmdline"])
        if str(work) in " ".join(p.info["cmdline"] or [])
    ]
    assert leftover == [], [p.info["cmdline"] for p in leftover]


def test_spread_over_trials_is_median_min_max_against_the_same_trials_floor() -> None:
    """The trials' statistics of ``_spread``: each ratio uses the floor of its own trial, a
    trial that formed no round counts as missing, not as zero."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rendezvous_scale", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def flash(t: int, r1: float | None, k2: float | None, told: float) -> dict[str, Any]:
        two = {"seconds_from_kill": k2, "phases": {"last_told_s": told}}
        one = {"seconds": r1}
        return {"backend": "flashckpt", "n": 8, "trial": t, "round1": one, "round2": two}

    results = [
        {"backend": "floor", "n": 8, "trial": t, "round1": {"seconds": fl}}
        for t, fl in enumerate((1.0, 2.0, 1.0))
    ] + [flash(0, 2.0, 3.0, 0.5), flash(1, 3.0, 2.0, 0.5), flash(2, None, None, 0.5)]
    rows = {r["backend"]: r for r in mod._spread(results)}
    f = rows["flashckpt"]
    assert f["trials"] == 3 and f["round1_s"] == {
        "median": 2.5, "min": 2.0, "max": 3.0, "n": 2, "missing": 1
    }  # fmt: skip
    assert f["round1_over_floor"]["median"] == 1.75  # 2.0/1.0 and 3.0/2.0
    assert f["kill_to_round2_after_known_s"]["max"] == 2.5
    assert f["slowest_round1_trial"] == 1
    assert rows["floor"]["round1_s"]["median"] == 1.0
