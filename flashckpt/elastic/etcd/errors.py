"""The errors of the etcd client (:class:`~flashckpt.elastic.etcd.client.EtcdClient`), its
watches and its lease keep-alives."""

from __future__ import annotations

from flashckpt.errors import EtcdError

__all__ = [
    "EtcdAuthError",
    "EtcdError",
    "EtcdLeaseNotFound",
    "EtcdOutcomeUnknown",
    "EtcdTimeout",
    "EtcdUnavailable",
    "WatchClosed",
    "WatchCompacted",
]


class EtcdAuthError(EtcdError):
    """etcd refused this client: no or a wrong client certificate, a certificate of a CA this
    client does not trust, no or wrong credentials, or a user without permission. Retrying cannot
    fix it; the message names the option to set."""


class EtcdUnavailable(EtcdError):
    """No etcd endpoint answered the request before its deadline.

    Connection refused, connection reset, DNS failure, or etcd reporting that it has no leader.
    Raised only after retrying every endpoint until the call's timeout ran out.
    """


class EtcdTimeout(EtcdUnavailable, TimeoutError):
    """etcd accepted the connection but did not answer before the call's deadline."""


class EtcdOutcomeUnknown(EtcdUnavailable):
    """A non-idempotent request (a transaction) was sent but its answer was lost.

    It may or may not have been applied. Re-read the key to find out; do not repeat the write
    blindly.
    """


class WatchCompacted(EtcdError):
    """etcd compacted the history a watch needs: re-read, then watch from that read."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class WatchClosed(EtcdError):
    """The watch was closed (:meth:`WatchStream.close`)."""


class EtcdLeaseNotFound(EtcdError):
    """The lease does not exist: it expired, was revoked, or was never granted on this cluster."""
