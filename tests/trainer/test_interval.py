"""every="auto": the interval arithmetic on hand-computed examples, and one real training loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fchelpers import FcEnv, RunningAgent
from rankprocs import run_worker
from tinytrain import make, train_step

import flashckpt
from flashckpt.planning import choose_interval
from flashckpt.trainer.checkpointer import CheckpointConfig
from flashckpt.trainer.interval import (
    JOB_START_ENV,
    RESTARTS_ENV,
    AutoInterval,
    estimate_mtbf_s,
    interval_steps,
)

HERE = Path(__file__).resolve().parents[1] / "support"


def test_mtbf_estimate_counts_the_prior_as_one_failure_free_mtbf() -> None:
    # No failure yet: the prior plus the time observed.
    assert estimate_mtbf_s(1e6, 0.0, 0) == 1e6
    assert estimate_mtbf_s(1e6, 600.0, 0) == 1_000_600.0
    # Two restarts in 10 minutes: (1e6 + 600) / 3.
    assert estimate_mtbf_s(1e6, 600.0, 2) == pytest.approx(333_533.333, abs=1e-3)
    # A long run with a steady rate: 100 failures in 100 days -> about one a day.
    assert estimate_mtbf_s(86_400.0, 100 * 86_400.0, 100) == pytest.approx(86_400.0)
    with pytest.raises(ValueError, match="prior MTBF"):
        estimate_mtbf_s(0.0, 1.0, 0)
    with pytest.raises(ValueError, match="must be >= 0"):
        estimate_mtbf_s(1.0, -1.0, 0)


def test_interval_in_steps_from_stall_step_time_and_mtbf() -> None:
    # stall 1 s, MTBF 20,000 s: Young sqrt(2 * 1 * 20000) = 200 s; Daly's correction
    # 200 * (1 + sqrt(1/40000)/3 + 1/(9*40000)) - 1 = 200 * 1.0016694 - 1 = 199.334 s.
    steps, tau = interval_steps(1.0, 0.5, 20_000.0)
    assert tau == pytest.approx(199.334, abs=1e-3)
    assert steps == 399  # 199.334 / 0.5 = 398.67
    # Clamped to at least one step, and to max_steps.
    assert interval_steps(1.0, 1e6, 20_000.0)[0] == 1
    assert interval_steps(1.0, 1e-6, 20_000.0, max_steps=1000)[0] == 1000
    with pytest.raises(ValueError, match="step time"):
        interval_steps(1.0, 0.0, 20_000.0)


def test_auto_interval_uses_the_prior_the_restarts_and_the_medians(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wall = [1_000_000.0]
    mono = [0.0]
    monkeypatch.setenv(JOB_START_ENV, str(wall[0] - 3600.0))  # the launcher started 1 h ago
    monkeypatch.setenv(RESTARTS_ENV, "3")
    auto = AutoInterval(
        world=8, start_step=100, first_steps=10, clock=lambda: mono[0], now=lambda: wall[0]
    )
    # Prior: 50,000 GPU-hours per failure over 8 GPUs = 6,250 h = 22,500,000 s.
    assert auto.prior_s == 22_500_000.0
    assert auto.status()["interval_steps"] is None
    # The first snapshot is labelled start_step + first_steps = 110: due once 110 steps are done.
    assert next(s for s in range(100, 130) if auto.due(s)) == 110
    for _ in range(11):  # iterations of 0.1 s, one of 5 s (a snapshot) the median ignores
        auto.tick()
        mono[0] += 0.1
    mono[0] += 5.0
    auto.tick()
    seen: list[int] = []
    steps = auto.decide(
        110, stalls=[0.04, 0.03, 0.9], waits=[0.01], agree=lambda n: seen.append(n) or n
    )
    # stall = median(0.04, 0.03, 0.9) + median(0.01) = 0.05 s; step = 0.1 s;
    # M = (22,500,000 + 3,600) / (1 + 3) = 5,625,900 s;
    # Young sqrt(2 * 0.05 * 5625900) = 750.06 s, Daly 750.06 * (1 + 2.2e-5) - 0.05 = 750.03 s;
    # 750.03 / 0.1 = 7500.3 -> 7500 steps.
    assert auto.mtbf_s == 5_625_900.0
    assert auto.stall_s == pytest.approx(0.05)
    assert auto.step_s == pytest.approx(0.1)
    assert steps == 7500 and seen == [7500]
    assert auto.next_due == 110 + 7500
    st = auto.status()
    assert st["interval_steps"] == 7500 and st["failures"] == 3
    assert st["interval_s"] == pytest.approx(750.027, abs=1e-3)


def test_ranks_agree_on_the_smallest_interval() -> None:
    auto = AutoInterval(world=2, mtbf_s=20_000.0, first_steps=1, clock=iter(range(100)).__next__)
    for _ in range(5):
        auto.tick()  # 1 s per step
    # This rank alone would pick 199 steps (199.33 s at 1 s); another rank proposed 50.
    assert auto.decide(1, stalls=[1.0], waits=[], agree=lambda n: min(n, 50)) == 50
    assert auto.next_due == 51


def test_bad_every_values_are_refused() -> None:
    with pytest.raises(ValueError, match=r"'sometimes'.*'auto'"):
        CheckpointConfig(every="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every=-1"):
        CheckpointConfig(every=-1)
    with pytest.raises(ValueError, match="mtbf_s=0"):
        CheckpointConfig(every="auto", mtbf_s=0)
    with pytest.raises(ValueError, match="mtbf_s"):
        AutoInterval(world=1, mtbf_s=-5.0)


def test_auto_interval_in_a_real_loop(fc_env: FcEnv, agent: RunningAgent) -> None:
    # A job MTBF prior of 0.5 s makes the optimum a few dozen tiny steps, so one short loop
    # sees several decisions. Nothing here depends on how fast the machine is: each decision
    # is checked against the inputs it reports.
    model, opt, sched = make(0)
    labels: list[int] = []
    decisions: list[dict[str, object]] = []
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every="auto", mtbf_s=0.5, **fc_env.ckpt_kwargs()
    ) as ck:
        assert ck.status()["every"] == {"mode": "auto", "interval_steps": None}
        step = 0
        while len(labels) < 3 and step < 5000:  # snapshots come tens to hundreds of steps apart
            train_step(model, opt, sched, step)
            handle = ck.step()
            if handle is not None:
                labels.append(handle.step)
                decisions.append(ck.status()["every"])
            step += 1
    assert labels[0] == 10  # first_steps after start_step 0
    assert len(labels) >= 3
    for i, d in enumerate(decisions):
        assert d["mode"] == "auto" and d["decisions"] == i + 1
        stall, step_s, mtbf = d["stall_s"], d["step_s"], d["mtbf_s"]
        assert isinstance(stall, float) and isinstance(step_s, float) and isinstance(mtbf, float)
        assert stall > 0 and step_s > 0 and mtbf >= 0.5  # the prior plus the time elapsed
        tau = choose_interval(stall, mtbf)
        assert d["interval_s"] == pytest.approx(tau)
        assert d["interval_steps"] == max(1, round(tau / step_s))
        assert d["next_snapshot_step"] == labels[i] + d["interval_steps"]
        if i + 1 < len(labels):  # the next snapshot came exactly where it was planned
            assert labels[i + 1] == d["next_snapshot_step"]
    assert not math.isnan(float(decisions[-1]["interval_s"]))  # type: ignore[arg-type]


def test_two_ranks_snapshot_at_the_same_steps(tmp_path: Path, fc_env: FcEnv) -> None:
    # Rank 1 is slower, so the ranks measure different step times and propose different
    # intervals: they must take the smaller and snapshot together.
    init, out = tmp_path / "init", tmp_path / "auto"
    run_worker(
        HERE / "_auto_every_worker.py",
        tmp_path,
        "auto",
        lambda rank: [
            *("--rank", str(rank), "--storage", fc_env.storage, "--job", fc_env.job),
            *("--run-dir", fc_env.run_dir, "--init-file", str(init), "--out", str(out)),
        ],
        timeout=240,
    )
    r0, r1 = (json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2))
    assert r0["labels"] == r1["labels"] and r0["labels"][0] == 10 and len(r0["labels"]) == 4
    for i, (d0, d1) in enumerate(zip(r0["decisions"], r1["decisions"], strict=True)):
        assert d0["interval_steps"] == d1["interval_steps"]
        assert d0["interval_steps"] == min(d0["proposed_steps"], d1["proposed_steps"])
        assert d0["proposed_steps"] == max(1, round(d0["interval_s"] / d0["step_s"]))
        if i + 1 < len(r0["labels"]):
            assert r0["labels"][i + 1] == r0["labels"][i] + d0["interval_steps"]
