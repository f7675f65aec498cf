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
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

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

GIB = 1024**3
SECONDS_PER_DAY = 86_400.0
SECONDS_PER_HOUR = 3_600.0

Precision = Literal["bf16", "fp16", "fp32"]
Recompute = Literal["none", "selective", "full"]
IntervalMethod = Literal["optimal", "daly", "young"]

_PARAM_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
# Optimizer states stay fp32 whatever the training precision (ZeRO paper, Sec. 3.1).
_FP32_BYTES = 4


# --------------------------------------------------------------------------------------------
# Input checks shared by the configs.


def _check_number(name: str, value: object, hint: str, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}={value!r} must be a number; {hint}")
    low_ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and low_ok):
        need = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{name}={value!r} must be {need}; {hint}")


def _check_int(name: str, value: object, hint: str, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int; {hint}")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}; {hint}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(choices)}")


# --------------------------------------------------------------------------------------------
# Configs.


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Size and shape of a dense decoder-only transformer."""

    params: float
    """Total parameter count W, e.g. ``7e9``."""

    layers: int | None = None
    """Transformer layers L. With ``hidden`` and ``heads`` it enables the activation estimate."""

    hidden: int | None = None
    """Hidden size h."""

    heads: int | None = None
    """Attention heads a; must divide ``hidden``."""

    def __post_init__(self) -> None:
        _check_number("params", self.params, "pass the total parameter count, e.g. 7e9")
        shape = {"layers": self.layers, "hidden": self.hidden, "heads": self.heads}
        given = [name for name, value in shape.items() if value is not None]
        if given and len(given) != len(shape):
            missing = [name for name in shape if name not in given]
            raise ValueError(
                f"layers, hidden and heads go together: got {', '.join(given)} but not "
                f"{', '.join(missing)}; pass all three or none"
            )
        for name, value in shape.items():
            if value is not None:
                _check_int(name, value, "pass the model's shape, e.g. layers=32 hidden=4096")
        if self.hidden is not None and self.heads is not None and self.hidden % self.heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by heads={self.heads}; "
                "use a head count that divides the hidden size"
            )

    @property
    def has_shape(self) -> bool:
        """Whether layers, hidden and heads are all known."""
        return self.layers is not None


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """What is trained: token budget, sequence shape and numerics."""

    tokens: float
    """Training tokens, e.g. ``2e12``."""

    seq_len: int | None = None
    """Sequence length s; with the model shape it enables the activation estimate."""

    micro_batch: int = 1
    """Sequences per micro-batch b on one data-parallel rank."""

    precision: Precision = "bf16"
    """Weight and gradient dtype. ``bf16``/``fp16`` add fp32 master weights; ``fp32`` does not."""

    recompute: Recompute = "none"
    """Activation recomputation: ``none``, ``selective`` (attention core only) or ``full``.

    ``full`` costs an extra forward, so C_token becomes 8W and ``mfu`` is then really the hardware
    FLOPs utilisation (it counts the recomputed FLOPs).
    """

    def __post_init__(self) -> None:
        _check_number("tokens", self.tokens, "pass the training token count, e.g. 2e12")
        if self.seq_len is not None:
            _check_int("seq_len", self.seq_len, "pass the training sequence length, e.g. 4096")
        _check_int("micro_batch", self.micro_batch, "pass sequences per micro-batch, e.g. 1")
        _check_choice("precision", self.precision, get_args(Precision))
        _check_choice("recompute", self.recompute, get_args(Recompute))


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """The GPUs the job runs on."""

    gpus: int
    """Number of GPUs in the job."""

    gpu_flops: float = 989e12
    """Peak dense FLOP/s of one GPU in the training dtype (989e12: H100 SXM, dense BF16)."""

    mfu: float = 0.4
    """Model FLOPs utilisation in (0, 1]: achieved / peak FLOP/s."""

    gpu_mem_gib: float = 80.0
    """Memory of one GPU in GiB, the budget the per-GPU estimate is checked against."""

    gpus_per_node: int = 8
    """GPUs per node G, to express GPU counts in nodes."""

    def __post_init__(self) -> None:
        _check_int("gpus", self.gpus, "pass the number of GPUs in the job, e.g. 1024")
        _check_number("gpu_flops", self.gpu_flops, "pass peak FLOP/s per GPU, e.g. 989e12")
        _check_number("mfu", self.mfu, "pass a utilisation in (0, 1], e.g. 0.4")
        if self.mfu > 1:
            raise ValueError(
                f"mfu={self.mfu!r} is above 1; MFU is a fraction of peak, e.g. 0.4 (not 40)"
            )
        _check_number("gpu_mem_gib", self.gpu_mem_gib, "pass GPU memory in GiB, e.g. 80")
        _check_int("gpus_per_node", self.gpus_per_node, "pass GPUs per node, e.g. 8")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Parallel layout: dp * tp * pp * cp GPUs, and the ZeRO stage."""

    dp: int | None = None
    """Data-parallel size; ``None`` infers ``gpus / (tp * pp * cp)``."""

    tp: int = 1
    """Tensor-parallel size (with sequence parallelism, so activations shard by tp too)."""

    pp: int = 1
    """Pipeline-parallel size; stages hold ``ceil(layers / pp)`` layers each."""

    cp: int = 1
    """Context-parallel size; splits each sequence, so activations shard by cp."""

    zero: int = 0
    """ZeRO stage 0-3 over the dp * cp replicas: 1 shards optimizer states, 2 also gradients, 3
    also weights."""

    def __post_init__(self) -> None:
        if self.dp is not None:
            _check_int("dp", self.dp, "pass the data-parallel size, or leave it unset to infer")
        for name in ("tp", "pp", "cp"):
            _check_int(name, getattr(self, name), f"pass a {name} size >= 1 (1 = not used)")
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or not 0 <= self.zero <= 3:
            raise ValueError(f"zero={self.zero!r} is not a ZeRO stage; use 0, 1, 2 or 3")

    @property
    def model_parallel(self) -> int:
        """GPUs in one model replica: tp * pp * cp."""
        return self.tp * self.pp * self.cp


