"""When a machine whose lease renewals fail is fenced, and when its lease may lapse
(:func:`fence_deadline`, :func:`lease_expiry`, :class:`FenceNotice`). Split out of
:mod:`flashckpt.elastic.membership.nodes` (issue 45), which re-exports the
public names.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_RENEW_RETRY_FIRST = 0.1
"""A failed renewal is retried after this share of the renewal interval, doubling with each
failure in a row (with jitter), up to :data:`_RENEW_RETRY_SHARE` of the time the lease has left
and at most one interval: N machines on a slow or failing etcd do not multiply its load by
retrying every tenth of an interval (issue 31: 13,000 failed renewals logged by one host)."""
_RENEW_RETRY_SHARE = 0.25


def fence_deadline(last_ok: float, ttl_s: float) -> float:
    """When a machine whose last successful lease renewal was sent at ``last_ok`` (monotonic
    seconds) is fenced if no renewal succeeded since: ``ttl - ttl/5`` after it. The lease
    lapses on etcd ``ttl`` after etcd *received* that renewal, so no other machine can act on
    its loss before :func:`lease_expiry`: ``ttl/5`` is left to stop the workers."""
    return last_ok + ttl_s - ttl_s / 5


def _renew_retry_delay(failures: int, interval: float, left: float) -> float:
    """Seconds before retrying after ``failures`` failed renewals in a row, with the lease
    ``left`` seconds before it may lapse: ``interval / 10`` doubled per failure, capped at a
    quarter of ``left`` and at one interval (never below ``interval / 10``; one interval once the
    lease may have lapsed: etcd's answer then only says so), jittered down by up to half so
    machines that failed together do not retry together."""
    first = interval * _RENEW_RETRY_FIRST
    cap = interval if left <= 0 else max(first, min(interval, left * _RENEW_RETRY_SHARE))
    return min(first * 2 ** min(failures - 1, 30), cap) * random.uniform(0.5, 1.0)


def lease_expiry(last_ok: float, ttl_s: float) -> float:
    """The earliest moment etcd may drop a lease last renewed by a request sent at ``last_ok``
    (monotonic seconds): the others may form a new world from then on."""
    return last_ok + ttl_s


@dataclass(frozen=True, slots=True)
class FenceNotice:
    """What :class:`NodeRegistry` tells ``on_fenced``."""

    reason: str
    """Why, for the log."""
    last_ok: float
    """Monotonic time the last successful renewal was sent."""
    expiry: float
    """Monotonic time from which etcd may have dropped the lease (:func:`lease_expiry`): the
    workers must be gone by then."""
    generation: int
    """The registration that is fenced (1 for the first)."""
