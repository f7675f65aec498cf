"""A DDP wrapper whose gradient buckets are the same in every run, so resumes stay bitwise.

DDP's reducer starts with one bucket layout and, after the wrapper's first backward pass,
rebuilds its buckets once in the order the gradients became ready. An uninterrupted run reduces
its step ``k`` with the rebuilt layout; a run resumed at step ``k`` builds a new wrapper, so it
reduces step ``k`` with the initial layout. An allreduce sums each element over the ranks in an
order that depends on where the element sits in the bucket's flat buffer (gloo's ring splits the
buffer into one chunk per rank, each chunk's sum starting at another rank). With two ranks the
order does not matter (``a + b == b + a``); with three or more it does, and the resumed run's
state drifts from the uninterrupted run's by rounding (up to a few 1e-8 in a small model).

:func:`fix_bucket_order` rebuilds the buckets at construction, in parameter order, before any
step; the reducer rebuilds only once, so every run, fresh or resumed, reduces every step with
that one layout. The cost: the buckets follow the parameters' order rather than the order their
gradients become ready, so on GPUs the allreduce of the first bucket waits for the end of the
backward pass (less overlap of communication with the backward computation).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

_fixed: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()  # wrappers already done


def fix_bucket_order(ddp: DistributedDataParallel) -> DistributedDataParallel:
    """Rebuilds ``ddp``'s gradient buckets now, in parameter order, once and for all (see the
    module's doc). Call it on every rank right after constructing the wrapper, before its first
    forward pass, in every run of the job (the uninterrupted one too); returns ``ddp``."""
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"fix_bucket_order takes a DistributedDataParallel, got {type(ddp).__name__}"
        )
    if ddp in _fixed:
        return ddp
    if ddp.find_unused_parameters and not ddp.static_graph:
        # DDP never rebuilds its buckets here: every step uses the initial layout already.
        _fixed.add(ddp)
        return ddp
    if any(p.grad is not None for p in ddp.module.parameters() if p.requires_grad):
        raise RuntimeError(
            "fix_bucket_order must run before the wrapper's first backward pass (a parameter "
            "already has a gradient): call it right after DistributedDataParallel(...)"
        )
    ddp.reducer._push_all_rebuilt_params()
    if not ddp.reducer._rebuild_buckets():
        raise RuntimeError(
            "DDP's reducer did not rebuild its buckets (already rebuilt: has the wrapper run a "
            "step?); build a new wrapper and call fix_bucket_order before its first step"
        )
    _fixed.add(ddp)
    return ddp


def distributed_data_parallel(module: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
    """``DistributedDataParallel(module, **kwargs)`` with :func:`fix_bucket_order` applied: its
    resumes stay bitwise equal to an uninterrupted run with any number of ranks."""
    return fix_bucket_order(DistributedDataParallel(module, **kwargs))


def resume_warning(ddp: DistributedDataParallel) -> str | None:
    """The warning ``checkpointing()`` gives for ``ddp`` (None: its resumes are bitwise): a
    torch wrapper whose buckets were not fixed (see the module's doc), over 3 or more ranks,
    that rebuilds its buckets after its first step."""
    if ddp in _fixed or (ddp.find_unused_parameters and not ddp.static_graph):
        return None
    group = getattr(ddp, "process_group", None)
    size = group.size() if group is not None else 0
    if size < 3:
        return None
    return (
        f"flashckpt: the model is a plain DistributedDataParallel over {size} ranks: a resumed "
        "run will not be bitwise equal to an uninterrupted one. A wrapper built after a restore "
        "reduces its first step in DDP's initial gradient-bucket layout where the "
        "uninterrupted run used the layout DDP rebuilt after its first step; with 3 or more "
        "ranks that step's gradients differ in their last bits, and the difference grows. Fix: "
        "build the wrapper with flashckpt.trainer.ddp.distributed_data_parallel(model, ...) "
        "(or call flashckpt.trainer.ddp.fix_bucket_order(ddp) right after "
        "DistributedDataParallel(...)), in every run of the job (docs/training-loop.md, "
        '"Data parallel")'
    )
