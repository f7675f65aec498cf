"""Tests for the training planner: worked examples done by hand, sharding, intervals, errors, CLI.

Expected values are written out as arithmetic here rather than taken from the code's output.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flashckpt.planning import (
    GIB,
    ClusterConfig,
    ModelConfig,
    ParallelConfig,
    PlanConfig,
    ReliabilityConfig,
    TrainConfig,
    activation_bytes_per_layer,
    choose_interval,
    expected_failures,
    flops_per_token,
    goodput,
    job_mtbf_s,
    lost_time_fraction,
    main,
    make_plan,
    memory_breakdown,
    min_dp_to_fit,
    model_state_bytes_per_param,
    training_days,
)

REPO = Path(__file__).resolve().parents[2]

# A Llama-2-7B-like shape: s = h = 4096, a = L = 32, so s*b*h = 2**24 and 5*a*s/h = 160.
SHAPE_7B = {"layers": 32, "hidden": 4096, "heads": 32}


def _config(
    *,
    params: float = 7e9,
    tokens: float = 2e12,
    gpus: int = 8,
    shape: dict[str, int] | None = None,
    seq_len: int | None = None,
    precision: str = "bf16",
    recompute: str = "none",
    gpu_mem_gib: float = 80.0,
    reliability: ReliabilityConfig | None = None,
    **parallel: int,
) -> PlanConfig:
    return PlanConfig(
        model=ModelConfig(params=params, **(shape or {})),
        train=TrainConfig(
            tokens=tokens,
            seq_len=seq_len,
            precision=precision,  # type: ignore[arg-type]
            recompute=recompute,  # type: ignore[arg-type]
        ),
        cluster=ClusterConfig(gpus=gpus, gpu_mem_gib=gpu_mem_gib),
        parallel=ParallelConfig(**parallel),
        reliability=reliability,
    )


def _by_name(config: PlanConfig) -> dict[str, float]:
    return {item.name: item.bytes_per_gpu for item in memory_breakdown(config)}


# ---------------------------------------------------------------------------------------------
# Training time.


def test_training_days_7b_2t_tokens_1024_h100() -> None:
    # C_token = 6 * 7e9 = 4.2e10 FLOP; total = 2e12 * 4.2e10 = 8.4e22 FLOP.
    # Throughput = 1024 * 989e12 * 0.4 = 4.050944e17 FLOP/s.
    # 8.4e22 / 4.050944e17 = 207,359 s; / 86,400 = 2.39999 days.
    assert flops_per_token(7e9) == 4.2e10
    days = training_days(tokens=2e12, params=7e9, gpus=1024, gpu_flops=989e12, mfu=0.4)
    assert days == pytest.approx(2.39999, rel=1e-5)
    plan = make_plan(_config(gpus=1024))
    assert plan.total_flops == pytest.approx(8.4e22)
    assert plan.cluster_flops == pytest.approx(4.050944e17)
    assert plan.training_days == pytest.approx(2.39999, rel=1e-5)


def test_training_days_full_recompute_uses_8w() -> None:
    # Megatron-LM: recomputation adds a forward, C_token = 8W; the time scales by 8/6:
    # 2.39999 * 8 / 6 = 3.19999 days. Selective recomputation stays at 6W.
    assert flops_per_token(7e9, recompute="full") == 5.6e10
    assert flops_per_token(7e9, recompute="selective") == 4.2e10
    days = training_days(
        tokens=2e12, params=7e9, gpus=1024, gpu_flops=989e12, mfu=0.4, recompute="full"
    )
    assert days == pytest.approx(3.19999, rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Memory: model states.


def test_mixed_precision_adam_is_16_bytes_per_param() -> None:
    # ZeRO paper: 2 (bf16 weights) + 2 (bf16 grads) + 4 + 4 + 4 (fp32 master, m, v) = 16.
    assert model_state_bytes_per_param("bf16") == {
        "weights": 2,
        "gradients": 2,
        "master_weights": 4,
        "adam_m": 4,
        "adam_v": 4,
    }
    # fp32 training has no separate master copy: 4 + 4 + 0 + 4 + 4 = 16 as well.
    fp32 = model_state_bytes_per_param("fp32")
    assert fp32["master_weights"] == 0
    assert sum(fp32.values()) == 16


def test_7b_unsharded_model_states() -> None:
    # 7e9 * 16 B = 112e9 B = 104.3 GiB on one GPU: does not fit 80 GiB.
    mem = _by_name(_config(gpus=1))
    assert mem["weights"] == 14e9
    assert mem["gradients"] == 14e9
    assert mem["master weights (fp32)"] == 28e9
    assert mem["Adam m (fp32)"] == 28e9
    assert mem["Adam v (fp32)"] == 28e9
    plan = make_plan(_config(gpus=1))
    assert plan.memory_total_bytes == 112e9
    assert plan.memory_total_bytes / GIB == pytest.approx(104.31, abs=0.01)
    assert not plan.fits


@pytest.mark.parametrize(
    ("zero", "expected"),
    [
        # dp = 8, per GPU in units of 1e9 B (7e9 params):
        (0, 14 + 14 + 28 + 28 + 28),  # nothing sharded: 112
        (1, 14 + 14 + (28 + 28 + 28) / 8),  # optimizer states / 8: 38.5
        (2, 14 + (14 + 28 + 28 + 28) / 8),  # + gradients / 8: 26.25
        (3, (14 + 14 + 28 + 28 + 28) / 8),  # + weights / 8: 14
    ],
)
def test_zero_stages_shard_over_dp(zero: int, expected: float) -> None:
    plan = make_plan(_config(gpus=8, zero=zero))
    assert plan.memory_total_bytes == pytest.approx(expected * 1e9)


def test_tp_pp_divide_states_and_zero_shards_over_dp_times_cp() -> None:
    # 64 GPUs = dp 2 * tp 4 * pp 2 * cp 4. Model states / (tp*pp) = / 8; ZeRO-3 also / (dp*cp).
    mem = _by_name(_config(gpus=64, tp=4, pp=2, cp=4, zero=3))
    assert mem["weights"] == pytest.approx(14e9 / 8 / 8)
    mem = _by_name(_config(gpus=64, tp=4, pp=2, cp=4, zero=0))
    assert mem["weights"] == pytest.approx(14e9 / 8)
    assert mem["Adam v (fp32)"] == pytest.approx(28e9 / 8)


def test_seed_175b_numbers() -> None:
    # The seed article: "175B model ... as high as 1400GB". 1400 GB = 175e9 * 8 B, which is
    # what the fp32 Adam moments alone take (m + v = 4 + 4 B), and equally fp32 weights plus
    # gradients. With everything Adam needs it is 16 B/param = 2800 GB in either precision;
    # the "12 times" of mixed precision is fp32 master + m + v = 12 B/param = 2100 GB.
    fp32 = _by_name(_config(params=175e9, gpus=1, precision="fp32"))
    assert fp32["Adam m (fp32)"] + fp32["Adam v (fp32)"] == pytest.approx(1400e9)
    assert fp32["weights"] + fp32["gradients"] == pytest.approx(1400e9)
    bf16 = _by_name(_config(params=175e9, gpus=1))
    optimizer = bf16["master weights (fp32)"] + bf16["Adam m (fp32)"] + bf16["Adam v (fp32)"]
    assert optimizer == pytest.approx(2100e9)
    plan = make_plan(_config(params=175e9, gpus=1))
    assert plan.model_state_bytes == pytest.approx(2800e9)
    # One node of 8 x 80 GiB = 687.2e9 B holds neither 1400 GB nor 2800 GB.
    assert 8 * 80 * GIB < 1400e9
    # Perfectly sharded: 2.8e12 / (80 * 2**30 = 85.90e9) = 32.6 -> 33 GPUs -> 5 nodes of 8.
    assert plan.min_gpus_lower_bound == 33
    assert plan.to_dict()["memory"]["min_nodes_lower_bound"] == 5


# ---------------------------------------------------------------------------------------------
# Memory: activations (Korthikanti et al. 2022).


def test_activations_per_layer_7b() -> None:
    # s*b*h = 4096 * 1 * 4096 = 2**24; 34 + 5*a*s/h = 34 + 5*32*4096/4096 = 194.
    per_layer = activation_bytes_per_layer(seq_len=4096, micro_batch=1, hidden=4096, heads=32)
    assert per_layer == 2**24 * 194 == 3_254_779_904
    # Selective recomputation drops the attention term: 34 * 2**24; full keeps 2 * 2**24.
    common: dict[str, Any] = {"seq_len": 4096, "micro_batch": 1, "hidden": 4096, "heads": 32}
    assert activation_bytes_per_layer(**common, recompute="selective") == 34 * 2**24
    assert activation_bytes_per_layer(**common, recompute="full") == 2 * 2**24
    # tp and cp both divide it; micro-batch multiplies it.
    assert activation_bytes_per_layer(**common, tp=8, cp=2) == 2**24 * 194 / 16
    doubled = activation_bytes_per_layer(seq_len=4096, micro_batch=2, hidden=4096, heads=32)
    assert doubled == 2 * per_layer


@pytest.mark.parametrize(
    ("recompute", "gib"),
    [
        # 32 layers * 2**24 * k bytes = k * 2**29 B = k / 2 GiB.
        ("none", 194 / 2),  # 97 GiB
        ("selective", 34 / 2),  # 17 GiB
        ("full", 2 / 2),  # 1 GiB
    ],
)
def test_activations_whole_model(recompute: str, gib: float) -> None:
    config = _config(gpus=1, shape=SHAPE_7B, seq_len=4096, recompute=recompute)
    assert _by_name(config)["activations"] == pytest.approx(gib * GIB)


def test_activations_tp_divides_and_pp_keeps_first_stage_total() -> None:
    # tp = 8: 97 / 8 = 12.125 GiB.
    config = _config(gpus=8, shape=SHAPE_7B, seq_len=4096, tp=8)
    assert _by_name(config)["activations"] == pytest.approx(97 / 8 * GIB)
    # pp = 4: 8 layers per stage, but under 1F1B the first stage holds 4 micro-batches:
    # 8 * 4 = 32 layers' worth, the same 97 GiB, while the weights drop by 4.
    config = _config(gpus=4, shape=SHAPE_7B, seq_len=4096, pp=4)
    mem = _by_name(config)
    assert mem["activations"] == pytest.approx(97 * GIB)
    assert mem["weights"] == pytest.approx(14e9 / 4)
    # pp = 3 does not divide 32 layers: ceil(32/3) = 11 layers * 3 in flight = 33 layers.
    config = _config(gpus=3, shape=SHAPE_7B, seq_len=4096, pp=3)
    assert _by_name(config)["activations"] == pytest.approx(97 * 33 / 32 * GIB)


def test_no_shape_means_no_activation_row() -> None:
    plan = make_plan(_config(gpus=8))
    assert [item.name for item in plan.memory][-1] == "Adam v (fp32)"
    assert plan.to_dict()["memory"]["activations_estimated"] is False
    assert "activations not estimated" in plan.to_table()


# ---------------------------------------------------------------------------------------------
# Smallest layout that fits.


def test_min_dp_to_fit_by_hand() -> None:
    budget = 80 * GIB  # 85.90e9 B
    # ZeRO-0: 112e9 B at any dp -> nothing fits.
    assert min_dp_to_fit(_config(zero=0)) is None
    # ZeRO-1: 28e9 fixed + 84e9 / dp <= 85.90e9 -> dp >= 84 / 57.90 = 1.45 -> 2.
    assert 28e9 + 84e9 / 2 <= budget < 28e9 + 84e9
    assert min_dp_to_fit(_config(zero=1)) == 2
    # ZeRO-3: 112e9 / dp -> dp >= 1.30 -> 2.
    assert min_dp_to_fit(_config(zero=3)) == 2
    # 16 GiB = 17.18e9 B. ZeRO-2: 14e9 + 98e9 / dp -> dp >= 98 / 3.18 = 30.8 -> 31.
    assert min_dp_to_fit(_config(zero=2, gpu_mem_gib=16)) == 31
    # ZeRO-1 at 16 GiB: the unsharded 28e9 B alone exceeds the budget.
    assert min_dp_to_fit(_config(zero=1, gpu_mem_gib=16)) is None
    plan = make_plan(_config(zero=2, gpu_mem_gib=16))
    assert plan.min_gpus_for_layout == 31
    assert plan.to_dict()["memory"]["min_nodes_for_layout"] == 4  # ceil(31 / 8)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("mem", [12.0, 24.0, 40.0])
def test_min_dp_matches_linear_search(zero: int, mem: float) -> None:
    config = _config(gpus=8, shape=SHAPE_7B, seq_len=4096, tp=2, recompute="full", zero=zero)
    config.cluster.gpu_mem_gib = mem
    budget = mem * GIB

    def total(dp: int) -> float:
        return sum(item.bytes_per_gpu for item in memory_breakdown(config, dp=dp))

    found = min_dp_to_fit(config)
    brute = next((dp for dp in range(1, 5000) if total(dp) <= budget), None)
    assert found == brute


# ---------------------------------------------------------------------------------------------
# Reliability.


def test_job_mtbf_and_failures_llama3() -> None:
    # Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs.
    rate = 419 / (54 * 16384)  # per GPU per day, 4.74e-4
    gpu_mtbf = 86400 / rate
    # Job MTBF = GPU MTBF / GPUs = 54 * 86400 / 419 = 11,135 s = 3.09 h.
    assert job_mtbf_s(gpu_mtbf, 16384) == pytest.approx(54 * 86400 / 419)
    assert job_mtbf_s(gpu_mtbf, 16384) / 3600 == pytest.approx(3.093, abs=1e-3)
    assert expected_failures(gpus=16384, run_s=54 * 86400, gpu_mtbf_s=gpu_mtbf) == pytest.approx(
        419
    )
    rel = ReliabilityConfig(failure_rate_per_gpu_day=rate)
    assert rel.gpu_mtbf_s == pytest.approx(gpu_mtbf)
    assert ReliabilityConfig(gpu_mtbf_hours=50_000).gpu_mtbf_s == 50_000 * 3600


def test_young_and_daly_by_hand() -> None:
    # delta = 10 s, M = 3 h = 10,800 s. Young: sqrt(2 * 10 * 10800) = sqrt(216000) = 464.76 s.
    assert choose_interval(10, 10800, method="young") == pytest.approx(464.758, abs=1e-3)
    # Daly: 464.76 * (1 + sqrt(10/21600)/3 + (10/21600)/9) - 10
    #     = 464.76 * (1 + 0.0071722 + 0.0000514) - 10 = 468.11 - 10 = 458.11 s.
    assert choose_interval(10, 10800, method="daly") == pytest.approx(458.11, abs=0.01)
    # Daly's rule for delta >= 2M is tau = M.
    assert choose_interval(100, 40, method="daly") == 40


def test_optimal_interval_minimises_lost_time() -> None:
    stall, mtbf, restart = 10.0, 10800.0, 600.0
    best = choose_interval(stall, mtbf)
    # Stationarity of M e^(R/M) (e^((tau+delta)/M) - 1) / tau:  u + delta/M + ln(1 - u) = 0.
    u = best / mtbf
    assert u + stall / mtbf + math.log(1 - u) == pytest.approx(0, abs=1e-12)

    def lost(tau: float) -> float:
        return lost_time_fraction(tau, stall_s=stall, mtbf_s=mtbf, restart_s=restart)

    # A fine grid from 0.2x to 5x the answer: the smallest value sits next to it.
    grid = [best * (0.2 + 4.8 * i / 20_000) for i in range(20_001)]
    arg = min(grid, key=lost)
    assert arg == pytest.approx(best, rel=5e-4)
    assert lost(best) <= min(lost(tau) for tau in grid) + 1e-15
    for factor in (0.5, 0.9, 0.99, 1.01, 1.1, 2.0):
        assert lost(best) < lost(best * factor)
    # Restart time scales the loss but does not move the optimum.
    no_restart = [lost_time_fraction(t, stall_s=stall, mtbf_s=mtbf) for t in grid]
    assert grid[no_restart.index(min(no_restart))] == pytest.approx(best, rel=5e-4)


def test_young_minimises_first_order_loss_and_all_rules_agree_for_small_stalls() -> None:
    stall, mtbf = 1.0, 2.0 * 86400
    young = choose_interval(stall, mtbf, method="young")

    def first_order(tau: float) -> float:  # Young 1974: delta/tau + tau/(2M)
        return stall / tau + tau / (2 * mtbf)

    grid = [young * (0.5 + i / 10_000) for i in range(10_001)]
    assert min(grid, key=first_order) == pytest.approx(young, rel=1e-4)
    # delta << M: Young, Daly and the exact optimum agree to well under 1%, and so does the loss.
    daly = choose_interval(stall, mtbf, method="daly")
    best = choose_interval(stall, mtbf, method="optimal")
    assert daly == pytest.approx(best, rel=1e-4)
    assert young == pytest.approx(best, rel=5e-3)
    lost_young = lost_time_fraction(young, stall_s=stall, mtbf_s=mtbf)
    lost_best = lost_time_fraction(best, stall_s=stall, mtbf_s=mtbf)
    assert lost_best <= lost_young == pytest.approx(lost_best, rel=1e-5)


def test_optimal_interval_is_accurate_for_tiny_stalls() -> None:
    # delta/M = 1e-12: tau ~ sqrt(2 delta M) - 2/3 delta; cancellation must not wreck it.
    mtbf = 1e12
    expected = math.sqrt(2 * 1.0 * mtbf) - 2 / 3
    assert choose_interval(1.0, mtbf) == pytest.approx(expected, rel=1e-12)
    assert choose_interval(1e-9, 1e9) == pytest.approx(math.sqrt(2) - 2e-9 / 3, rel=1e-12)


def test_goodput_by_hand() -> None:
    stall, mtbf, restart, tau = 10.0, 10800.0, 600.0, 458.0
    # Daly: M e^(R/M) (e^((tau+delta)/M) - 1) / tau
    #   e^(600/10800) = 1.05713, e^(468/10800) - 1 = 0.044286,
    #   10800 * 1.05713 * 0.044286 / 458 = 1.10397 -> goodput 1 / 1.10397 = 0.9058.
    assert goodput(tau, stall_s=stall, mtbf_s=mtbf, restart_s=restart) == pytest.approx(
        0.9058, abs=2e-4
    )
    # First order: (1 + delta/tau) (1 + (R + (tau + delta)/2) / M)
    #   = (1 + 0.021834) * (1 + 834/10800) = 1.021834 * 1.077222 = 1.10074.
    first_order = (1 + stall / tau) * (1 + (restart + (tau + stall) / 2) / mtbf)
    assert first_order == pytest.approx(1.10074, abs=1e-5)
    exact = 1 + lost_time_fraction(tau, stall_s=stall, mtbf_s=mtbf, restart_s=restart)
    assert exact == pytest.approx(first_order, rel=5e-3)
    # Failures that never happen cost nothing but the stalls.
    assert goodput(tau, stall_s=stall, mtbf_s=1e15) == pytest.approx(1 / (1 + stall / tau))


def test_plan_reliability_accounts_for_all_wall_time() -> None:
    rel = ReliabilityConfig(gpu_mtbf_hours=50_000, ckpt_stall_s=2.0, restart_s=600.0)
    plan = make_plan(_config(gpus=1024, tp=8, zero=1, reliability=rel))
    est = plan.reliability
    assert est is not None
    # Job MTBF = 50,000 h / 1024 = 48.83 h.
    assert est.job_mtbf_s == pytest.approx(50_000 * 3600 / 1024)
    assert est.interval_s == choose_interval(2.0, est.job_mtbf_s)
    assert est.compute_s == pytest.approx(plan.training_days * 86400)
    assert est.compute_s + est.stall_total_s + est.failure_loss_s == pytest.approx(est.wall_s)
    assert est.stall_total_s == pytest.approx(est.compute_s / est.interval_s * 2.0)
    assert est.expected_failures == pytest.approx(est.wall_s / est.job_mtbf_s)
    assert est.goodput == pytest.approx(est.compute_s / est.wall_s)
    assert 0.98 < est.goodput < 1.0
    young = make_plan(
        _config(
            gpus=1024,
            reliability=ReliabilityConfig(gpu_mtbf_hours=50_000, interval_method="young"),
        )
    )
    assert young.reliability is not None
    assert young.reliability.interval_s == young.reliability.intervals_s["young"]


# ---------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ModelConfig(params=-7e9), r"params=-7000000000\.0"),
        (lambda: ModelConfig(params=math.nan), "params=nan"),
        (lambda: ModelConfig(params=7e9, layers=32), "layers, hidden and heads go together"),
        (lambda: ModelConfig(params=7e9, layers=0, hidden=8, heads=2), "layers=0"),
        (lambda: ModelConfig(params=7e9, layers=2, hidden=100, heads=3), "hidden=100"),
        (lambda: TrainConfig(tokens=0), "tokens=0"),
        (lambda: TrainConfig(tokens=1e9, seq_len=-1), "seq_len=-1"),
        (lambda: TrainConfig(tokens=1e9, micro_batch=0), "micro_batch=0"),
        (lambda: TrainConfig(tokens=1e9, precision="fp8"), "precision='fp8'"),  # type: ignore[arg-type]
        (lambda: TrainConfig(tokens=1e9, recompute="some"), "recompute='some'"),  # type: ignore[arg-type]
        (lambda: ClusterConfig(gpus=0), "gpus=0"),
        (lambda: ClusterConfig(gpus=8, mfu=0.0), "mfu=0.0"),
        (lambda: ClusterConfig(gpus=8, mfu=40.0), r"mfu=40\.0 is above 1"),
        (lambda: ClusterConfig(gpus=8, gpu_flops=-1.0), "gpu_flops=-1.0"),
        (lambda: ClusterConfig(gpus=8, gpu_mem_gib=0.0), "gpu_mem_gib=0.0"),
        (lambda: ClusterConfig(gpus=8, gpus_per_node=0), "gpus_per_node=0"),
        (lambda: ParallelConfig(tp=0), "tp=0"),
        (lambda: ParallelConfig(dp=-2), "dp=-2"),
        (lambda: ParallelConfig(zero=4), "zero=4 is not a ZeRO stage"),
        (lambda: ParallelConfig(zero=-1), "zero=-1"),
        (lambda: ReliabilityConfig(), "give exactly one"),
        (
            lambda: ReliabilityConfig(failure_rate_per_gpu_day=1e-3, gpu_mtbf_hours=1e4),
            "give exactly one",
        ),
        (lambda: ReliabilityConfig(gpu_mtbf_hours=-5.0), "gpu_mtbf_hours=-5.0"),
        (lambda: ReliabilityConfig(failure_rate_per_gpu_day=0.0), "failure_rate_per_gpu_day=0.0"),
        (lambda: ReliabilityConfig(gpu_mtbf_hours=1e4, ckpt_stall_s=0.0), "ckpt_stall_s=0.0"),
        (lambda: ReliabilityConfig(gpu_mtbf_hours=1e4, restart_s=-1.0), "restart_s=-1.0"),
        (
            lambda: ReliabilityConfig(gpu_mtbf_hours=1e4, interval_method="often"),  # type: ignore[arg-type]
            "interval_method='often'",
        ),
        (lambda: _config(gpus=12, tp=8), r"tp\*pp\*cp = 8\*1\*1 = 8 does not divide gpus=12"),
        (lambda: _config(gpus=16, tp=2, dp=4), "set dp=8"),
        (lambda: _config(gpus=8, shape=SHAPE_7B), "got layers, hidden and heads but not seq_len"),
        (lambda: _config(gpus=8, seq_len=4096), "got seq_len but not layers"),
        (lambda: _config(gpus=24, shape=SHAPE_7B, seq_len=4096, tp=3), "tp=3 does not divide"),
        (
            lambda: _config(gpus=8, shape={"layers": 4, "hidden": 64, "heads": 4}, seq_len=8, pp=8),
            "pp=8 exceeds layers=4",
        ),
        (lambda: _config(gpus=8, shape=SHAPE_7B, seq_len=4095, cp=2), "cp=2 does not divide"),
        (lambda: choose_interval(0.0, 100.0), "stall_s=0.0"),
        (lambda: choose_interval(1.0, -100.0), "mtbf_s=-100.0"),
        (lambda: choose_interval(1.0, 100.0, method="best"), "method='best'"),  # type: ignore[arg-type]
        (lambda: lost_time_fraction(0.0, stall_s=1.0, mtbf_s=100.0), "interval_s=0.0"),
        (
            lambda: make_plan(
                _config(gpus=8, reliability=ReliabilityConfig(gpu_mtbf_hours=1.0, restart_s=1e7))
            ),
            "never finish",
        ),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(
    build: Callable[[], object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_wrong_types_raise_type_error() -> None:
    with pytest.raises(TypeError, match=r"gpus=8\.0 must be an int"):
        ClusterConfig(gpus=8.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="micro_batch=True"):
        TrainConfig(tokens=1e9, micro_batch=True)
    with pytest.raises(TypeError, match="params='7B'"):
        ModelConfig(params="7B")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# JSON and the command line.


def test_to_dict_is_json_and_matches_the_plan() -> None:
    rel = ReliabilityConfig(failure_rate_per_gpu_day=4.7e-4)
    plan = make_plan(_config(gpus=64, shape=SHAPE_7B, seq_len=4096, tp=8, zero=1, reliability=rel))
    data = json.loads(plan.to_json())
    assert set(data) == {"inputs", "compute", "memory", "reliability"}
    assert data["inputs"]["parallel"] == {"dp": 8, "tp": 8, "pp": 1, "cp": 1, "zero": 1}
    assert data["inputs"]["model"]["params"] == 7e9
    assert data["compute"]["total_flops"] == pytest.approx(8.4e22)
    names = [c["name"] for c in data["memory"]["components"]]
    assert names[0] == "weights"
    assert names[-1] == "activations"
    assert data["memory"]["total_bytes"] == pytest.approx(
        sum(c["bytes_per_gpu"] for c in data["memory"]["components"])
    )
    assert data["memory"]["fits"] is True
    assert data["reliability"]["goodput"] == pytest.approx(plan.reliability.goodput)  # type: ignore[union-attr]
    assert set(data["reliability"]["intervals_s"]) == {"optimal", "daly", "young"}


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--params", "7e9", "--tokens", "2T", "--gpus", "1024", "--gpu-flops", "989e12",
        "--mfu", "0.4", "--seq-len", "4096", "--hidden", "4096", "--layers", "32",
        "--heads", "32", "--tp", "8", "--zero", "1", "--gpu-mem-gib", "80",
        "--gpus-per-node", "8", "--failure-rate-per-gpu-day", "4.7e-4",
        "--ckpt-stall-s", "1", "--restart-s", "300",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2.40 days" in out
    assert "dp=128 tp=8" in out
    assert "Adam m (fp32)" in out
    assert "goodput" in out
    assert "fits in 80 GiB" in out


def test_cli_json_and_recompute_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--params", "7B", "--tokens", "2e12", "--gpus", "1K", "--recompute", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["train"]["recompute"] == "full"
    assert data["inputs"]["cluster"]["gpus"] == 1000
    assert data["compute"]["flops_per_token"] == 8 * 7e9
    assert data["reliability"] is None
    argv = ["--params", "7B", "--tokens", "2e12", "--gpus", "8", "--recompute", "selective"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["train"]["recompute"] == "selective"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--mfu", "1.5"], "mfu=1.5"),
        (["--zero", "5"], "zero=5"),
        (["--tp", "3"], "does not divide gpus=8"),
        (["--dp", "2"], "set dp=8"),
        (["--precision", "int4"], "precision='int4'"),
        (["--restart-s", "60"], "--restart-s only apply with a failure rate"),
        (["--layers", "32"], "layers, hidden and heads go together"),
        (["--gpus", "2.5"], "not a whole number"),
        (["--params", "seven"], "'seven' is not a number"),
        (["--gpu-mtbf-hours", "1", "--failure-rate-per-gpu-day", "1"], "not allowed with"),
    ],
)
def test_cli_bad_input_exits_2(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--params", "7e9", "--tokens", "2e12", "--gpus", "8", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "flashckpt plan: error:" in err
    assert message in err


def test_cli_missing_required_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "7e9"]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "--failure-rate-per-gpu-day" in capsys.readouterr().out


def test_planner_does_not_import_torch() -> None:
    code = "import sys, flashckpt.planning; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0
