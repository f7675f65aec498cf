"""A small, dependency-free client for etcd's v3 API, with deadlines and bounded retries.

Why this talks to etcd's JSON gRPC-gateway with the standard library instead of using a client
package (evaluated for flashckpt; tested against etcd 3.5.1 and 3.4.23):

- ``etcd3`` (python-etcd3 0.12.0, last released 2020) ships ``_pb2`` modules generated for
  protobuf 3, which current protobuf releases refuse to import; its forks on PyPI
  (``etcd3-fork``, ``etcd3-fc``, ``cslab-etcd3``, ...) have one maintainer each and keep the same
  ``grpcio``/``protobuf`` dependency.
- gRPC clients (``aetcd``, ``etcd3aio``, ``etcd-sdk-python``) need ``grpcio`` and ``protobuf``,
  whose version pins routinely collide with the rest of an ML environment; ``aetcd`` and
  ``etcd3aio`` are asyncio-only, while torch's ``RendezvousBackend`` and ``Store`` are synchronous
  and are called from torch's own threads.
- ``etcd3gw`` (OpenStack, maintained, also uses the JSON gateway) is the closest fit, but it pulls
  in ``requests``, ``futurist`` and ``pbr``, talks to a single host:port, never retries, has only
  a per-request socket timeout (no deadline across retries and endpoints), and cannot tell a
  transaction that never reached etcd from one whose answer was lost; we would have had to wrap
  all of it anyway.
- The JSON gateway (``POST /v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/deleterange``,
  ``/v3/kv/txn``, ``/v3/lease/grant``, ``/v3/lease/keepalive``, ``/v3/lease/revoke``,
  ``/v3/watch``; keys and values base64 in JSON) is a documented, stable part of every etcd >= 3.4
  server, enabled by default on the client port. Speaking it with ``http.client`` takes a few
  hundred lines of code, adds no dependency to pin, avoids protobuf entirely, and gives us
  control of what matters for fault tolerance: a deadline on every call, fail-over across
  endpoints, and an exact mapping of failures to :class:`EtcdUnavailable`, :class:`EtcdTimeout`
  and :class:`EtcdOutcomeUnknown`.

The transport (pooled keep-alive connections, fail-over, the retry rules) is
:mod:`flashckpt.elastic.etcd._gateway`; the watch is :mod:`flashckpt.elastic.etcd.watchstream`.
The calls made most often skip the gateway, which costs etcd far more CPU than the calls
themselves (a grpc-gateway proxy inside etcd: HTTP/1.1, JSON, and a loopback gRPC call per
request), and go to etcd's gRPC service on the same port, with the same deadlines, errors and
retry rules: lease keep-alives on one ``LeaseKeepAlive`` stream per client and process
(:mod:`flashckpt.elastic.etcd._leasestream`), and the key-value calls (reads, puts, deletes,
transactions: the rendezvous's joins and the node keys' registration) and lease grants and
revokes, with ``EtcdClient(grpc_kv=True)``, as unary calls on one HTTP/2 connection per client
and process (:mod:`flashckpt.elastic.etcd._grpckv`; the bodies and answers stay the gateway's
JSON, translated by :mod:`flashckpt.elastic.etcd._kvproto`; off by default, see
``_gateway.GRPC_KV_DEFAULT`` for why). Both fall back to the gateway on ``https://`` endpoints
and on an endpoint that does not speak HTTP/2. Measured with ``benchmarks/lease_keepalive.py``
and ``benchmarks/etcd_transport.py``.

Keys are ``str`` (UTF-8 encoded) or ``bytes``; values are ``bytes`` (``str`` is UTF-8 encoded).
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any

from flashckpt.elastic.etcd._gateway import ConnectionStats, Gateway, parse_endpoints
from flashckpt.elastic.etcd._wire import (
    Key,
    KeyValue,
    Lease,
    Value,
    header_revision,
    kv_from_json,
    lease_id,
    prefix_end,
    prefix_range_end,
    to_bytes,
    ttl_seconds,
)
from flashckpt.elastic.etcd.errors import (
    EtcdAuthError,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdOutcomeUnknown,
    EtcdTimeout,
    EtcdUnavailable,
    WatchClosed,
    WatchCompacted,
)
from flashckpt.elastic.etcd.ops import Compare, Delete, Op, Put, Range, Txn, TxnResult
from flashckpt.elastic.etcd.security import EtcdSecurity
from flashckpt.elastic.etcd.watchstream import WatchEvent, WatchStream

# The client's public face: what its methods take, return and raise.
__all__ = [
    "ConnectionStats",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdError",
    "EtcdLeaseNotFound",
    "EtcdOutcomeUnknown",
    "EtcdSecurity",
    "EtcdTimeout",
    "EtcdUnavailable",
    "KeyValue",
    "Lease",
    "LeaseKeepAlive",
    "WatchBatch",
    "WatchClosed",
    "WatchCompacted",
    "WatchEvent",
    "WatchStream",
    "parse_endpoints",
    "prefix_end",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """What one :meth:`EtcdClient.watch_events` call saw."""

    events: list[WatchEvent]
    """The changes, oldest first; empty when the timeout passed first."""
    revision: int
    """Watch from this revision on next time (``after_revision``): the last event's revision,
    or the one asked when no event came. Never splits the changes of one revision."""
    compacted: int = 0
    """Non-zero when the history after ``after_revision`` was compacted (to this revision):
    changes may be missing, so re-read the keys, then watch from the read's revision."""


