"""What :class:`~flashckpt.elastic.rendezvous.handler.RdzvHandler` is given (its settings, the
source of a shared lease) and what it counts (its stats). Split out of
:mod:`flashckpt.elastic.rendezvous.handler` (issue 45), which re-exports the public names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from flashckpt.elastic.etcd.client import (
    Lease,
)

DEFAULT_LEASE_TTL = timedelta(seconds=10)


@dataclass(frozen=True, slots=True)
class RdzvSettings:
    """What :class:`RdzvHandler` needs besides its client and store."""

    run_id: str
    job_prefix: str  # "<key_prefix>/<run_id>/"
    min_nodes: int
    max_nodes: int
    join_timeout: timedelta = timedelta(seconds=600)
    last_call_timeout: timedelta = timedelta(seconds=30)
    lease_ttl: timedelta = DEFAULT_LEASE_TTL
    state_ttl: timedelta | None = timedelta(hours=2)
    local_addr: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"the rendezvous needs 1 <= min_nodes <= max_nodes, got "
                f"{self.min_nodes}:{self.max_nodes}"
            )
        if self.lease_ttl < timedelta(seconds=2):
            raise ValueError(f"lease_ttl must be at least 2 s, got {self.lease_ttl}")
        if not self.job_prefix.endswith("/"):
            raise ValueError(f"the job prefix must end with '/', got {self.job_prefix!r}")


class LeaseSource(Protocol):
    """Another owner of this machine's etcd lease that the handler's keys can share
    (:meth:`RdzvHandler.share_lease`; the launcher's
    :class:`~flashckpt.elastic.membership.nodes.NodeRegistry`): it grants and renews the
    lease, and says when it ended."""

    @property
    def ttl(self) -> timedelta:
        """The lease's TTL."""
        ...

    def shared_lease(self) -> Lease | None:
        """The lease now; None while there is none (not registered, fenced, closed)."""
        ...

    def lease_failed(self, lease: Lease) -> None:
        """etcd told a user of ``lease`` that it is gone: check it now."""
        ...

    def on_lease_ended(self, callback: Callable[[Lease], None]) -> None:
        """Calls ``callback(lease)`` whenever a lease it handed out ended (lapsed, revoked,
        fenced, closed)."""
        ...

    # A source may also create its own key in the handler's first join (one transaction for
    # both): ``fold_registration(lease, join: Txn) -> Txn | None`` and
    # ``fold_answered(lease, result: TxnResult | None) -> nested TxnResult | None``, as
    # :class:`~flashckpt.elastic.membership.nodes.NodeRegistry` does (see
    # :meth:`RdzvHandler._join_txn`).


class _Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.txns = 0
        self.txns_failed = 0
        self.bytes_written = 0
        self.max_value = 0
        self.waits = 0  # slices a waiter of a round waited on its watch (events or quiet)
        self.wait_watches = 0  # watches a waiter opened on its round's control keys

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {
                "txns": self.txns,
                "txns_failed": self.txns_failed,
                "bytes_written": self.bytes_written,
                "max_value": self.max_value,
                "waits": self.waits,
                "wait_watches": self.wait_watches,
            }