@dataclass(kw_only=True, slots=True)
class ReliabilityConfig:
    """Failure rate and checkpoint costs. Give exactly one of the two failure rates."""

    failure_rate_per_gpu_day: float | None = None
    """Failures per GPU per day that stop the job. Llama 3 405B saw 419 unexpected interruptions
    in 54 days on 16,384 GPUs: 419 / (54 * 16384) = 4.7e-4."""

    gpu_mtbf_hours: float | None = None
    """Mean time between job-stopping failures of one GPU, in hours (= 24 / rate per day)."""

    ckpt_stall_s: float = 1.0
    """Seconds training blocks per checkpoint (for a flash checkpoint, the copy to host memory)."""

    restart_s: float = 300.0
    """Seconds from a failure until training runs again: detect, reschedule, load, warm up."""

    interval_method: IntervalMethod = "optimal"
    """Interval rule: ``optimal`` (exact minimiser of the wall-time model), ``daly`` or
    ``young``."""

    def __post_init__(self) -> None:
        if (self.failure_rate_per_gpu_day is None) == (self.gpu_mtbf_hours is None):
            raise ValueError(
                f"failure_rate_per_gpu_day={self.failure_rate_per_gpu_day!r}, "
                f"gpu_mtbf_hours={self.gpu_mtbf_hours!r}: give exactly one of them"
            )
        if self.failure_rate_per_gpu_day is not None:
            _check_number(
                "failure_rate_per_gpu_day",
                self.failure_rate_per_gpu_day,
                "pass failures per GPU per day, e.g. 4.7e-4",
            )
        if self.gpu_mtbf_hours is not None:
            _check_number(
                "gpu_mtbf_hours", self.gpu_mtbf_hours, "pass hours per GPU failure, e.g. 5e4"
            )
        _check_number("ckpt_stall_s", self.ckpt_stall_s, "pass seconds blocked per checkpoint")
        _check_number(
            "restart_s", self.restart_s, "pass seconds to resume after a failure", allow_zero=True
        )
        _check_choice("interval_method", self.interval_method, get_args(IntervalMethod))

    @property
    def gpu_mtbf_s(self) -> float:
        """Per-GPU MTBF in seconds."""
        if self.gpu_mtbf_hours is not None:
            return self.gpu_mtbf_hours * SECONDS_PER_HOUR
        assert self.failure_rate_per_gpu_day is not None  # one of them is set: __post_init__
        return SECONDS_PER_DAY / self.failure_rate_per_gpu_day


