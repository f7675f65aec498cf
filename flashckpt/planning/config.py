"""The training planner's inputs: model, training, cluster, parallel layout and failure model.

Typed configs, each checked in ``__post_init__`` with an error that names the field and the fix;
:class:`PlanConfig` also checks that the parts agree (the parallel sizes divide the GPUs, heads,
layers and sequence). The estimates are in :mod:`flashckpt.planning.formulas`, the report in
:mod:`flashckpt.planning.report`; :mod:`flashckpt.planning` is the face. Pure Python (stdlib only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

__all__ = [
    "GIB",
    "SECONDS_PER_DAY",
    "SECONDS_PER_HOUR",
    "ClusterConfig",
    "IntervalMethod",
    "ModelConfig",
    "ParallelConfig",
    "PlanConfig",
    "Precision",
    "Recompute",
    "ReliabilityConfig",
    "TrainConfig",
    "check_choice",
    "check_int",
    "check_number",
]


GIB = 1024**3
SECONDS_PER_DAY = 86_400.0
SECONDS_PER_HOUR = 3_600.0

Precision = Literal["bf16", "fp16", "fp32"]
Recompute = Literal["none", "selective", "full"]
IntervalMethod = Literal["optimal", "daly", "young"]


# --------------------------------------------------------------------------------------------
# Input checks shared by the configs.


def check_number(name: str, value: object, hint: str, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}={value!r} must be a number; {hint}")
    low_ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and low_ok):
        need = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{name}={value!r} must be {need}; {hint}")


def check_int(name: str, value: object, hint: str, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int; {hint}")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}; {hint}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
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
        check_number("params", self.params, "pass the total parameter count, e.g. 7e9")
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
                check_int(name, value, "pass the model's shape, e.g. layers=32 hidden=4096")
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
        check_number("tokens", self.tokens, "pass the training token count, e.g. 2e12")
        if self.seq_len is not None:
            check_int("seq_len", self.seq_len, "pass the training sequence length, e.g. 4096")
        check_int("micro_batch", self.micro_batch, "pass sequences per micro-batch, e.g. 1")
        check_choice("precision", self.precision, get_args(Precision))
        check_choice("recompute", self.recompute, get_args(Recompute))


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
        check_int("gpus", self.gpus, "pass the number of GPUs in the job, e.g. 1024")
        check_number("gpu_flops", self.gpu_flops, "pass peak FLOP/s per GPU, e.g. 989e12")
        check_number("mfu", self.mfu, "pass a utilisation in (0, 1], e.g. 0.4")
        if self.mfu > 1:
            raise ValueError(
                f"mfu={self.mfu!r} is above 1; MFU is a fraction of peak, e.g. 0.4 (not 40)"
            )
        check_number("gpu_mem_gib", self.gpu_mem_gib, "pass GPU memory in GiB, e.g. 80")
        check_int("gpus_per_node", self.gpus_per_node, "pass GPUs per node, e.g. 8")


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
            check_int("dp", self.dp, "pass the data-parallel size, or leave it unset to infer")
        for name in ("tp", "pp", "cp"):
            check_int(name, getattr(self, name), f"pass a {name} size >= 1 (1 = not used)")
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
            check_number(
                "failure_rate_per_gpu_day",
                self.failure_rate_per_gpu_day,
                "pass failures per GPU per day, e.g. 4.7e-4",
            )
        if self.gpu_mtbf_hours is not None:
            check_number(
                "gpu_mtbf_hours", self.gpu_mtbf_hours, "pass hours per GPU failure, e.g. 5e4"
            )
        check_number("ckpt_stall_s", self.ckpt_stall_s, "pass seconds blocked per checkpoint")
        check_number(
            "restart_s", self.restart_s, "pass seconds to resume after a failure", allow_zero=True
        )
        check_choice("interval_method", self.interval_method, get_args(IntervalMethod))

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
