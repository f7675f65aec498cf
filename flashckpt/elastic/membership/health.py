"""The pre-admission health check (``flashckpt run --health-check``).

After each rendezvous round, before the workers start, every launcher of the round runs a short
probe in its own process:

1. compute: a fixed matrix product on this machine's training device (CUDA if present, else CPU),
   whose checksum every healthy machine reproduces exactly (same inputs, same kernel);
2. communicate: a gloo all-gather, over the round's rendezvous store, of every machine's
   checksum, compute time and verdict.

A machine whose checksum differs from the one most machines got (when most agree), is not
finite, or whose compute failed is *unhealthy*: every machine of the round learns it from the
same all-gather, so they all agree. It is recorded under
``<prefix>/<run_id>/unhealthy/<node_id>`` (a key without lease: it stays until deleted) and its
launcher exits; the others form the round again without it (a standby takes its
place). A launcher finding its node id recorded refuses to start for that job.

If the all-gather itself fails (a machine hung or died during the probe), nobody is blamed:
the round is formed again and the lease or probe machinery finds the dead machine.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException

from flashckpt import envnames
from flashckpt.elastic.etcd.client import EtcdClient, EtcdError

__all__ = [
    "FAULT_ENV",
    "HealthVerdict",
    "is_marked_unhealthy",
    "mark_unhealthy",
    "run_health_check",
    "unhealthy_key",
]

logger = logging.getLogger(__name__)

FAULT_ENV = envnames.INJECT_HEALTH_FAULT
"""Fault injection for tests: when ``1``, this machine's compute checksum comes out wrong."""

_SIZE = 256


def unhealthy_key(job_prefix: str, node_id: str) -> str:
    """The etcd key that records ``node_id`` as unhealthy for the job."""
    return f"{job_prefix}unhealthy/{node_id}"


def is_marked_unhealthy(
    client: EtcdClient, job_prefix: str, node_id: str, *, timeout: timedelta | None = None
) -> str | None:
    """The recorded reason if ``node_id`` failed a health check in this job, else ``None``
    (``timeout``: of the read; default: the client's)."""
    found = client.get(unhealthy_key(job_prefix, node_id), timeout=timeout)
    return None if found is None else found[0].decode(errors="replace")


def mark_unhealthy(client: EtcdClient, job_prefix: str, node_id: str, reason: str) -> None:
    """Records ``node_id`` as unhealthy for the job. Logs instead of raising on etcd errors."""
    try:
        client.put(unhealthy_key(job_prefix, node_id), json.dumps({"reason": reason}))
    except EtcdError as exc:
        logger.error("could not record node %s as unhealthy: %s", node_id, exc)


@dataclass(frozen=True, slots=True)
class HealthVerdict:
    """What the health check of one round found."""

    unhealthy: dict[int, str]
    """Group rank -> reason, for every machine that failed."""
    compute_s: list[float]
    """Each machine's compute time, by group rank."""


def _checksum(device: torch.device) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(1234)
    a = torch.randn(_SIZE, _SIZE, generator=generator, dtype=torch.float64).to(device)
    start = time.perf_counter()
    product = a
    for _ in range(4):
        product = (product @ a) / _SIZE
    value = float(product.sum().item())
    elapsed = time.perf_counter() - start
    if os.environ.get(FAULT_ENV) == "1":
        value = float("nan")
    return value, elapsed


def run_health_check(
    store: dist.Store, group_rank: int, group_world_size: int, timeout: timedelta
) -> HealthVerdict:
    """Runs the compute + all-gather probe of one round; see the module docstring.

    Args:
        store: The round's rendezvous store (a fresh prefix is used inside it).
        group_rank: This machine's rank in the round.
        group_world_size: Machines in the round.
        timeout: Bound on the all-gather.

    Returns:
        The verdict, identical on every machine of the round.

    Raises:
        RuntimeError: If the all-gather failed (a machine hung or died): nobody is blamed.
    """
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )
    try:
        value, elapsed = _checksum(device)
        ok = 1.0
    except SignalException:  # SIGTERM/SIGINT in the launcher: stop, do not fail the check
        raise
    except Exception as exc:  # a broken device must fail the check, not the launcher
        logger.error("health check compute failed on %s: %s", device, exc)
        value, elapsed, ok = float("nan"), float("inf"), 0.0
    mine = torch.tensor([value, elapsed, ok], dtype=torch.float64)
    gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(group_world_size)]
    if group_world_size > 1:
        group = dist.ProcessGroupGloo(
            dist.PrefixStore("flashckpt-health/", store), group_rank, group_world_size, timeout
        )
        group.allgather([gathered], [mine]).wait()  # type: ignore[attr-defined]
    else:
        gathered[0].copy_(mine)
    values = [float(t[0]) for t in gathered]
    finite = [v for v in values if math.isfinite(v)]
    majority = max(set(finite), key=finite.count) if finite else None
    if majority is not None and 2 * finite.count(majority) <= len(finite):
        # No value is held by most machines (two machines that disagree): a wrong checksum
        # cannot be told from a right one, so only non-finite results are blamed.
        logger.warning("health check checksums disagree with no majority: %s", values)
        majority = None
    unhealthy: dict[int, str] = {}
    for rank, t in enumerate(gathered):
        value, ok = float(t[0]), float(t[2])
        if ok != 1.0:
            unhealthy[rank] = "the compute probe raised an error"
        elif not math.isfinite(value):
            unhealthy[rank] = f"the compute probe gave a non-finite checksum ({value})"
        elif majority is not None and value != majority:
            unhealthy[rank] = f"the compute probe checksum {value!r} differs from {majority!r}"
    return HealthVerdict(unhealthy=unhealthy, compute_s=[float(t[1]) for t in gathered])