@dataclass(kw_only=True, slots=True)
class PlanConfig:
    """Everything the planner needs; checks that the parts agree with each other."""

    model: ModelConfig
    """Model size and shape."""

    train: TrainConfig
    """Tokens, sequence shape and numerics."""

    cluster: ClusterConfig
    """GPUs, their speed and memory."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout and ZeRO stage."""

    reliability: ReliabilityConfig | None = None
    """Failure model; ``None`` skips the reliability estimate."""

    def __post_init__(self) -> None:
        par, gpus = self.parallel, self.cluster.gpus
        mp = par.model_parallel
        if gpus % mp:
            raise ValueError(
                f"tp*pp*cp = {par.tp}*{par.pp}*{par.cp} = {mp} does not divide gpus={gpus}; "
                "pick sizes whose product divides the GPU count"
            )
        if par.dp is not None and par.dp * mp != gpus:
            raise ValueError(
                f"dp*tp*pp*cp = {par.dp}*{mp} = {par.dp * mp} but gpus={gpus}; "
                f"set dp={gpus // mp} or leave dp unset to infer it"
            )
        model, train = self.model, self.train
        if model.has_shape != (train.seq_len is not None):
            have = "seq_len" if train.seq_len is not None else "layers, hidden and heads"
            need = "layers, hidden and heads" if train.seq_len is not None else "seq_len"
            raise ValueError(
                f"the activation estimate needs seq_len, layers, hidden and heads: got {have} "
                f"but not {need}; pass all four or none"
            )
        if model.heads is not None and model.heads % par.tp:
            raise ValueError(
                f"tp={par.tp} does not divide heads={model.heads}; tensor parallelism splits "
                "attention heads, so use a tp that divides the head count"
            )
        if model.layers is not None and par.pp > model.layers:
            raise ValueError(
                f"pp={par.pp} exceeds layers={model.layers}; use pp <= layers "
                "(each stage needs at least one layer)"
            )
        if train.seq_len is not None and train.seq_len % par.cp:
            raise ValueError(
                f"cp={par.cp} does not divide seq_len={train.seq_len}; context parallelism "
                "splits the sequence, so use a cp that divides it"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size, given or inferred from the GPU count."""
        if self.parallel.dp is not None:
            return self.parallel.dp
        return self.cluster.gpus // self.parallel.model_parallel


# --------------------------------------------------------------------------------------------
# Time.


def flops_per_token(params: float, *, recompute: Recompute = "none") -> float:
    """Training FLOPs per token, C_token.

    Args:
        params: Parameter count W.
        recompute: ``full`` repeats the forward pass (8W); ``none`` and ``selective`` are 6W
            (selective recomputation redoes only the attention core, about 3% extra per
            Korthikanti et al., which 6W does not count anyway).

    Returns:
        ``6 * W``, or ``8 * W`` with full recomputation.
    """
    return (8.0 if recompute == "full" else 6.0) * params


def training_days(
    *,
    tokens: float,
    params: float,
    gpus: int,
    gpu_flops: float,
    mfu: float,
    recompute: Recompute = "none",
) -> float:
    """Days of compute: ``tokens * C_token / (gpus * gpu_flops * mfu * 86400)``.

    Args:
        tokens: Training tokens.
        params: Parameter count W.
        gpus: GPUs in the job.
        gpu_flops: Peak FLOP/s per GPU.
        mfu: Fraction of peak achieved.
        recompute: Activation recomputation mode (sets C_token).

    Returns:
        Training time in days, with no failures.
    """
    total = tokens * flops_per_token(params, recompute=recompute)
    return total / (gpus * gpu_flops * mfu * SECONDS_PER_DAY)


# --------------------------------------------------------------------------------------------
# Memory.


def model_state_bytes_per_param(precision: Precision = "bf16") -> dict[str, int]:
    """Bytes per parameter of each model state, before any sharding.

    Args:
        precision: Weight/gradient dtype. Mixed precision adds fp32 master weights.

    Returns:
        ``weights``, ``gradients``, ``master_weights``, ``adam_m`` and ``adam_v`` in bytes per
        parameter: 2 + 2 + 4 + 4 + 4 = 16 for bf16/fp16, 4 + 4 + 0 + 4 + 4 = 16 for fp32.
    """
    _check_choice("precision", precision, get_args(Precision))
    width = _PARAM_BYTES[precision]
    return {
        "weights": width,
        "gradients": width,
        # fp32 training updates the weights themselves; there is no separate master copy.
        "master_weights": _FP32_BYTES if width != _FP32_BYTES else 0,
        "adam_m": _FP32_BYTES,
        "adam_v": _FP32_BYTES,
    }


def activation_bytes_per_layer(
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    cp: int = 1,
    recompute: Recompute = "none",
) -> float:
    """Activation bytes one transformer layer keeps for backward, per GPU.

    Korthikanti et al. 2022 with 16-bit activations and sequence parallelism: ``s*b*h*(34 +
    5*a*s/h) / tp`` without recomputation (34 s*b*h for the linear layers, norms and dropout
    masks; 5*a*s^2*b for attention scores, softmax and its dropout mask), ``34*s*b*h / tp`` with
    selective recomputation and ``2*s*b*h / tp`` with full recomputation (only the layer input
    is kept). Context parallelism gives each GPU s/cp of the queries, so everything divides by cp.

    Args:
        seq_len: Sequence length s.
        micro_batch: Micro-batch size b.
        hidden: Hidden size h.
        heads: Attention heads a.
        tp: Tensor-parallel size.
        cp: Context-parallel size.
        recompute: ``none``, ``selective`` or ``full``.

    Returns:
        Bytes per layer per GPU.
    """
    _check_choice("recompute", recompute, get_args(Recompute))
    sbh = float(seq_len) * micro_batch * hidden
    if recompute == "full":
        per_layer = 2.0 * sbh
    elif recompute == "selective":
        per_layer = 34.0 * sbh
    else:
        per_layer = sbh * (34.0 + 5.0 * heads * seq_len / hidden)
    return per_layer / (tp * cp)


@dataclass(kw_only=True, slots=True, frozen=True)
class MemoryItem:
    """One row of the per-GPU memory estimate."""

    name: str
    """Component name."""

    bytes_per_gpu: float
    """Bytes on the most loaded GPU (the first pipeline stage)."""

    bytes_per_param: int | None
    """Unsharded bytes per parameter; ``None`` for activations."""

    sharded_over: str
    """Which parallel dimensions divide this component, with their product."""

    formula: str
    """How ``bytes_per_gpu`` was computed."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus GiB."""
        out = asdict(self)
        out["gib_per_gpu"] = self.bytes_per_gpu / GIB
        return out


_STATE_LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "master_weights": "master weights (fp32)",
    "adam_m": "Adam m (fp32)",
    "adam_v": "Adam v (fp32)",
}
# The ZeRO stage from which each state is sharded over the data-parallel replicas.
_ZERO_STAGE_SHARDING = {
    "weights": 3,
    "gradients": 2,
    "master_weights": 1,
    "adam_m": 1,
    "adam_v": 1,
}


