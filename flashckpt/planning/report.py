"""The training planner's answer: :func:`make_plan` and the :class:`Plan` it returns, as a table
or JSON. Pure Python (stdlib only).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, get_args

from flashckpt.planning.config import (
    GIB,
    SECONDS_PER_DAY,
    SECONDS_PER_HOUR,
    IntervalMethod,
    PlanConfig,
    ReliabilityConfig,
)
from flashckpt.planning.formulas import (
    MemoryItem,
    choose_interval,
    expected_failures,
    flops_per_token,
    job_mtbf_s,
    memory_breakdown,
    min_dp_to_fit,
    model_state_bytes_per_param,
    training_days,
    wall_per_useful,
)

__all__ = ["Plan", "ReliabilityEstimate", "make_plan"]


# --------------------------------------------------------------------------------------------
# The plan.


@dataclass(kw_only=True, slots=True, frozen=True)
class ReliabilityEstimate:
    """Failures, checkpoint interval and goodput for the run."""

    gpu_mtbf_s: float
    """Per-GPU MTBF in seconds."""

    job_mtbf_s: float
    """Job MTBF in seconds: per-GPU MTBF / GPUs."""

    intervals_s: dict[str, float]
    """Checkpoint interval by method (``young``, ``daly``, ``optimal``)."""

    interval_method: str
    """The method used for the numbers below."""

    interval_s: float
    """Chosen interval: useful seconds between checkpoints."""

    compute_s: float
    """Useful training time (the failure-free training time)."""

    wall_s: float
    """Expected wall time including checkpoint stalls and failures."""

    checkpoints: float
    """Checkpoints taken: compute / interval."""

    stall_total_s: float
    """Time blocked in checkpoints: checkpoints * stall."""

    failure_loss_s: float
    """Time lost to failures (restarts and recomputation): wall - compute - stalls."""

    expected_failures: float
    """Expected failures over the wall time: wall / job MTBF."""

    goodput: float
    """Useful time / wall time."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus hours and days."""
        out = asdict(self)
        out["job_mtbf_hours"] = self.job_mtbf_s / SECONDS_PER_HOUR
        out["wall_days"] = self.wall_s / SECONDS_PER_DAY
        out["lost_s"] = self.wall_s - self.compute_s
        return out


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    """The planner's answer for one :class:`PlanConfig`."""

    config: PlanConfig
    """The inputs."""

    dp: int
    """Data-parallel size used."""

    flops_per_token: float
    """C_token: 6W, or 8W with full recomputation."""

    total_flops: float
    """tokens * C_token."""

    cluster_flops: float
    """Achieved FLOP/s of the job: gpus * gpu_flops * mfu."""

    training_days: float
    """Failure-free training time in days."""

    memory: tuple[MemoryItem, ...]
    """Per-GPU memory by component."""

    memory_total_bytes: float
    """Sum of ``memory``."""

    fits: bool
    """Whether the total fits ``gpu_mem_gib``."""

    model_state_bytes: float
    """Unsharded model states of the whole model: W * bytes per parameter."""

    min_gpus_lower_bound: int
    """GPUs needed just to hold the model states, perfectly sharded, with nothing else."""

    min_dp_for_layout: int | None
    """Smallest dp that fits with this tp, pp, cp and ZeRO stage; ``None`` if none does."""

    reliability: ReliabilityEstimate | None
    """Failure estimate, when a failure rate was given."""

    @property
    def min_gpus_for_layout(self) -> int | None:
        """GPUs for :attr:`min_dp_for_layout`: dp * tp * pp * cp."""
        if self.min_dp_for_layout is None:
            return None
        return self.min_dp_for_layout * self.config.parallel.model_parallel

    def _nodes(self, gpus: int | None) -> int | None:
        return None if gpus is None else math.ceil(gpus / self.config.cluster.gpus_per_node)

    def _gpus_text(self, gpus: int) -> str:
        nodes = math.ceil(gpus / self.config.cluster.gpus_per_node)
        plural = "" if nodes == 1 else "s"
        return f"{gpus} GPUs = {nodes} node{plural} of {self.config.cluster.gpus_per_node}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready nested dict of inputs and results (bytes, seconds, FLOPs; plus GiB/days)."""
        inputs = asdict(self.config)
        inputs["parallel"]["dp"] = self.dp
        budget = self.config.cluster.gpu_mem_gib * GIB
        return {
            "inputs": inputs,
            "compute": {
                "flops_per_token": self.flops_per_token,
                "total_flops": self.total_flops,
                "cluster_flops": self.cluster_flops,
                "training_days": self.training_days,
                "training_hours": self.training_days * 24.0,
            },
            "memory": {
                "components": [item.to_dict() for item in self.memory],
                "activations_estimated": any(i.name == "activations" for i in self.memory),
                "total_bytes": self.memory_total_bytes,
                "total_gib": self.memory_total_bytes / GIB,
                "budget_bytes": budget,
                "fits": self.fits,
                "model_state_bytes": self.model_state_bytes,
                "min_gpus_lower_bound": self.min_gpus_lower_bound,
                "min_nodes_lower_bound": self._nodes(self.min_gpus_lower_bound),
                "min_dp_for_layout": self.min_dp_for_layout,
                "min_gpus_for_layout": self.min_gpus_for_layout,
                "min_nodes_for_layout": self._nodes(self.min_gpus_for_layout),
            },
            "reliability": None if self.reliability is None else self.reliability.to_dict(),
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    def to_table(self) -> str:
        """A readable text report."""
        lines = self._time_lines()
        lines += ["", *self._memory_lines()]
        if self.reliability is not None:
            lines += ["", *self._reliability_lines()]
        return "\n".join(lines)

    def _time_lines(self) -> list[str]:
        cfg = self.config
        train, cluster = cfg.train, cfg.cluster
        lines = ["Training time"]
        c_mult = 8 if train.recompute == "full" else 6
        lines += _table(
            [
                ["C_token", f"{c_mult} x W", f"{self.flops_per_token:.3e} FLOP/token"],
                ["total compute", "tokens x C_token", f"{self.total_flops:.3e} FLOP"],
                [
                    "job throughput",
                    "gpus x peak x MFU",
                    f"{cluster.gpus} x {cluster.gpu_flops / 1e12:g} TFLOP/s x {cluster.mfu:g}"
                    f" = {self.cluster_flops / 1e15:.1f} PFLOP/s",
                ],
                [
                    "training time",
                    "total / throughput",
                    f"{self.training_days:.2f} days ({self.training_days * 24:.1f} h)",
                ],
            ]
        )
        return lines

    def _memory_lines(self) -> list[str]:
        cfg = self.config
        par, train, cluster = cfg.parallel, cfg.train, cfg.cluster
        lines = [
            f"Memory per GPU (dp={self.dp} tp={par.tp} pp={par.pp} cp={par.cp}, "
            f"ZeRO-{par.zero}, {train.precision}, recompute={train.recompute})"
        ]
        rows = [["component", "B/param", "GiB/GPU", "sharded over", "formula"]]
        for item in self.memory:
            rows.append(
                [
                    item.name,
                    "-" if item.bytes_per_param is None else str(item.bytes_per_param),
                    f"{item.bytes_per_gpu / GIB:.2f}",
                    item.sharded_over,
                    item.formula,
                ]
            )
        verdict = "fits" if self.fits else "does NOT fit"
        rows.append(
            [
                "total",
                "",
                f"{self.memory_total_bytes / GIB:.2f}",
                "",
                f"{verdict} in {cluster.gpu_mem_gib:g} GiB",
            ]
        )
        lines += _table(rows, header=True)
        if not any(item.name == "activations" for item in self.memory):
            lines.append("  activations not estimated: pass seq_len, layers, hidden and heads")
        lines.append(
            f"  model states {self.model_state_bytes / 1e9:,.0f} GB in all: at least "
            f"{self._gpus_text(self.min_gpus_lower_bound)} to hold them"
        )
        if self.min_gpus_for_layout is None:
            lines.append(
                f"  with tp={par.tp} pp={par.pp} cp={par.cp} ZeRO-{par.zero}: no dp fits; raise "
                "the ZeRO stage, tp or pp, or recompute activations"
            )
        else:
            lines.append(
                f"  with tp={par.tp} pp={par.pp} cp={par.cp} ZeRO-{par.zero}: smallest fitting "
                f"dp={self.min_dp_for_layout}, {self._gpus_text(self.min_gpus_for_layout)}"
            )
        return lines

    def _reliability_lines(self) -> list[str]:
        cfg, cluster, rel = self.config, self.config.cluster, self.reliability
        assert rel is not None and cfg.reliability is not None
        lines = ["Reliability"]
        iv = rel.intervals_s
        lines += _table(
            [
                ["GPU MTBF", f"{rel.gpu_mtbf_s / SECONDS_PER_HOUR:,.0f} h"],
                [
                    "job MTBF",
                    f"{rel.job_mtbf_s / SECONDS_PER_HOUR:.2f} h (GPU MTBF / {cluster.gpus})",
                ],
                [
                    "ckpt interval",
                    f"{rel.interval_s:.0f} s ({rel.interval_method}; young {iv['young']:.0f}"
                    f" s, daly {iv['daly']:.0f} s, optimal {iv['optimal']:.0f} s)",
                ],
                [
                    "checkpoints",
                    f"{rel.checkpoints:,.0f} x {cfg.reliability.ckpt_stall_s:g} s stall"
                    f" = {rel.stall_total_s / SECONDS_PER_HOUR:.2f} h",
                ],
                [
                    "failures",
                    f"{rel.expected_failures:.1f} expected x ({cfg.reliability.restart_s:g}"
                    f" s restart + recompute) = "
                    f"{rel.failure_loss_s / SECONDS_PER_HOUR:.2f} h",
                ],
                [
                    "wall time",
                    f"{rel.wall_s / SECONDS_PER_DAY:.2f} days "
                    f"(compute {rel.compute_s / SECONDS_PER_DAY:.2f} days)",
                ],
                ["goodput", f"{rel.goodput:.2%} (useful / wall)"],
            ]
        )
        return lines

    def __str__(self) -> str:
        return self.to_table()


def _table(rows: list[list[str]], *, header: bool = False) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if header:
        out.insert(1, "  " + "  ".join("-" * w for w in widths))
    return out


def _reliability(
    config: PlanConfig, rel: ReliabilityConfig, compute_s: float
) -> ReliabilityEstimate:
    gpus = config.cluster.gpus
    gpu_mtbf = rel.gpu_mtbf_s
    mtbf = job_mtbf_s(gpu_mtbf, gpus)
    intervals = {
        method: choose_interval(rel.ckpt_stall_s, mtbf, method=method)
        for method in get_args(IntervalMethod)
    }
    interval = intervals[rel.interval_method]
    ratio = wall_per_useful(interval, rel.ckpt_stall_s, mtbf, rel.restart_s)
    if not math.isfinite(ratio):
        raise ValueError(
            f"job MTBF {mtbf:.3g} s is far shorter than restart_s={rel.restart_s!r} and "
            f"ckpt_stall_s={rel.ckpt_stall_s!r}: the run would practically never finish; use "
            "fewer GPUs, a lower failure rate or faster restarts"
        )
    wall = compute_s * ratio
    checkpoints = compute_s / interval
    stalls = checkpoints * rel.ckpt_stall_s
    return ReliabilityEstimate(
        gpu_mtbf_s=gpu_mtbf,
        job_mtbf_s=mtbf,
        intervals_s=intervals,
        interval_method=rel.interval_method,
        interval_s=interval,
        compute_s=compute_s,
        wall_s=wall,
        checkpoints=checkpoints,
        stall_total_s=stalls,
        failure_loss_s=wall - compute_s - stalls,
        expected_failures=expected_failures(gpus=gpus, run_s=wall, gpu_mtbf_s=gpu_mtbf),
        goodput=1.0 / ratio,
    )


def make_plan(config: PlanConfig) -> Plan:
    """Estimate time, memory and reliability for a configuration.

    Args:
        config: The plan inputs (already checked by their ``__post_init__``).

    Returns:
        The :class:`Plan`; print it or call :meth:`Plan.to_dict`.
    """
    model, train, cluster = config.model, config.train, config.cluster
    days = training_days(
        tokens=train.tokens,
        params=model.params,
        gpus=cluster.gpus,
        gpu_flops=cluster.gpu_flops,
        mfu=cluster.mfu,
        recompute=train.recompute,
    )
    memory = tuple(memory_breakdown(config))
    total = sum(item.bytes_per_gpu for item in memory)
    budget = cluster.gpu_mem_gib * GIB
    state_bytes = model.params * sum(model_state_bytes_per_param(train.precision).values())
    reliability = None
    if config.reliability is not None:
        reliability = _reliability(config, config.reliability, days * SECONDS_PER_DAY)
    c_token = flops_per_token(model.params, recompute=train.recompute)
    return Plan(
        config=config,
        dp=config.dp,
        flops_per_token=c_token,
        total_flops=train.tokens * c_token,
        cluster_flops=cluster.gpus * cluster.gpu_flops * cluster.mfu,
        training_days=days,
        memory=memory,
        memory_total_bytes=total,
        fits=total <= budget,
        model_state_bytes=state_bytes,
        min_gpus_lower_bound=math.ceil(state_bytes / budget),
        min_dp_for_layout=min_dp_to_fit(config),
        reliability=reliability,
    )