class EtcdClient:
    """A synchronous, thread-safe etcd v3 client with a deadline on every call.

    Every call retries across all endpoints, with exponential backoff, until it succeeds or its
    timeout runs out; then it raises :class:`EtcdUnavailable` (nothing answered),
    :class:`EtcdTimeout` (a server took the request but did not answer in time) or
    :class:`EtcdOutcomeUnknown` (a transaction's answer was lost). Any other error etcd reports
    raises :class:`EtcdError` at once.

    Args:
        endpoints: etcd client URLs: ``"http://10.0.0.1:2379"``, ``"h1:2379,h2:2379"`` or a list.
        timeout: Default deadline of each call, retries included.
        connect_timeout: Cap on one TCP connect, so that one black-holed endpoint cannot use up
            the whole deadline before the others are tried.
        ssl_context: TLS settings for ``https://`` endpoints (CA, client certificate). ``None``
            uses the system's default trust store.
        grpc_kv: Send the key-value calls (reads, puts, deletes, transactions) and lease
            grants and revokes as gRPC calls on one HTTP/2 connection
            (:mod:`flashckpt.elastic.etcd._grpckv`) instead of JSON-gateway requests;
            ``None``: the module default. Either way they fall back to
            the gateway on ``https://`` endpoints and on an endpoint that does not speak HTTP/2.
        security: TLS files (CA, client certificate) and etcd credentials
            (:class:`~flashckpt.elastic.etcd.security.EtcdSecurity`). With a user, every request
            carries an auth token from ``/v3/auth/authenticate``, obtained again when etcd
            rejects it as expired. With TLS or a user, every call goes over the JSON gateway.

    Raises:
        ValueError: If no endpoint is given or a timeout is not positive.

    The client holds its transport (:attr:`transport`, the connections, fail-over and retry
    rules) rather than being one; the request bodies are written by
    :mod:`flashckpt.elastic.etcd.ops`, which :meth:`txn` takes.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: timedelta,
        connect_timeout: timedelta = timedelta(seconds=2),
        ssl_context: ssl.SSLContext | None = None,
        grpc_kv: bool | None = None,
        security: EtcdSecurity | None = None,
    ) -> None:
        self._transport = Gateway(
            endpoints,
            timeout=timeout,
            connect_timeout=connect_timeout,
            ssl_context=ssl_context,
            grpc_kv=grpc_kv,
            security=security,
        )

    @property
    def transport(self) -> Gateway:
        """The connections to etcd (shared with the watch and lease streams it opens)."""
        return self._transport

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints, as URLs."""
        return self._transport.endpoints

    @property
    def timeout(self) -> timedelta:
        """The default deadline of each call."""
        return self._transport.timeout

    @property
    def security(self) -> EtcdSecurity | None:
        """The TLS files and credentials this client was made with."""
        return self._transport.security

    @property
    def authentications(self) -> int:
        """How many auth tokens this client obtained (one, plus one per expired token)."""
        return self._transport.authentications

    def connection_stats(self) -> ConnectionStats:
        """What the connection pool of this process did so far: connections opened, requests
        that reused one, stale ones replaced, idle ones now."""
        return self._transport.connection_stats()

    def close(self) -> None:
        """Closes the pooled connections (a request in flight closes its own when done).

        Calls made after it still work, each on a connection of its own; watches and
        :class:`LeaseKeepAlive` threads are not stopped (close those first).
        """
        self._transport.close()

    def _call(
        self, path: str, body: dict[str, Any], *, timeout: timedelta | None, idempotent: bool
    ) -> dict[str, Any]:
        """One request to ``path`` with the transport's deadline and retry rules (the one
        place this client's requests go out)."""
        return self._transport._call(path, body, timeout=timeout, idempotent=idempotent)

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(self.endpoints)!r}, timeout={self.timeout!r})"

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------------------- key-value

    def txn(
        self, txn: Txn, *, timeout: timedelta | None = None, idempotent: bool | None = None
    ) -> TxnResult:
        """Runs one transaction (:class:`~flashckpt.elastic.etcd.ops.Txn`).

        Args:
            txn: The compares and the operations of each branch.
            timeout: Deadline of this call; defaults to the client's.
            idempotent: Whether an attempt whose answer was lost may be sent again;
                ``None``: :attr:`Txn.idempotent <flashckpt.elastic.etcd.ops.Txn.idempotent>`
                (true unless it writes under a condition).

        Returns:
            Which branch ran, the revision after it, and each operation's answer.

        Raises:
            EtcdOutcomeUnknown: A transaction that is not idempotent was sent but its answer
                was lost: it may or may not have been applied. Re-read the keys.
            EtcdLeaseNotFound: If a put's lease has expired or was revoked.
        """
        if idempotent is None:
            idempotent = txn.idempotent
        response = self._call("/v3/kv/txn", txn.to_json(), timeout=timeout, idempotent=idempotent)
        return TxnResult.from_json(response)

    def get(self, key: Key, *, timeout: timedelta | None = None) -> tuple[bytes, int] | None:
        """Reads one key.

        Args:
            key: The key.
            timeout: Deadline of this call; defaults to the client's.

        Returns:
            ``(value, mod_revision)``, or ``None`` if the key does not exist.
        """
        kv = self.get_kv(key, timeout=timeout)
        return None if kv is None else (kv.value, kv.mod_revision)

    def get_kv(self, key: Key, *, timeout: timedelta | None = None) -> KeyValue | None:
        """Reads one key with all its metadata; ``None`` if it does not exist."""
        response = self._call(
            "/v3/kv/range", Range(key).to_json(), timeout=timeout, idempotent=True
        )
        kvs = response.get("kvs") or []
        return kv_from_json(kvs[0]) if kvs else None

    def get_many(
        self, keys: Sequence[Key], *, timeout: timedelta | None = None
    ) -> tuple[list[KeyValue | None], int]:
        """Reads several keys from one consistent snapshot, in one round trip.

        Args:
            keys: The keys.
            timeout: Deadline of this call; defaults to the client's.

        Returns:
            The keys' entries in the order asked (``None`` where absent) and the store revision
            of the snapshot (pass it to :meth:`wait_for_change` as ``after_revision``).
        """
        if not keys:
            return [], self.revision(timeout=timeout)
        result = self.txn(Txn(success=[Range(k) for k in keys]), timeout=timeout)
        found: list[KeyValue | None] = []
        for i in range(len(result)):
            kvs = result.kvs(i)
            found.append(kvs[0] if kvs else None)
        if len(found) != len(keys):
            raise EtcdError(
                f"etcd answered {len(found)} ranges for {len(keys)} keys; the server or a proxy "
                "in between mangled the transaction"
            )
        return found, result.revision

    def get_prefix(self, prefix: Key, *, timeout: timedelta | None = None) -> list[KeyValue]:
        """Reads every key that starts with ``prefix``, sorted by key."""
        return self.get_prefix_with_revision(prefix, timeout=timeout)[0]

    def get_prefix_with_revision(
        self, prefix: Key, *, timeout: timedelta | None = None
    ) -> tuple[list[KeyValue], int]:
        """Like :meth:`get_prefix`, also returning the store revision of the snapshot."""
        body = Range.prefix(prefix).to_json()
        response = self._call("/v3/kv/range", body, timeout=timeout, idempotent=True)
        kvs = [kv_from_json(raw) for raw in response.get("kvs") or []]
        return kvs, header_revision(response)

    def get_range(
        self,
        start: Key,
        end: Key,
        *,
        limit: int = 0,
        keys_only: bool = False,
        timeout: timedelta | None = None,
    ) -> list[KeyValue]:
        """Reads the keys from ``start`` (included) to ``end`` (excluded), sorted by key.

        Args:
            start: The first key.
            end: The key after the last (``b"\\x00"``: every key from ``start`` on).
            limit: At most this many keys (0: all).
            keys_only: Leave the values out (``value`` is ``b""``).
            timeout: Deadline of this call; defaults to the client's.
        """
        body = Range(start, end, limit=limit, keys_only=keys_only).to_json()
        response = self._call("/v3/kv/range", body, timeout=timeout, idempotent=True)
        return [kv_from_json(raw) for raw in response.get("kvs") or []]

    def counts(
        self, queries: Sequence[tuple[Key, Key | None, int]], *, timeout: timedelta | None = None
    ) -> tuple[list[int], int]:
        """Counts keys for several queries from one consistent snapshot, in one round trip,
        without reading them.

        Args:
            queries: ``(key, range_end, min_mod_revision)`` each: the keys from ``key`` to
                ``range_end`` (excluded; ``None``: the key alone; :func:`prefix_end` of a
                prefix: every key under it), counting only keys last written at
                ``min_mod_revision`` or later (0: all; etcd then lists those keys, without
                values: ask for few).
            timeout: Deadline of this call; defaults to the client's.

        Returns:
            The counts in the order asked, and the store revision of the snapshot.
        """
        # etcd's count ignores the revision filter, so the (few) keys it keeps are listed,
        # without their values.
        ranges: list[Op] = [
            Range(key, range_end, keys_only=True, min_mod_revision=min_mod_revision)
            if min_mod_revision
            else Range(key, range_end, count_only=True)
            for key, range_end, min_mod_revision in queries
        ]
        result = self.txn(Txn(success=ranges), timeout=timeout)
        found = []
        for i, (_, _, min_mod_revision) in enumerate(queries[: len(result)]):
            answer = result.range(i)
            found.append(len(answer.kvs) if min_mod_revision else answer.count)
        if len(found) != len(queries):
            raise EtcdError(
                f"etcd answered {len(found)} ranges for {len(queries)} counts; the server or a "
                "proxy in between mangled the transaction"
            )
        return found, result.revision

    def count_prefix(self, prefix: Key, *, timeout: timedelta | None = None) -> int:
        """Counts the keys that start with ``prefix`` without reading their values."""
        body = Range.prefix(prefix, count_only=True).to_json()
        response = self._call("/v3/kv/range", body, timeout=timeout, idempotent=True)
        return int(response.get("count", 0))

    def revision(self, *, timeout: timedelta | None = None) -> int:
        """The current revision of the whole store (read from the key
        :attr:`~flashckpt.elastic.etcd.security.EtcdSecurity.probe_key`: a user whose role may
        read only the jobs' prefix may read it)."""
        security = self._transport.security
        probe = security.probe_key if security is not None else b"\x00"
        body = Range(probe, count_only=True).to_json()
        return header_revision(self._call("/v3/kv/range", body, timeout=timeout, idempotent=True))

    def put(
        self,
        key: Key,
        value: Value,
        *,
        lease: Lease | int | None = None,
        timeout: timedelta | None = None,
    ) -> int:
        """Writes a key unconditionally.

        Args:
            key: The key.
            value: The value.
            lease: Attach the key to this lease: it is deleted when the lease ends.
            timeout: Deadline of this call; defaults to the client's.

        Returns:
            The key's new ``mod_revision``.

        Raises:
            EtcdLeaseNotFound: If ``lease`` has expired or was revoked.
        """
        body = Put(key, value, None if lease is None else lease_id(lease)).to_json()
        return header_revision(self._call("/v3/kv/put", body, timeout=timeout, idempotent=True))

    def delete(self, key: Key, *, timeout: timedelta | None = None) -> bool:
        """Deletes one key.

        Returns:
            Whether the key existed. After a retried attempt whose first try was applied but
            not answered, this is ``False`` although the key is gone.
        """
        body = Delete(key).to_json()
        response = self._call("/v3/kv/deleterange", body, timeout=timeout, idempotent=True)
        return int(response.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: Key, *, timeout: timedelta | None = None) -> int:
        """Deletes every key that starts with ``prefix``; returns how many were deleted.

        Raises:
            ValueError: If ``prefix`` is empty (that would delete the whole cluster's data).
        """
        body = Delete.prefix(prefix).to_json()
        response = self._call("/v3/kv/deleterange", body, timeout=timeout, idempotent=True)
        return int(response.get("deleted", 0))

    def compare_and_set(
        self,
        key: Key,
        value: Value,
        *,
        mod_revision: int,
        lease: Lease | int | None = None,
        timeout: timedelta | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Writes a key only if its ``mod_revision`` is still the given one, in one transaction.

        Args:
            key: The key.
            value: The new value.
            mod_revision: The revision the caller last read; ``0`` means "only if the key does
                not exist" (create-if-absent).
            lease: Attach the key to this lease.
            timeout: Deadline of this call; defaults to the client's.

        Returns:
            ``(True, new entry)`` if the write happened, else ``(False, current entry)``, where
            the current entry is ``None`` if the key does not exist.

        Raises:
            EtcdOutcomeUnknown: The request was sent but the answer was lost; the write may or
                may not have happened. Re-read the key.
            EtcdLeaseNotFound: If ``lease`` has expired or was revoked.
        """
        if mod_revision < 0:
            raise ValueError(f"mod_revision must be >= 0 (0: key absent), got {mod_revision}")
        txn = Txn(
            compare=[Compare.modified(key, mod_revision)],
            # Reading the key back inside the transaction returns the new entry atomically.
            success=[Put(key, value, None if lease is None else lease_id(lease)), Range(key)],
            failure=[Range(key)],
        )
        result = self.txn(txn, timeout=timeout, idempotent=False)
        succeeded = result.succeeded
        kvs = result.kvs(len(result) - 1)
        current = kvs[0] if kvs else None
        if succeeded and current is None:
            raise EtcdError(
                f"etcd reported the compare-and-set of {key!r} as applied but returned no entry; "
                "the server or a proxy in between mangled the transaction"
            )
        return succeeded, current

    def compare_and_delete(
        self, key: Key, *, mod_revision: int, timeout: timedelta | None = None
    ) -> bool:
        """Deletes a key only if its ``mod_revision`` is still the given one.

        Returns:
            Whether the key was deleted.

        Raises:
            EtcdOutcomeUnknown: The answer was lost; re-read the key.
        """
        txn = Txn(compare=[Compare.modified(key, mod_revision)], success=[Delete(key)])
        return self.txn(txn, timeout=timeout, idempotent=False).succeeded

    def compact(self, revision: int, *, timeout: timedelta | None = None) -> bool:
        """Discards the history of every key before ``revision`` (etcd's compaction), which
        frees the space old values take in etcd's database; current values stay.

        Returns:
            ``False`` when etcd had compacted to ``revision`` or beyond already.

        Raises:
            EtcdError: If etcd refused it (for example a revision in the future).
        """
        try:
            self._call(
                "/v3/kv/compaction", {"revision": str(revision)}, timeout=timeout, idempotent=True
            )
        except EtcdError as exc:
            if "required revision has been compacted" in str(exc):
                return False
            raise
        return True

    def wait_for_change(
        self,
        key: Key,
        *,
        after_revision: int,
        timeout: timedelta,
        prefix: bool = False,
    ) -> bool:
        """Blocks until ``key`` (or any key under it, with ``prefix``) changes, or timeout.

        Uses etcd's watch stream, so it wakes up as soon as the change is committed.

        Args:
            key: The key, or the prefix if ``prefix`` is true.
            after_revision: Only changes made after this store revision count (use the revision
                returned by the read that found the key missing).
            timeout: How long to wait.
            prefix: Watch every key that starts with ``key``.

        Returns:
            ``True`` if something changed (or the history was compacted, so a change cannot be
            ruled out: re-read in both cases), ``False`` if the timeout passed first.

        Raises:
            EtcdUnavailable: If no endpoint could be reached during the whole timeout.
        """
        key_bytes = to_bytes(key, "key") or b"\x00"
        range_end = prefix_range_end(key_bytes) if prefix else None
        stream = WatchStream(self._transport, key_bytes, range_end, after_revision + 1)
        try:
            return bool(stream.next_events(timeout))
        except WatchCompacted:
            return True  # a change cannot be ruled out
        finally:
            stream.close()

    def watch_events(
        self,
        key: Key,
        *,
        after_revision: int,
        timeout: timedelta,
        prefix: bool = False,
    ) -> WatchBatch:
        """Waits for the next changes of ``key`` (or of the keys under it, with ``prefix``)
        after ``after_revision`` and returns them with their previous values (etcd's
        ``prev_kv``), so a caller keeps a view of the keys up to date from the changes alone,
        without reading the keys again.

        Args:
            key: The key, or the prefix if ``prefix`` is true.
            after_revision: Only changes made after this store revision are returned (the
                revision of the read that built the view, then each batch's ``revision``).
            timeout: How long to wait for a change.
            prefix: Watch every key that starts with ``key``.

        The watch stays open between calls: a call from the same thread for the same keys
        whose ``after_revision`` is the previous batch's ``revision`` goes on reading the same
        stream (no new connection, nothing missed in between); any other call opens a new one.

        Returns:
            The changes of one or more revisions (several when catching up), or none when the
            timeout passed first; ``compacted`` set when the history after ``after_revision``
            is gone.

        Raises:
            EtcdUnavailable: If no endpoint could be reached during the whole timeout.
        """
        key_bytes = to_bytes(key, "key") or b"\x00"
        range_end = prefix_range_end(key_bytes) if prefix else None
        slot = (threading.get_ident(), key_bytes, range_end)
        pool = self._transport._pool_here()
        kept = pool.take_watch(slot, after_revision + 1)  # only watch_events keeps streams
        if isinstance(kept, WatchStream):
            stream = kept
        else:
            stream = WatchStream(
                self._transport, key_bytes, range_end, after_revision + 1, prev_kv=True
            )
        try:
            events = stream.next_events(timeout)
        except WatchCompacted as exc:
            stream.close()
            return WatchBatch([], after_revision, exc.compact_revision)
        except BaseException:
            stream.close()
            raise
        pool.give_watch(slot, stream)  # the next call goes on from its next revision
        if not events:
            return WatchBatch([], after_revision)
        return WatchBatch(events, stream.next_revision - 1)

    # ----------------------------------------------------------------------------- leases

    def grant_lease(self, ttl: timedelta, *, timeout: timedelta | None = None) -> Lease:
        """Grants a new lease.

        A grant whose answer was lost is retried, so a lost answer can leave an unused lease
        behind; it expires after ``ttl`` on its own.

        Args:
            ttl: Time to live, at least 1 s (rounded up to whole seconds).
            timeout: Deadline of this call; defaults to the client's.
        """
        response = self._call(
            "/v3/lease/grant", {"TTL": ttl_seconds(ttl)}, timeout=timeout, idempotent=True
        )
        if response.get("error"):
            raise EtcdError(f"etcd refused to grant a lease: {response['error']}")
        return Lease(id=int(response["ID"]), ttl=timedelta(seconds=int(response["TTL"])))

    def refresh_lease(self, lease: Lease | int, *, timeout: timedelta | None = None) -> timedelta:
        """Renews a lease once (one keep-alive); returns its TTL from now.

        Raises:
            EtcdLeaseNotFound: If the lease has already expired or was revoked: the keys
                attached to it are gone and the lease cannot be revived.
        """
        return self.renew_lease(lease, timeout=timeout)[0]

    def renew_lease(
        self, lease: Lease | int, *, timeout: timedelta | None = None, keep: bool = False
    ) -> tuple[timedelta, float]:
        """:meth:`refresh_lease`, with the monotonic time (``time.monotonic()``) the answered
        keep-alive was sent: etcd counts the lease's TTL from when it received it, later.

        Args:
            lease: The lease.
            timeout: Deadline of this call; defaults to the client's.
            keep: For the lease's only renewer (``NodeRegistry``'s renew loop), which waits for
                one renewal in slices and comes back after each: a keep-alive still in flight
                when the deadline passes is neither dropped nor judged stuck, and the next call
                for the lease takes its answer (with its send time) instead of sending another.
                One renewal on the wire at a time however late etcd answers, and no thread of
                its own to wait for it. (A gateway request, where the stream cannot be used, is
                not kept: each call sends one.)

        Raises:
            EtcdLeaseNotFound: If the lease has already expired or was revoked.
            EtcdTimeout: No answer before the deadline (with ``keep``, one may still come).
        """
        ident = lease_id(lease)
        ttl, sent = self._transport._keep_alive(ident, timeout, keep=keep)
        if ttl <= 0:
            raise EtcdLeaseNotFound(
                f"lease {ident:x} has expired or was revoked; grant a new lease and put the "
                "keys again"
            )
        return timedelta(seconds=ttl), sent

    def revoke_lease(self, lease: Lease | int, *, timeout: timedelta | None = None) -> bool:
        """Revokes a lease, deleting every key attached to it.

        Returns:
            ``True`` if etcd revoked it, ``False`` if it was already gone.
        """
        try:
            self._call(
                "/v3/lease/revoke",
                {"ID": str(lease_id(lease))},
                timeout=timeout,
                idempotent=True,
            )
        except EtcdLeaseNotFound:
            return False
        return True

    def keep_alive(self, lease: Lease, *, interval: timedelta | None = None) -> LeaseKeepAlive:
        """Starts refreshing ``lease`` from a daemon thread; see :class:`LeaseKeepAlive`.

        Args:
            lease: The lease.
            interval: Time between refreshes; defaults to a third of the lease's TTL, so two
                refreshes in a row may fail before the lease lapses.
        """
        return LeaseKeepAlive(self, lease, interval=interval or lease.ttl / 3)


class LeaseKeepAlive:
    """Keeps a lease alive from a daemon thread until closed, or until etcd says it is gone.

    A failed refresh (etcd briefly unreachable) is logged and retried at the next interval; the
    thread never dies of it. Once etcd answers that the lease no longer exists, :attr:`lost`
    becomes true and the thread stops: the keys attached to the lease are already gone.

    Use as a context manager, or call :meth:`close`.

    Args:
        client: The client to refresh with.
        lease: The lease to keep alive.
        interval: Time between refreshes; well below the lease's TTL.
    """

    def __init__(self, client: EtcdClient, lease: Lease, *, interval: timedelta) -> None:
        if interval.total_seconds() <= 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        if interval >= lease.ttl:
            raise ValueError(
                f"keep-alive interval {interval} must be shorter than the lease TTL {lease.ttl}, "
                "or the lease lapses between refreshes; use about a third of the TTL"
            )
        self._client = client
        self._lease = lease
        self._interval = interval
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._last_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-lease-{lease.id:x}", daemon=True
        )
        self._thread.start()

    @property
    def lease(self) -> Lease:
        """The lease being kept alive."""
        return self._lease

    @property
    def lost(self) -> bool:
        """Whether etcd reported the lease gone (expired or revoked)."""
        return self._lost.is_set()

    @property
    def last_error(self) -> BaseException | None:
        """The most recent refresh failure, if any."""
        return self._last_error

    def wait_lost(self, timeout: timedelta) -> bool:
        """Blocks until the lease is lost or ``timeout`` passes; returns :attr:`lost`."""
        return self._lost.wait(timeout.total_seconds())

    def close(self, *, revoke: bool = False) -> None:
        """Stops refreshing; with ``revoke``, also revokes the lease (deleting its keys)."""
        self._stop.set()
        self._thread.join()
        if revoke and not self.lost:
            self._client.revoke_lease(self._lease)

    def __enter__(self) -> LeaseKeepAlive:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self) -> None:
        interval_s = self._interval.total_seconds()
        while not self._stop.wait(interval_s):
            try:
                self._client.refresh_lease(self._lease, timeout=self._interval)
            except EtcdLeaseNotFound as exc:
                self._last_error = exc
                self._lost.set()
                logger.error("etcd lease %x is gone, keep-alive stops: %s", self._lease.id, exc)
                return
            except Exception as exc:
                # One failed refresh must not kill the keep-alive: the next one may succeed
                # well before the TTL runs out.
                self._last_error = exc
                logger.warning(
                    "refreshing etcd lease %x failed (will retry): %s", self._lease.id, exc
                )
