"""The training planner's formulas: FLOPs and days, memory per GPU, failures and intervals.

Each estimate, with the paper it comes from, is described in :mod:`flashckpt.planning`. Pure
Python (stdlib only).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, get_args

from flashckpt.planning.config import (
    GIB,
    SECONDS_PER_DAY,
    IntervalMethod,
    PlanConfig,
    Precision,
    Recompute,
    check_choice,
    check_int,
    check_number,
)

__all__ = [
    "MemoryItem",
    "activation_bytes_per_layer",
    "choose_interval",
    "expected_failures",
    "flops_per_token",
    "goodput",
    "job_mtbf_s",
    "lost_time_fraction",
    "memory_breakdown",
    "min_dp_to_fit",
    "model_state_bytes_per_param",
    "training_days",
    "wall_per_useful",
]

_PARAM_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
# Optimizer states stay fp32 whatever the training precision (ZeRO paper, Sec. 3.1).
_FP32_BYTES = 4


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
    check_choice("precision", precision, get_args(Precision))
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
    check_choice("recompute", recompute, get_args(Recompute))
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
    check_number("gpu_mtbf_s", gpu_mtbf_s, "pass the per-GPU MTBF in seconds")
    check_int("gpus", gpus, "pass the number of GPUs")
    return gpu_mtbf_s / gpus


def expected_failures(*, gpus: int, run_s: float, gpu_mtbf_s: float) -> float:
    """Expected job-stopping failures over ``run_s`` seconds of wall time: gpus * run / MTBF."""
    return gpus * run_s / gpu_mtbf_s


def wall_per_useful(interval_s: float, stall_s: float, mtbf_s: float, restart_s: float) -> float:
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
    check_number("stall_s", stall_s, "pass the seconds training blocks per checkpoint")
    check_number("mtbf_s", mtbf_s, "pass the job MTBF in seconds")
    check_number("restart_s", restart_s, "pass the seconds to resume", allow_zero=True)


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
    check_number("interval_s", interval_s, "pass useful seconds between checkpoints")
    _check_interval_args(stall_s, mtbf_s, restart_s)
    return wall_per_useful(interval_s, stall_s, mtbf_s, restart_s) - 1.0


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
    check_choice("method", method, get_args(IntervalMethod))
    young = math.sqrt(2.0 * stall_s * mtbf_s)
    if method == "young":
        return young
    if method == "daly":
        if stall_s >= 2.0 * mtbf_s:
            return mtbf_s
        ratio = stall_s / (2.0 * mtbf_s)
        return young * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - stall_s
    return mtbf_s * _optimal_fraction(stall_s / mtbf_s)
