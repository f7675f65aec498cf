"""Training planner: run time, memory per GPU and checkpoint interval for LLM pre-training.

Pure Python (stdlib only) so it runs before any cluster, or torch, is at hand. Three estimates:

* **Time.** ``days = tokens * C_token / (gpus * peak_flops * MFU * 86400)`` with
  ``C_token = 6 W`` (forward 2W + backward 4W; Kaplan et al. 2020, "Scaling Laws for Neural
  Language Models") or ``8 W`` with full activation recomputation, which repeats the forward
  (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM").
* **Memory per GPU.** Model states from Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
  Toward Training Trillion Parameter Models": mixed-precision Adam keeps 2 (bf16/fp16 weights) +
  2 (gradients) + 12 (fp32 master weights, Adam m and v) = 16 bytes per parameter; ZeRO stage 1
  shards the 12 optimizer bytes, stage 2 also the gradients, stage 3 also the weights. Activations
  from Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
  ``s*b*h*(34 + 5*a*s/h)`` bytes per layer, ``34*s*b*h`` with selective recomputation and
  ``2*s*b*h`` (the layer input only) with full recomputation.
* **Reliability.** Job MTBF = per-GPU MTBF / GPUs. Wall time per unit of useful work follows
  Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps":
  ``M * exp(R/M) * (exp((tau + delta)/M) - 1) / tau``; to first order that is
  ``(1 + delta/tau) * (1 + (R + (tau + delta)/2) / M)``, i.e. a stall per checkpoint and, per
  failure, a restart plus half a segment recomputed. The interval is Young's 1974
  ``sqrt(2 * delta * M)``, Daly's higher-order estimate, or the exact minimiser of that model.

Run ``flashckpt plan --help`` (or :func:`main`) for the command line.

This module is the planner's face; the parts live in :mod:`flashckpt.planning.config` (the checked
inputs), :mod:`flashckpt.planning.formulas` (the formulas above), :mod:`flashckpt.planning.report`
(the
:class:`Plan` and its table) and :mod:`flashckpt.planning.cli` (the command line).
"""

from __future__ import annotations

import sys

from flashckpt.planning.cli import build_parser, main
from flashckpt.planning.config import (
    GIB,
    ClusterConfig,
    IntervalMethod,
    ModelConfig,
    ParallelConfig,
    PlanConfig,
    Precision,
    Recompute,
    ReliabilityConfig,
    TrainConfig,
)
from flashckpt.planning.formulas import (
    MemoryItem,
    activation_bytes_per_layer,
    choose_interval,
    expected_failures,
    flops_per_token,
    goodput,
    job_mtbf_s,
    lost_time_fraction,
    memory_breakdown,
    min_dp_to_fit,
    model_state_bytes_per_param,
    training_days,
)
from flashckpt.planning.report import Plan, ReliabilityEstimate, make_plan

__all__ = [
    "GIB",
    "ClusterConfig",
    "IntervalMethod",
    "MemoryItem",
    "ModelConfig",
    "ParallelConfig",
    "Plan",
    "PlanConfig",
    "Precision",
    "Recompute",
    "ReliabilityConfig",
    "ReliabilityEstimate",
    "TrainConfig",
    "activation_bytes_per_layer",
    "build_parser",
    "choose_interval",
    "expected_failures",
    "flops_per_token",
    "goodput",
    "job_mtbf_s",
    "lost_time_fraction",
    "main",
    "make_plan",
    "memory_breakdown",
    "min_dp_to_fit",
    "model_state_bytes_per_param",
    "training_days",
]


if __name__ == "__main__":
    sys.exit(main())
