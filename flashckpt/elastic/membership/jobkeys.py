"""What a finished job leaves in etcd: the keys it no longer needs are removed (issue 31).

While a job runs its keys are bounded: node keys and machine summaries are bound to the
machines' leases, the rendezvous store keeps the current and the previous round
(:mod:`flashckpt.elastic.etcd.store`). When the job is over, the last launcher to leave removes the
keys that only a running job reads (:data:`FINISHED_JOB_PREFIXES`): the rendezvous store's last
rounds (and ``ranks/``, where a job of an older version kept stable-rank records). What stays is
what a machine arriving late must find, and what an operator may want to read: the closed
rendezvous (``rdzv/closed``, which tells a late standby that the job is over, and ``rdzv/done``
when a machine's workers finished, which tells it the job succeeded; on a lease of their own)
and the health check's
verdicts (``unhealthy/``, one key per machine found faulty).

"Last to leave": a launcher whose run ended with exit code 0 (its workers finished, or the job
finished without needing this standby), once its own node key is gone, finds no node key of the
job left. Two launchers leaving at the same instant may both remove them; deleting is
idempotent. A launcher that stops for any other reason (a signal, a failure) removes nothing:
the job may go on, or be started again with the same id.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from flashckpt.elastic.etcd.client import EtcdClient, EtcdError
from flashckpt.elastic.membership.nodes import nodes_prefix

__all__ = ["FINISHED_JOB_PREFIXES", "remove_finished_job_keys"]

logger = logging.getLogger("flashckpt.launcher")

FINISHED_JOB_PREFIXES = ("store/", "ranks/")
"""The sub-prefixes of a job (``<key_prefix>/<run_id>/``) deleted once it is over."""


def remove_finished_job_keys(
    client: EtcdClient, job_prefix: str, *, timeout: timedelta = timedelta(seconds=2)
) -> int | None:
    """Removes a finished job's leftover keys if no machine of the job is registered any more.

    Args:
        client: An etcd client.
        job_prefix: The job's prefix, ending in ``/``.
        timeout: Deadline of each etcd call.

    Returns:
        How many keys were deleted; None when a machine is still registered (nothing deleted)
        or etcd did not answer (logged: the keys stay, nothing else depends on them).
    """
    if not job_prefix.endswith("/"):
        raise ValueError(f"a job prefix ends with '/', got {job_prefix!r}")
    try:
        if client.count_prefix(nodes_prefix(job_prefix), timeout=timeout):
            return None
        deleted = sum(
            client.delete_prefix(job_prefix + sub, timeout=timeout) for sub in FINISHED_JOB_PREFIXES
        )
    except EtcdError as exc:
        logger.info("could not remove the finished job's keys from etcd (they stay): %s", exc)
        return None
    if deleted:
        logger.info("removed %d keys of the finished job from etcd", deleted)
    return deleted