def memory_breakdown(config: PlanConfig, *, dp: int | None = None) -> list[MemoryItem]:
    """Per-GPU memory by component for the first pipeline stage (the most loaded one).

    Model states divide by tp * pp; ZeRO shards them further over the dp * cp ranks that hold
    the same weights (how FSDP in torchtitan and Megatron's distributed optimizer group them).
    Activations divide by tp * cp; under 1F1B the first stage holds ``pp`` micro-batches of its
    ``ceil(layers / pp)`` layers, so pipelining does not shrink them (Korthikanti et al., Sec. 4).
    Embedding/output-layer activations, temporary buffers, the all-gathered layer of ZeRO-3 and
    allocator fragmentation are not counted.

    Args:
        config: The plan inputs.
        dp: Data-parallel size to assume instead of ``config.dp`` (used to search for the
            smallest one that fits).

    Returns:
        One :class:`MemoryItem` per component; activations only when the model shape is known.
    """
    par = config.parallel
    dp = config.dp if dp is None else dp
    shard = dp * par.cp
    mp_states = par.tp * par.pp
    params = config.model.params
    items = []
    for key, width in model_state_bytes_per_param(config.train.precision).items():
        sharded = par.zero >= _ZERO_STAGE_SHARDING[key]
        divisor = mp_states * (shard if sharded else 1)
        over = f"tp*pp={mp_states}"
        if sharded:
            over += f", ZeRO-{par.zero} dp*cp={shard}"
        formula = f"W*{width}/(tp*pp{'*dp*cp' if sharded else ''})"
        items.append(
            MemoryItem(
                name=_STATE_LABELS[key],
                bytes_per_gpu=params * width / divisor,
                bytes_per_param=width,
                sharded_over=over,
                formula=formula,
            )
        )
    model, train = config.model, config.train
    if model.layers is not None and model.hidden is not None and model.heads is not None:
        assert train.seq_len is not None  # PlanConfig checks shape and seq_len come together
        per_layer = activation_bytes_per_layer(
            seq_len=train.seq_len,
            micro_batch=train.micro_batch,
            hidden=model.hidden,
            heads=model.heads,
            tp=par.tp,
            cp=par.cp,
            recompute=train.recompute,
        )
        stage_layers = math.ceil(model.layers / par.pp)
        in_flight = par.pp
        base = {
            "none": "s*b*h*(34+5*a*s/h)",
            "selective": "34*s*b*h",
            "full": "2*s*b*h",
        }[train.recompute]
        formula = f"{base}/(tp*cp) x {stage_layers} layers"
        if in_flight > 1:
            formula += f" x {in_flight} micro-batches in flight"
        items.append(
            MemoryItem(
                name="activations",
                bytes_per_gpu=per_layer * stage_layers * in_flight,
                bytes_per_param=None,
                sharded_over=f"tp*cp={par.tp * par.cp}",
                formula=formula,
            )
        )
    return items


