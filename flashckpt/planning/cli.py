"""The ``flashckpt plan`` command line: flags to a :class:`~flashckpt.planning.config.PlanConfig`,
the plan printed as a table or JSON. Pure Python (stdlib only).
"""

from __future__ import annotations

import argparse
import math
import sys

from flashckpt.planning.config import (
    ClusterConfig,
    ModelConfig,
    ParallelConfig,
    PlanConfig,
    ReliabilityConfig,
    TrainConfig,
)
from flashckpt.planning.report import make_plan

__all__ = ["build_parser", "main"]


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