def min_dp_to_fit(config: PlanConfig) -> int | None:
    """Smallest data-parallel size whose per-GPU memory fits, keeping tp, pp, cp and ZeRO.

    Only ZeRO sharding depends on dp, so per-GPU bytes are ``A + B / dp`` and the answer is
    ``ceil(B / (budget - A))``.

    Args:
        config: The plan inputs; ``config.parallel.dp`` is ignored.

    Returns:
        The smallest dp, or ``None`` when no dp fits (ZeRO-0 that does not fit at dp=1, or the
        unsharded part alone exceeds the budget).
    """
    budget = config.cluster.gpu_mem_gib * GIB
    at_one = memory_breakdown(config, dp=1)
    total_one = sum(item.bytes_per_gpu for item in at_one)
    if total_one <= budget:
        return 1
    if config.parallel.zero == 0:
        return None
    at_two = memory_breakdown(config, dp=2)
    # Sharded bytes at dp=1 are B; doubling dp halves them: B = 2 * (total(1) - total(2)).
    sharded = 2.0 * (total_one - sum(item.bytes_per_gpu for item in at_two))
    fixed = total_one - sharded
    if fixed >= budget:
        return None
    dp = max(1, math.ceil(sharded / (budget - fixed)))
    # Guard the float division either way so the answer is exactly the smallest fitting dp.
    while dp > 1 and sum(i.bytes_per_gpu for i in memory_breakdown(config, dp=dp - 1)) <= budget:
        dp -= 1
    while sum(i.bytes_per_gpu for i in memory_breakdown(config, dp=dp)) > budget:
        dp += 1
    return dp


# --------------------------------------------------------------------------------------------
# Reliability.


def job_mtbf_s(gpu_mtbf_s: float, gpus: int) -> float:
    """Mean time between failures of a job that stops when any of its GPUs fails.

    Args:
        gpu_mtbf_s: MTBF of one GPU in seconds (failures independent, exponential).
        gpus: GPUs in the job.

    Returns:
        ``gpu_mtbf_s / gpus``.
    """
    _check_number("gpu_mtbf_s", gpu_mtbf_s, "pass the per-GPU MTBF in seconds")
    _check_int("gpus", gpus, "pass the number of GPUs")
    return gpu_mtbf_s / gpus


def expected_failures(*, gpus: int, run_s: float, gpu_mtbf_s: float) -> float:
    """Expected job-stopping failures over ``run_s`` seconds of wall time: gpus * run / MTBF."""
    return gpus * run_s / gpu_mtbf_s


def _wall_per_useful(interval_s: float, stall_s: float, mtbf_s: float, restart_s: float) -> float:
    # Daly 2006 (exponential failures, failures possible during checkpoints and restarts):
    # expected wall time per segment of tau useful seconds is M e^(R/M) (e^((tau+delta)/M) - 1).
    try:
        segment = (
            mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + stall_s) / mtbf_s)
        )
    except OverflowError:
        return math.inf
    return segment / interval_s


def _check_interval_args(stall_s: float, mtbf_s: float, restart_s: float) -> None:
    _check_number("stall_s", stall_s, "pass the seconds training blocks per checkpoint")
    _check_number("mtbf_s", mtbf_s, "pass the job MTBF in seconds")
    _check_number("restart_s", restart_s, "pass the seconds to resume", allow_zero=True)


def lost_time_fraction(
    interval_s: float, *, stall_s: float, mtbf_s: float, restart_s: float = 0.0
) -> float:
    """Expected wall time lost per second of useful training, for a checkpoint interval.

    ``M e^(R/M) (e^((tau+delta)/M) - 1) / tau - 1`` (Daly 2006); to first order
    ``delta/tau + (R + (tau+delta)/2) / M``: a stall per checkpoint, and per failure a restart
    plus half a segment recomputed.

    Args:
        interval_s: Useful training seconds between checkpoints, tau.
        stall_s: Seconds training blocks per checkpoint, delta.
        mtbf_s: Job MTBF in seconds, M.
        restart_s: Seconds from a failure until training runs again, R.

    Returns:
        Lost seconds per useful second (``inf`` when the job would practically never finish).
    """
    _check_number("interval_s", interval_s, "pass useful seconds between checkpoints")
    _check_interval_args(stall_s, mtbf_s, restart_s)
    return _wall_per_useful(interval_s, stall_s, mtbf_s, restart_s) - 1.0


def goodput(interval_s: float, *, stall_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Useful time / wall time for a checkpoint interval: ``1 / (1 + lost_time_fraction)``.

    Args:
        interval_s: Useful training seconds between checkpoints.
        stall_s: Seconds training blocks per checkpoint.
        mtbf_s: Job MTBF in seconds.
        restart_s: Seconds from a failure until training runs again.

    Returns:
        A fraction in [0, 1).
    """
    lost = lost_time_fraction(interval_s, stall_s=stall_s, mtbf_s=mtbf_s, restart_s=restart_s)
    return 1.0 / (1.0 + lost)


def _optimal_fraction(eps: float) -> float:
    # d/dtau of e^((tau+delta)/M - 1)/tau = 0  <=>  u + eps + log(1 - u) = 0 with u = tau/M,
    # eps = delta/M. The root is in (0, 1) and u ~ sqrt(2 eps) for small eps. Solved in this
    # form rather than via Lambert W, whose argument sits next to the branch point -1/e when
    # eps is small and loses all precision there.
    def f(u: float) -> float:
        if u < 1e-2:
            # u + log(1 - u) = -(u^2/2 + u^3/3 + ...): summed directly, since adding u to
            # log1p(-u) cancels all but ~u/2 of u's digits. Nine terms reach double precision.
            return eps - sum(u**k / k for k in range(10, 1, -1))
        return u + eps + math.log1p(-u)

    lo, hi = 0.0, 1.0
    u = min(math.sqrt(2.0 * eps), 0.5)
    for _ in range(200):
        value = f(u)
        if value > 0:
            lo = u
        else:
            hi = u
        slope = -u / (1.0 - u)
        step = value / slope if slope else math.inf
        nxt = u - step
        if not lo < nxt < hi:
            nxt = 0.5 * (lo + hi)
        if abs(nxt - u) <= 1e-15 * u:
            return nxt
        u = nxt
    return u


def choose_interval(stall_s: float, mtbf_s: float, *, method: IntervalMethod = "optimal") -> float:
    """Checkpoint interval (useful seconds between checkpoints) that minimises lost time.

    Args:
        stall_s: Seconds training blocks per checkpoint, delta.
        mtbf_s: Job MTBF in seconds, M.
        method: ``young``: ``sqrt(2*delta*M)`` (Young 1974, first order). ``daly``:
            ``sqrt(2*delta*M) * (1 + sqrt(delta/(2M))/3 + delta/(18M)) - delta`` for
            ``delta < 2M``, else ``M`` (Daly 2006). ``optimal``: the exact minimiser of
            :func:`lost_time_fraction`, which the restart time does not move.

    Returns:
        The interval in seconds.
    """
    _check_interval_args(stall_s, mtbf_s, 0.0)
    _check_choice("method", method, get_args(IntervalMethod))
    young = math.sqrt(2.0 * stall_s * mtbf_s)
    if method == "young":
        return young
    if method == "daly":
        if stall_s >= 2.0 * mtbf_s:
            return mtbf_s
        ratio = stall_s / (2.0 * mtbf_s)
        return young * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - stall_s
    return mtbf_s * _optimal_fraction(stall_s / mtbf_s)


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
        cfg = self.config
        par, train, cluster = cfg.parallel, cfg.train, cfg.cluster
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
        lines.append("")
        lines.append(
            f"Memory per GPU (dp={self.dp} tp={par.tp} pp={par.pp} cp={par.cp}, "
            f"ZeRO-{par.zero}, {train.precision}, recompute={train.recompute})"
        )
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
        rel = self.reliability
        if rel is not None:
            assert cfg.reliability is not None
            lines.append("")
            lines.append("Reliability")
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
        return "\n".join(lines)

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
    ratio = _wall_per_useful(interval, rel.ckpt_stall_s, mtbf, rel.restart_s)
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


# --------------------------------------------------------------------------------------------
# Command line.

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _quantity(text: str) -> float:
    """A float that may end in K, M, B/G or T (7B = 7e9, 2T = 2e12)."""
    body = text.strip().replace("_", "")
    scale = 1.0
    if body and body[-1].lower() in _SUFFIXES:
        scale = _SUFFIXES[body[-1].lower()]
        body = body[:-1]
    try:
        return float(body) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number (examples: 7e9, 7B, 2T)"
        ) from None


def _count(text: str) -> int:
    """An int, also written as 1e3 or 16K when it is a whole number."""
    value = _quantity(text)
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def build_parser(prog: str = "flashckpt plan") -> argparse.ArgumentParser:
    """The planner's argument parser (no subcommands).

    Args:
        prog: Program name shown in usage and errors.

    Returns:
        The parser.
    """
    p = argparse.ArgumentParser(
        prog=prog,
        description="Estimate training time, memory per GPU, checkpoint interval and goodput "
        "for LLM pre-training. Counts take suffixes: 7B, 2T, 16K.",
    )
    g = p.add_argument_group("compute")
    g.add_argument("--params", type=_quantity, required=True, help="parameter count W, e.g. 7e9")
    g.add_argument("--tokens", type=_quantity, required=True, help="training tokens, e.g. 2e12")
    g.add_argument("--gpus", type=_count, required=True, help="GPUs in the job")
    g.add_argument(
        "--gpu-flops", type=_quantity, default=989e12, help="peak FLOP/s per GPU (989e12)"
    )
    g.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (0.4)")
    g.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        default="none",
        metavar="{none,selective,full}",
        help="activation recomputation; the bare flag means full (C_token = 8W)",
    )
    g = p.add_argument_group("model shape and memory")
    g.add_argument("--seq-len", type=_count, help="sequence length s")
    g.add_argument("--micro-batch", type=_count, default=1, help="micro-batch size b (1)")
    g.add_argument("--hidden", type=_count, help="hidden size h")
    g.add_argument("--layers", type=_count, help="transformer layers L")
    g.add_argument("--heads", type=_count, help="attention heads a")
    g.add_argument("--precision", default="bf16", help="bf16, fp16 or fp32 (bf16)")
    g.add_argument("--gpu-mem-gib", type=float, default=80.0, help="GPU memory in GiB (80)")
    g.add_argument("--gpus-per-node", type=_count, default=8, help="GPUs per node (8)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--dp", type=_count, help="data-parallel size (default: gpus/(tp*pp*cp))")
    g.add_argument("--tp", type=_count, default=1, help="tensor-parallel size (1)")
    g.add_argument("--pp", type=_count, default=1, help="pipeline-parallel size (1)")
    g.add_argument("--cp", type=_count, default=1, help="context-parallel size (1)")
    g.add_argument("--zero", type=_count, default=0, help="ZeRO stage 0-3 (0)")
    g = p.add_argument_group("reliability (needs a failure rate)")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument(
        "--failure-rate-per-gpu-day",
        type=float,
        help="job-stopping failures per GPU per day (Llama 3: 419/(54*16384) = 4.7e-4)",
    )
    rate.add_argument("--gpu-mtbf-hours", type=float, help="per-GPU MTBF in hours")
    g.add_argument("--ckpt-stall-s", type=float, help="seconds blocked per checkpoint (1)")
    g.add_argument("--restart-s", type=float, help="seconds to resume after a failure (300)")
    g.add_argument(
        "--interval-method", help="optimal, daly or young: checkpoint interval rule (optimal)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def _config_from_args(args: argparse.Namespace) -> PlanConfig:
    reliability = None
    has_rate = args.failure_rate_per_gpu_day is not None or args.gpu_mtbf_hours is not None
    extras = {
        "ckpt_stall_s": args.ckpt_stall_s,
        "restart_s": args.restart_s,
        "interval_method": args.interval_method,
    }
    given = {key: value for key, value in extras.items() if value is not None}
    if has_rate:
        reliability = ReliabilityConfig(
            failure_rate_per_gpu_day=args.failure_rate_per_gpu_day,
            gpu_mtbf_hours=args.gpu_mtbf_hours,
            **given,
        )
    elif given:
        flags = ", ".join("--" + key.replace("_", "-") for key in given)
        raise ValueError(
            f"{flags} only apply with a failure rate; add --failure-rate-per-gpu-day or "
            "--gpu-mtbf-hours"
        )
    return PlanConfig(
        model=ModelConfig(
            params=args.params, layers=args.layers, hidden=args.hidden, heads=args.heads
        ),
        train=TrainConfig(
            tokens=args.tokens,
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            precision=args.precision,
            recompute=args.recompute,
        ),
        cluster=ClusterConfig(
            gpus=args.gpus,
            gpu_flops=args.gpu_flops,
            mfu=args.mfu,
            gpu_mem_gib=args.gpu_mem_gib,
            gpus_per_node=args.gpus_per_node,
        ),
        parallel=ParallelConfig(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, zero=args.zero),
        reliability=reliability,
    )


def main(argv: list[str] | None = None, *, prog: str = "flashckpt plan") -> int:
    """Command-line entry: print the plan as a table, or JSON with ``--json``.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv[1:]``.
        prog: Program name for usage and error messages.

    Returns:
        0 on success, 2 on bad input (the message goes to stderr).
    """
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on malformed flags
        return exc.code if isinstance(exc.code, int) else 2
    try:
        plan = make_plan(_config_from_args(args))
    except (ValueError, TypeError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(plan.to_json() if args.json else plan.to_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
