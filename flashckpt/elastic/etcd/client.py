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

Requests travel on persistent HTTP/1.1 (keep-alive) connections, a few per endpoint, kept by
the client in a small pool: a machine renewing its leases every second sends each renewal on
an open connection instead of a new TCP handshake (with a new connection per request, 512
simulated machines on one host overran etcd's accept queue: ``benchmarks/README.md``,
"Rendezvous at scale"). The retry rule stays unambiguous:

- a request whose connection could not be opened was never seen by etcd and is always retried;
- a pooled connection is reused only after a non-blocking poll finds it quiet (a peer that
  closed it, etcd restarting, leaves it readable) and only if it has been idle less than
  ``_IDLE_TIMEOUT_S``, well under any proxy's or NAT's idle timeout; one whose ``send`` still
  fails (the peer closed it in between) did not carry a complete request, so the request goes
  out again on a fresh connection;
- a request that was sent but got no answer is retried only when repeating it is harmless
  (reads, puts, deletes, lease calls). A compare-and-set whose outcome is unknown is never
  blindly repeated: it raises :class:`EtcdOutcomeUnknown` so that the caller re-reads, since a
  repeated increment would count twice.

A connection goes back to the pool only after its response was read to the end, and never
when etcd said it would close it. Watches (:class:`WatchStream`, also under
:meth:`EtcdClient.watch_events` and :meth:`EtcdClient.wait_for_change`) use connections of their
own, never pooled; a watch stays open across quiet timeouts, and ``watch_events`` goes on with the
stream of the caller's previous call, so a watch loop holds one connection, not one per call. A pool
belongs to the process that filled it: a child forked with a client open starts with an empty
one. :meth:`EtcdClient.close` closes the idle connections.

Keys are ``str`` (UTF-8 encoded) or ``bytes``; values are ``bytes`` (``str`` is UTF-8 encoded).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from flashckpt.elastic.deadline import Deadline
from flashckpt.errors import FlashckptError

__all__ = [
    "ConnectionStats",
    "EtcdClient",
    "EtcdError",
    "EtcdLeaseNotFound",
    "EtcdOutcomeUnknown",
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
    "prefix_end",
]

logger = logging.getLogger(__name__)

Key = str | bytes
Value = str | bytes

_DEFAULT_PORT = 2379
_INITIAL_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0
# Idle connections kept per endpoint; more concurrent requests open more, closed after use.
_MAX_IDLE_PER_ENDPOINT = 4
# A connection idle longer than this is closed, never reused: well under the idle timeouts of
# proxies and NATs (AWS ELB 60 s) that drop a connection without telling either end.
_IDLE_TIMEOUT_S = 20.0
# watch_events keeps a caller's stream open this long between two calls (a watch loop calls
# again at once), and at most this many per client.
_WATCH_KEEP_S = 60.0
_MAX_KEPT_WATCHES = 32
# A watch request etcd has not answered is waited for across calls this long, then the next
# endpoint is tried (an overloaded etcd answers late; reconnecting would add to its load).
_WATCH_OPEN_PATIENCE_S = 30.0
# Errors of a send on a pooled connection that mean the peer had closed it.
_PEER_CLOSED_ERRORS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)

# gRPC status codes that etcd reports in the gateway's error body.
_GRPC_DEADLINE_EXCEEDED = 4
_GRPC_NOT_FOUND = 5
_GRPC_RESOURCE_EXHAUSTED = 8
_GRPC_UNAVAILABLE = 14
# Rejected before being applied ("too many requests"): safe to repeat.
_RETRY_NOT_APPLIED = frozenset({_GRPC_RESOURCE_EXHAUSTED})
# "no leader", "leader changed", "request timed out": the request may or may not have been applied.
_RETRY_MAYBE_APPLIED = frozenset({_GRPC_DEADLINE_EXCEEDED, _GRPC_UNAVAILABLE})


class EtcdError(FlashckptError):
    """Base class of every error raised by :class:`EtcdClient`.

    Raised as such when etcd rejected a request (for example a malformed key), which retrying
    cannot fix.
    """


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


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as stored in etcd."""

    key: bytes
    """The key."""
    value: bytes
    """The value (``b""`` for an empty value)."""
    mod_revision: int
    """Revision of the last write to this key; the token for :meth:`EtcdClient.compare_and_set`."""
    create_revision: int
    """Revision at which this key was created (again, after a delete)."""
    version: int
    """Number of writes since the key was created."""
    lease: int
    """ID of the lease the key is attached to, ``0`` if none."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease granted by etcd; keys put with it are deleted when it expires or is revoked."""

    id: int
    """The lease ID."""
    ttl: timedelta
    """The TTL etcd granted (etcd may raise a too-small requested TTL to its minimum)."""


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change of one key, from :meth:`EtcdClient.watch_events` or a :class:`WatchStream`."""

    deleted: bool
    """``True`` for a delete (or a lease's expiry or revocation), ``False`` for a put."""
    kv: KeyValue
    """The key as written (for a delete: the key and the delete's revision, no value)."""
    prev: KeyValue | None
    """The key just before this change; ``None`` when it did not exist, etcd no longer had
    it, or the watch did not ask for previous values."""


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


@dataclass(frozen=True, slots=True)
class _Endpoint:
    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


class _AttemptFailed(FlashckptError):
    """One request to one endpoint failed in a way that another attempt may fix."""

    def __init__(self, message: str, *, sent: bool, timed_out: bool) -> None:
        super().__init__(message)
        self.sent = sent
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class ConnectionStats:
    """What a client's connection pool did so far (diagnostics and tests; watches not
    counted)."""

    opened: int
    """Connections opened for requests."""
    reused: int
    """Requests sent on a connection an earlier request had used."""
    replaced: int
    """Pooled connections found closed by the peer (by the poll before reuse, or by a ``send``
    that failed) and replaced by another before the request went out."""
    expired: int
    """Pooled connections closed because they had been idle longer than the idle timeout."""
    idle: int
    """Connections idle in the pool now."""


class _Pool:
    """Idle keep-alive connections per endpoint, for one process (``pid``)."""

    def __init__(self, *, closed: bool = False) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.closed = closed
        # Per endpoint, oldest first: (connection, monotonic time it went idle).
        self.idle: dict[_Endpoint, list[tuple[http.client.HTTPConnection, float]]] = {}
        self.opened = self.reused = self.replaced = self.expired = 0
        # watch_events' open streams, per (thread, key, range end): (stream, time given back).
        self.watches: dict[tuple[int, bytes, bytes | None], tuple[WatchStream, float]] = {}

    def take(self, endpoint: _Endpoint) -> http.client.HTTPConnection | None:
        """The most recently used idle connection to ``endpoint`` that is still usable, or
        None; closes the ones that are not."""
        drop: list[http.client.HTTPConnection] = []
        found = None
        with self.lock:
            conns = self.idle.get(endpoint, [])
            cutoff = time.monotonic() - _IDLE_TIMEOUT_S
            while conns and conns[0][1] < cutoff:
                drop.append(conns.pop(0)[0])
                self.expired += 1
            while conns:
                conn = conns.pop()[0]
                if _peer_closed(conn):
                    drop.append(conn)
                    self.replaced += 1
                    continue
                found = conn
                self.reused += 1
                break
        for conn in drop:
            conn.close()
        return found

    def give(self, endpoint: _Endpoint, conn: http.client.HTTPConnection) -> None:
        """Keeps ``conn`` (its last response read to the end) for the next request, or closes
        it when the pool is full or closed."""
        with self.lock:
            conns = self.idle.setdefault(endpoint, [])
            keep = not self.closed and self.pid == os.getpid()
            keep = keep and len(conns) < _MAX_IDLE_PER_ENDPOINT
            if keep:
                conns.append((conn, time.monotonic()))
        if not keep:
            conn.close()

    def take_watch(
        self, slot: tuple[int, bytes, bytes | None], next_revision: int
    ) -> WatchStream | None:
        """The open stream of ``slot`` if it goes on at ``next_revision``; closes streams
        nobody came back for within ``_WATCH_KEEP_S`` (their thread stopped watching)."""
        drop: list[WatchStream] = []
        with self.lock:
            found = self.watches.pop(slot, None)
            cutoff = time.monotonic() - _WATCH_KEEP_S
            for other, (stream, since) in list(self.watches.items()):
                if since < cutoff:
                    del self.watches[other]
                    drop.append(stream)
        if found is not None and found[0].next_revision != next_revision:
            drop.append(found[0])
            found = None
        for stream in drop:
            stream.close()
        return None if found is None else found[0]

    def give_watch(self, slot: tuple[int, bytes, bytes | None], stream: WatchStream) -> None:
        """Keeps ``stream`` open for the next call of ``slot``'s thread."""
        with self.lock:
            keep = not self.closed and self.pid == os.getpid()
            if keep:
                self.watches[slot] = (stream, time.monotonic())
                while len(self.watches) > _MAX_KEPT_WATCHES:
                    oldest = min(self.watches, key=lambda k: self.watches[k][1])
                    if oldest == slot:
                        break
                    other = self.watches.pop(oldest)[0]
                    other.close()
        if not keep:
            stream.close()

    def count(self, *, opened: int = 0, replaced: int = 0) -> None:
        with self.lock:
            self.opened += opened
            self.replaced += replaced

    def stats(self) -> ConnectionStats:
        with self.lock:
            return ConnectionStats(
                opened=self.opened,
                reused=self.reused,
                replaced=self.replaced,
                expired=self.expired,
                idle=sum(len(c) for c in self.idle.values()),
            )

    def close(self) -> None:
        """Closes the idle connections; connections in use are closed when given back."""
        with self.lock:
            self.closed = True
            conns = [c for per in self.idle.values() for c, _ in per]
            self.idle.clear()
            streams = [stream for stream, _ in self.watches.values()]
            self.watches.clear()
        for conn in conns:
            conn.close()
        for stream in streams:
            stream.close()

    def abandon(self) -> None:
        """In a forked child: closes this process's copies of the parent's sockets, without
        the lock (a parent thread may have held it at the fork) and without touching the
        connections' state, which is the parent's (closing a descriptor here sends nothing)."""
        for per in list(self.idle.values()):
            for conn, _ in list(per):
                if conn.sock is not None:
                    conn.sock.close()
        for stream, _ in list(self.watches.values()):
            stream._abandon()


def _peer_closed(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle keep-alive connection is unusable: readable (the peer's FIN or RST, or
    bytes nobody asked for) or closed. ``poll``, not ``select``: a process may hold more than
    1,024 descriptors."""
    sock = conn.sock
    if sock is None:
        return True
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """Normalizes etcd endpoints to a list of ``scheme://host:port`` URLs.

    Args:
        endpoints: One endpoint, several separated by commas, or a sequence of them. Each is
            ``host``, ``host:port``, ``[v6addr]:port`` or ``http(s)://host:port``; the default
            port is 2379 and the default scheme ``http``.

    Returns:
        The endpoints as URLs, in the given order.

    Raises:
        ValueError: If there is no endpoint, or one is not a valid ``host:port``/URL.
    """
    return [e.url for e in _parse_endpoints(endpoints)]


def _parse_endpoints(endpoints: str | Sequence[str]) -> list[_Endpoint]:
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed: list[_Endpoint] = []
    for raw in items:
        text = raw.strip()
        if not text:
            continue
        url = text if "://" in text else f"http://{text}"
        try:
            parts = urlsplit(url)
            port = parts.port or _DEFAULT_PORT
        except ValueError as exc:
            raise ValueError(
                f"invalid etcd endpoint {raw!r}: {exc}; use host:port or http://host:port"
            ) from exc
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"invalid etcd endpoint {raw!r}: expected host:port, http://host:port or "
                "https://host:port"
            )
        if parts.path not in ("", "/"):
            raise ValueError(
                f"invalid etcd endpoint {raw!r}: it must not have a path ({parts.path!r}); "
                "give the client URL only, e.g. http://127.0.0.1:2379"
            )
        parsed.append(_Endpoint(parts.scheme, parts.hostname, port))
    if not parsed:
        raise ValueError(
            f"no etcd endpoint given ({endpoints!r}); pass e.g. 'http://127.0.0.1:2379' or "
            "'host1:2379,host2:2379'"
        )
    return parsed


def _to_bytes(data: Key | Value, what: str) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode()
    raise TypeError(f"etcd {what} must be str or bytes, got {type(data).__name__}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _mod_revision_is(key_b64: str, mod_revision: int) -> dict[str, str]:
    """A transaction compare that holds while the key was last modified at ``mod_revision``
    (0: the key is absent)."""
    return {"key": key_b64, "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _prefix_range_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # With key b"\x00" this means "every key".


def prefix_end(prefix: Key) -> bytes:
    """The end of the range of every key that starts with ``prefix`` (for
    :meth:`EtcdClient.counts`)."""
    return _prefix_range_end(_to_bytes(prefix, "prefix"))


def _prefix_range(prefix: bytes) -> dict[str, Any]:
    """The range-request fields that select every key starting with ``prefix``."""
    return {"key": _b64(prefix or b"\x00"), "range_end": _b64(_prefix_range_end(prefix))}


def _lease_id(lease: Lease | int) -> int:
    return lease.id if isinstance(lease, Lease) else int(lease)


def _ttl_seconds(ttl: timedelta) -> int:
    seconds = ttl.total_seconds()
    if seconds < 1:
        raise ValueError(f"lease ttl must be at least 1 second (etcd's unit), got {ttl!r}")
    return int(-(-seconds // 1))  # ceil: never grant less than asked


def _kv_from_json(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(raw.get("key")),
        value=_unb64(raw.get("value")),
        mod_revision=int(raw.get("mod_revision", 0)),
        create_revision=int(raw.get("create_revision", 0)),
        version=int(raw.get("version", 0)),
        lease=int(raw.get("lease", 0)),
    )


def _header_revision(response: dict[str, Any]) -> int:
    return int(response.get("header", {}).get("revision", 0))


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

    Raises:
        ValueError: If no endpoint is given or a timeout is not positive.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: timedelta,
        connect_timeout: timedelta = timedelta(seconds=2),
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if connect_timeout.total_seconds() <= 0:
            raise ValueError(f"connect_timeout must be positive, got {connect_timeout!r}")
        self._endpoints = _parse_endpoints(endpoints)
        self._timeout = timeout
        self._connect_timeout_s = connect_timeout.total_seconds()
        self._ssl_context = ssl_context
        self._lock = threading.Lock()
        self._preferred = 0  # index of the endpoint that answered last
        self._pool = _Pool()

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints, as URLs."""
        return tuple(e.url for e in self._endpoints)

    @property
    def timeout(self) -> timedelta:
        """The default deadline of each call."""
        return self._timeout

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(self.endpoints)!r}, timeout={self._timeout!r})"

    def close(self) -> None:
        """Closes the pooled connections (a request in flight closes its own when done).

        Calls made after it still work, each on a connection of its own; watches and
        :class:`LeaseKeepAlive` threads are not stopped (close those first).
        """
        self._pool_here().close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def connection_stats(self) -> ConnectionStats:
        """What the connection pool of this process did so far: connections opened, requests
        that reused one, stale ones replaced, idle ones now."""
        return self._pool_here().stats()

    def _pool_here(self) -> _Pool:
        """This process's pool: a child forked from a process with open connections must not
        share them (two processes' requests and answers would interleave on one socket)."""
        pool = self._pool
        if pool.pid != os.getpid():
            with self._lock:
                pool = self._pool
                if pool.pid != os.getpid():
                    pool.abandon()
                    pool = self._pool = _Pool(closed=pool.closed)
        return pool

    # ----------------------------------------------------------------------------- key-value

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
        body = {"key": _b64(_to_bytes(key, "key"))}
        response = self._call("/v3/kv/range", body, timeout=timeout, idempotent=True)
        kvs = response.get("kvs") or []
        return _kv_from_json(kvs[0]) if kvs else None

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
        ranges = [{"request_range": {"key": _b64(_to_bytes(k, "key"))}} for k in keys]
        response = self._call("/v3/kv/txn", {"success": ranges}, timeout=timeout, idempotent=True)
        found: list[KeyValue | None] = []
        for item in response.get("responses") or []:
            kvs = item.get("response_range", {}).get("kvs") or []
            found.append(_kv_from_json(kvs[0]) if kvs else None)
        if len(found) != len(keys):
            raise EtcdError(
                f"etcd answered {len(found)} ranges for {len(keys)} keys; the server or a proxy "
                "in between mangled the transaction"
            )
        return found, _header_revision(response)

    def get_prefix(self, prefix: Key, *, timeout: timedelta | None = None) -> list[KeyValue]:
        """Reads every key that starts with ``prefix``, sorted by key."""
        return self.get_prefix_with_revision(prefix, timeout=timeout)[0]

    def get_prefix_with_revision(
        self, prefix: Key, *, timeout: timedelta | None = None
    ) -> tuple[list[KeyValue], int]:
        """Like :meth:`get_prefix`, also returning the store revision of the snapshot."""
        body = _prefix_range(_to_bytes(prefix, "prefix"))
        response = self._call("/v3/kv/range", body, timeout=timeout, idempotent=True)
        kvs = [_kv_from_json(raw) for raw in response.get("kvs") or []]
        return kvs, _header_revision(response)

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
        body: dict[str, Any] = {
            "key": _b64(_to_bytes(start, "key")),
            "range_end": _b64(_to_bytes(end, "key")),
        }
        if limit:
            body["limit"] = str(limit)
        if keys_only:
            body["keys_only"] = True
        response = self._call("/v3/kv/range", body, timeout=timeout, idempotent=True)
        return [_kv_from_json(raw) for raw in response.get("kvs") or []]

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
        ranges = []
        for key, range_end, min_mod_revision in queries:
            request: dict[str, Any] = {"key": _b64(_to_bytes(key, "key"))}
            if range_end is not None:
                request["range_end"] = _b64(_to_bytes(range_end, "range end"))
            if min_mod_revision:
                # etcd's count ignores the revision filter, so the (few) keys it keeps are
                # listed, without their values.
                request["keys_only"] = True
                request["min_mod_revision"] = str(min_mod_revision)
            else:
                request["count_only"] = True
            ranges.append({"request_range": request})
        response = self._call("/v3/kv/txn", {"success": ranges}, timeout=timeout, idempotent=True)
        found = []
        for (_, _, min_mod_revision), item in zip(
            queries, response.get("responses") or [], strict=False
        ):
            answer = item.get("response_range", {})
            found.append(
                len(answer.get("kvs") or []) if min_mod_revision else int(answer.get("count", 0))
            )
        if len(found) != len(queries):
            raise EtcdError(
                f"etcd answered {len(found)} ranges for {len(queries)} counts; the server or a "
                "proxy in between mangled the transaction"
            )
        return found, _header_revision(response)

    def count_prefix(self, prefix: Key, *, timeout: timedelta | None = None) -> int:
        """Counts the keys that start with ``prefix`` without reading their values."""
        body: dict[str, Any] = {**_prefix_range(_to_bytes(prefix, "prefix")), "count_only": True}
        response = self._call("/v3/kv/range", body, timeout=timeout, idempotent=True)
        return int(response.get("count", 0))

    def revision(self, *, timeout: timedelta | None = None) -> int:
        """The current revision of the whole store."""
        body = {"key": _b64(b"\x00"), "count_only": True}
        return _header_revision(self._call("/v3/kv/range", body, timeout=timeout, idempotent=True))

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
        body: dict[str, Any] = {
            "key": _b64(_to_bytes(key, "key")),
            "value": _b64(_to_bytes(value, "value")),
        }
        if lease is not None:
            body["lease"] = str(_lease_id(lease))
        return _header_revision(self._call("/v3/kv/put", body, timeout=timeout, idempotent=True))

    def delete(self, key: Key, *, timeout: timedelta | None = None) -> bool:
        """Deletes one key.

        Returns:
            Whether the key existed. After a retried attempt whose first try was applied but
            not answered, this is ``False`` although the key is gone.
        """
        body = {"key": _b64(_to_bytes(key, "key"))}
        response = self._call("/v3/kv/deleterange", body, timeout=timeout, idempotent=True)
        return int(response.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: Key, *, timeout: timedelta | None = None) -> int:
        """Deletes every key that starts with ``prefix``; returns how many were deleted.

        Raises:
            ValueError: If ``prefix`` is empty (that would delete the whole cluster's data).
        """
        start = _to_bytes(prefix, "prefix")
        if not start:
            raise ValueError("refusing to delete with an empty prefix: it would delete every key")
        body = {"key": _b64(start), "range_end": _b64(_prefix_range_end(start))}
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
        key_b64 = _b64(_to_bytes(key, "key"))
        value_bytes = _to_bytes(value, "value")
        put: dict[str, Any] = {"key": key_b64, "value": _b64(value_bytes)}
        if lease is not None:
            put["lease"] = str(_lease_id(lease))
        body = {
            "compare": [_mod_revision_is(key_b64, mod_revision)],
            # Reading the key back inside the transaction returns the new entry atomically.
            "success": [{"request_put": put}, {"request_range": {"key": key_b64}}],
            "failure": [{"request_range": {"key": key_b64}}],
        }
        response = self._call("/v3/kv/txn", body, timeout=timeout, idempotent=False)
        succeeded = bool(response.get("succeeded"))
        responses = response.get("responses") or []
        kvs = responses[-1].get("response_range", {}).get("kvs") if responses else None
        current = _kv_from_json(kvs[0]) if kvs else None
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
        key_b64 = _b64(_to_bytes(key, "key"))
        body = {
            "compare": [_mod_revision_is(key_b64, mod_revision)],
            "success": [{"request_delete_range": {"key": key_b64}}],
        }
        response = self._call("/v3/kv/txn", body, timeout=timeout, idempotent=False)
        return bool(response.get("succeeded"))

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
        key_bytes = _to_bytes(key, "key") or b"\x00"
        range_end = _prefix_range_end(key_bytes) if prefix else None
        stream = WatchStream(self, key_bytes, range_end, after_revision + 1)
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
        key_bytes = _to_bytes(key, "key") or b"\x00"
        range_end = _prefix_range_end(key_bytes) if prefix else None
        slot = (threading.get_ident(), key_bytes, range_end)
        pool = self._pool_here()
        stream = pool.take_watch(slot, after_revision + 1)
        if stream is None:
            stream = WatchStream(self, key_bytes, range_end, after_revision + 1, prev_kv=True)
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
            "/v3/lease/grant", {"TTL": _ttl_seconds(ttl)}, timeout=timeout, idempotent=True
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
        lease_id = _lease_id(lease)
        response = self._call(
            "/v3/lease/keepalive", {"ID": str(lease_id)}, timeout=timeout, idempotent=True
        )
        result = response.get("result") or {}
        if "error" in response:
            raise EtcdError(f"etcd failed to refresh lease {lease_id:x}: {response['error']}")
        ttl = int(result.get("TTL", 0))
        if ttl <= 0:
            raise EtcdLeaseNotFound(
                f"lease {lease_id:x} has expired or was revoked; grant a new lease and put the "
                "keys again"
            )
        return timedelta(seconds=ttl)

    def revoke_lease(self, lease: Lease | int, *, timeout: timedelta | None = None) -> bool:
        """Revokes a lease, deleting every key attached to it.

        Returns:
            ``True`` if etcd revoked it, ``False`` if it was already gone.
        """
        try:
            self._call(
                "/v3/lease/revoke",
                {"ID": str(_lease_id(lease))},
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

    # ----------------------------------------------------------------------------- transport

    def _attempts(self, deadline: Deadline) -> Iterator[_Endpoint]:
        """The endpoint of each attempt of one call, endlessly: every endpoint in turn from the
        preferred one, and after each round a pause that doubles up to ``_MAX_BACKOFF_S``. The
        caller stops when an attempt succeeds or its deadline has passed."""
        backoff = _INITIAL_BACKOFF_S
        attempt = 0
        while True:
            yield self._endpoint_for(attempt)
            attempt += 1
            if attempt % len(self._endpoints) == 0:
                deadline.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)

    def _endpoint_for(self, attempt: int) -> _Endpoint:
        with self._lock:
            preferred = self._preferred
        return self._endpoints[(preferred + attempt) % len(self._endpoints)]

    def _prefer(self, endpoint: _Endpoint) -> None:
        with self._lock:
            self._preferred = self._endpoints.index(endpoint)

    def _call(
        self,
        path: str,
        body: dict[str, Any],
        *,
        timeout: timedelta | None,
        idempotent: bool,
    ) -> dict[str, Any]:
        """POSTs ``body`` to ``path``, retrying across endpoints until the deadline."""
        budget = timeout if timeout is not None else self._timeout
        deadline = Deadline.after(budget)
        payload = json.dumps(body).encode()
        for endpoint in self._attempts(deadline):
            try:
                response = self._post_once(endpoint, path, payload, deadline)
            except _AttemptFailed as exc:
                if exc.sent and not idempotent:
                    raise EtcdOutcomeUnknown(
                        f"etcd at {endpoint.url} took {path} but its answer was lost ({exc}); "
                        "the write may or may not have been applied: re-read the key before "
                        "retrying"
                    ) from exc
                if deadline.expired():
                    error = EtcdTimeout if exc.timed_out else EtcdUnavailable
                    raise error(
                        f"etcd did not complete {path} within {budget.total_seconds():g} s; "
                        f"tried {list(self.endpoints)}, last error: {exc}. Check that etcd is "
                        "running and reachable from this machine, or raise the timeout."
                    ) from exc
                logger.debug("etcd %s on %s failed, retrying: %s", path, endpoint.url, exc)
            else:
                self._prefer(endpoint)
                return response
        raise AssertionError("unreachable: _attempts never ends")

    def _connect(self, endpoint: _Endpoint, deadline: Deadline) -> http.client.HTTPConnection:
        connect_timeout = max(0.001, min(self._connect_timeout_s, deadline.remaining()))
        conn: http.client.HTTPConnection
        if endpoint.scheme == "https":
            conn = http.client.HTTPSConnection(
                endpoint.host, endpoint.port, timeout=connect_timeout, context=self._ssl_context
            )
        else:
            conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=connect_timeout)
        try:
            conn.connect()
        except ssl.SSLCertVerificationError as exc:
            conn.close()
            # Retrying cannot fix a certificate etcd's CA did not sign: fail now, not at the
            # deadline.
            raise EtcdError(
                f"TLS verification of {endpoint.url} failed: {exc.verify_message}; pass the CA "
                "that signed etcd's certificate (rendezvous option ca_cert, or an ssl_context "
                "loaded with it)"
            ) from exc
        except OSError as exc:
            conn.close()
            raise _AttemptFailed(
                f"cannot connect to {endpoint.url}: {exc!r}",
                sent=False,
                timed_out=isinstance(exc, TimeoutError),
            ) from exc
        assert conn.sock is not None
        conn.sock.settimeout(max(0.001, deadline.remaining()))
        return conn

    def _post_once(
        self, endpoint: _Endpoint, path: str, payload: bytes, deadline: Deadline
    ) -> dict[str, Any]:
        pool = self._pool_here()
        while True:
            conn = pool.take(endpoint)
            reused = conn is not None
            if conn is None:
                conn = self._connect(endpoint, deadline)
                pool.count(opened=1)
            try:
                assert conn.sock is not None
                conn.sock.settimeout(max(0.001, deadline.remaining()))
                conn.request("POST", path, body=payload, headers=_HEADERS)
            except _PEER_CLOSED_ERRORS as exc:
                conn.close()
                if reused:
                    # The peer closed the pooled connection after the poll: sendall failed, so
                    # etcd never received the whole request. Send it on another connection.
                    pool.count(replaced=1)
                    logger.debug("pooled connection to %s was closed: %r", endpoint.url, exc)
                    continue
                raise _AttemptFailed(
                    f"{endpoint.url}{path} failed after the request was sent: {exc!r}",
                    sent=True,
                    timed_out=False,
                ) from exc
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise _AttemptFailed(
                    f"{endpoint.url}{path} failed after the request was sent: {exc!r}",
                    sent=True,
                    timed_out=isinstance(exc, TimeoutError),
                ) from exc
            except BaseException:
                conn.close()
                raise
            break
        try:
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _AttemptFailed(
                f"{endpoint.url}{path} failed after the request was sent: {exc!r}",
                sent=True,
                timed_out=isinstance(exc, TimeoutError),
            ) from exc
        except BaseException:
            conn.close()
            raise
        if response.will_close:
            conn.close()
        else:
            pool.give(endpoint, conn)  # its response was read to the end
        if response.status == 200:
            return _parse_json(data, endpoint, path)
        raise _error_from_response(response.status, data, endpoint, path)


_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


def _parse_json(data: bytes, endpoint: _Endpoint, path: str) -> dict[str, Any]:
    try:
        parsed = json.loads(data)
    except ValueError as exc:
        raise EtcdError(
            f"{endpoint.url}{path} answered something that is not JSON ({data[:200]!r}); is "
            "this endpoint an etcd v3.4+ client URL?"
        ) from exc
    if not isinstance(parsed, dict):
        raise EtcdError(f"{endpoint.url}{path} answered unexpected JSON: {data[:200]!r}")
    return parsed


def _error_from_response(status: int, data: bytes, endpoint: _Endpoint, path: str) -> Exception:
    """Maps an HTTP error answer to a final :class:`EtcdError` or a retryable failure."""
    code: int | None = None
    message = data[:500].decode(errors="replace")
    try:
        parsed = json.loads(data)
        if isinstance(parsed, dict):
            code = int(parsed["code"]) if "code" in parsed else None
            message = str(parsed.get("message") or parsed.get("error") or message)
    except ValueError:
        pass
    where = f"{endpoint.url}{path}"
    if code in _RETRY_NOT_APPLIED:
        return _AttemptFailed(f"{where}: {message}", sent=False, timed_out=False)
    if code in _RETRY_MAYBE_APPLIED or (code is None and status >= 500):
        return _AttemptFailed(
            f"{where}: HTTP {status}: {message}",
            sent=True,
            timed_out=code == _GRPC_DEADLINE_EXCEEDED or "timed out" in message,
        )
    if code == _GRPC_NOT_FOUND and "lease" in message:
        return EtcdLeaseNotFound(
            f"{where}: {message}; the lease expired or was revoked: grant a new one"
        )
    if status == 404 and code is None:
        return EtcdError(
            f"{where} does not exist (HTTP 404); this client needs etcd >= 3.4 with its v3 "
            "JSON gateway on the client URL"
        )
    return EtcdError(
        f"etcd rejected {path} at {endpoint.url}: HTTP {status}, code {code}: {message}"
    )


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


class WatchStream:
    """A long-lived etcd watch: the events of the keys in ``[key, range_end)`` from
    ``start_revision`` on, each with the key's new value (and its previous one, with
    ``prev_kv``), so a follower applies each change in O(1) instead of re-reading the keys.

    - :meth:`next_events` blocks until events arrive or its timeout passes; the stream stays
      open across quiet timeouts (one connection for as long as the watch lives);
    - a broken stream (etcd restarted, a leader change, a proxy) is opened again from the
      revision after the last event returned, on any endpoint of the client, so no event is
      lost or repeated;
    - when etcd compacted the revisions the stream still needs, :class:`WatchCompacted` is
      raised: re-read the keys and open a new stream from the revision of that read;
    - :meth:`close` may be called from another thread and wakes a blocked reader.

    It speaks the JSON gateway's ``/v3/watch`` (a chunked HTTP/1.1 response, one JSON message
    per line) on a connection of its own, never a pooled one, with the client's endpoints, TLS
    settings and back-off. It reads the socket itself: a socket file that timed out once cannot
    be read again, which would cost a new connection per quiet timeout.

    Args:
        client: The etcd client (its endpoints and TLS settings are used).
        key: First key of the range.
        range_end: End of the range (exclusive); ``None``: the single key ``key``.
        start_revision: First revision to report.
        prev_kv: Also report each key's previous value (a delete then says what was deleted).
    """

    def __init__(
        self,
        client: EtcdClient,
        key: bytes,
        range_end: bytes | None,
        start_revision: int,
        *,
        prev_kv: bool = False,
    ) -> None:
        if start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, got {start_revision}")
        self._client = client
        self._key = key
        self._range_end = range_end
        self._next = start_revision
        self._prev_kv = prev_kv
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._endpoint: _Endpoint | None = None
        self._raw = bytearray()  # received, not yet de-chunked
        self._body = bytearray()  # de-chunked, not yet a whole line
        self._chunk_left = 0  # bytes of the current chunk still to come (+2 for its CRLF)
        self._closed = False
        self._reading = False  # a thread is in next_events
        self._opened_at: float | None = None  # when the pending watch request was sent
        self.connections = 0
        """Connections this stream opened (diagnostics and tests)."""

    @property
    def next_revision(self) -> int:
        """The first revision not reported yet."""
        return self._next

    def close(self) -> None:
        """Ends the stream; a reader blocked in :meth:`next_events` gets :class:`WatchClosed`."""
        with self._lock:
            self._closed = True
            sock = self._sock
            if not self._reading:
                self._sock = None
        if sock is not None:
            # shutdown wakes a blocked reader, which then closes the socket itself (closing a
            # descriptor another thread is reading could hand its number to a new socket).
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            if self._sock is None:
                sock.close()

    def next_events(self, timeout: timedelta) -> list[WatchEvent]:
        """The next events, in revision order; ``[]`` when ``timeout`` passed without any.

        Raises:
            WatchCompacted: The revisions still to report were compacted.
            WatchClosed: :meth:`close` was called.
            EtcdUnavailable: No endpoint accepted the watch for the whole ``timeout``.
            EtcdError: etcd refused the watch (a request retrying cannot fix).
        """
        with self._lock:
            if self._reading:
                raise RuntimeError("WatchStream.next_events is already running in another thread")
            self._reading = True
        try:
            return self._next_events(timeout)
        except EtcdError:
            self._drop()
            raise
        finally:
            with self._lock:
                self._reading = False
            if self._closed:
                self._drop()

    def _next_events(self, timeout: timedelta) -> list[WatchEvent]:
        deadline = Deadline.after(timeout)
        failures = 0
        while True:
            if self._closed:
                raise WatchClosed("the watch was closed")
            try:
                if self._sock is None:
                    self._open(deadline)
                if not self._answered(deadline):
                    return []  # etcd has not answered yet; the request stays pending
                events = self._read(deadline)
            except _AttemptFailed as exc:
                self._drop()
                if self._closed:
                    raise WatchClosed("the watch was closed") from None
                failures += 1
                if deadline.expired():
                    if exc.sent:
                        return []  # it was connected; the stream just stayed quiet
                    raise EtcdUnavailable(
                        f"no etcd endpoint of {list(self._client.endpoints)} accepted a watch "
                        f"within {timeout.total_seconds():g} s: {exc}. Check that etcd is "
                        "running and reachable from this machine."
                    ) from exc
                logger.debug("etcd watch failed, reconnecting: %s", exc)
                deadline.sleep(min(_MAX_BACKOFF_S, _INITIAL_BACKOFF_S * 2 ** min(failures, 5)))
                continue
            if events is None:
                return []  # the deadline passed; the stream stays open
            if events:
                return events

    # ------------------------------------------------------------------------ transport

    def _open(self, deadline: Deadline) -> None:
        request: dict[str, Any] = {"key": _b64(self._key), "start_revision": str(self._next)}
        if self._range_end is not None:
            request["range_end"] = _b64(self._range_end)
        if self._prev_kv:
            request["prev_kv"] = True
        payload = json.dumps({"create_request": request}).encode()
        client = self._client
        endpoint = client._endpoint_for(0)  # the one that answered last
        try:
            conn = client._connect(endpoint, deadline)
        except _AttemptFailed:
            client._prefer(client._endpoint_for(1))  # try the next one next time
            raise
        sock = conn.sock
        assert sock is not None
        conn.sock = None  # this stream owns the socket from here
        with self._lock:
            if self._closed:
                sock.close()
                raise _AttemptFailed("closed", sent=False, timed_out=False)
            self._sock, self._endpoint = sock, endpoint
            self.connections += 1
        self._raw.clear()
        self._body.clear()
        self._chunk_left = 0
        host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
        head = (
            f"POST /v3/watch HTTP/1.1\r\nHost: {host}:{endpoint.port}\r\n"
            "Content-Type: application/json\r\nAccept: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        try:
            sock.settimeout(max(0.001, deadline.remaining()))
            sock.sendall(head.encode() + payload)
        except OSError as exc:
            raise _AttemptFailed(
                f"watch on {endpoint.url} failed: {exc!r}", sent=False, timed_out=False
            ) from exc
        self._opened_at = time.monotonic()  # its answer is awaited (_answered)

    def _answered(self, deadline: Deadline) -> bool:
        """Reads etcd's answer to the watch request: False when the deadline passed first (the
        request stays pending, and the next call waits on: an overloaded etcd answers late, and
        a new request would only add to its load); after ``_WATCH_OPEN_PATIENCE_S`` without an
        answer, the endpoint counts as failed and the next one is tried."""
        if self._opened_at is None:
            return True
        endpoint = self._endpoint
        assert endpoint is not None
        if time.monotonic() - self._opened_at > _WATCH_OPEN_PATIENCE_S:
            self._client._prefer(self._client._endpoint_for(1))
            raise _AttemptFailed(
                f"watch on {endpoint.url}: no answer to the watch request in "
                f"{_WATCH_OPEN_PATIENCE_S:g} s",
                sent=False,
                timed_out=True,
            )
        try:
            head = self._read_head(deadline)
        except (OSError, ValueError) as exc:
            raise _AttemptFailed(
                f"watch on {endpoint.url} failed: {exc!r}", sent=False, timed_out=False
            ) from exc
        if head is None:
            return False
        self._opened_at = None
        status, headers = head
        if status != 200:
            body = self._read_error_body(headers, deadline)
            error = _error_from_response(status, body, endpoint, "/v3/watch")
            if isinstance(error, _AttemptFailed):
                error.sent = False  # a refused watch changed nothing: try again
            raise error
        if "chunked" not in headers.get("transfer-encoding", ""):
            raise EtcdError(
                f"{endpoint.url}/v3/watch answered without a chunked stream ({headers}); is "
                "this an etcd v3.4+ client URL, with no proxy that buffers responses?"
            )
        return True

    def _recv(self, deadline: Deadline) -> bool:
        """Receives more bytes into ``_raw``: False when the deadline passed first."""
        sock = self._sock
        if sock is None:
            raise OSError("the watch connection was closed")
        remaining = deadline.remaining()
        if remaining <= 0:
            return False
        sock.settimeout(remaining)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return False
        if not data:
            raise ConnectionError("etcd ended the watch stream")
        self._raw += data
        return True

    def _read_head(self, deadline: Deadline) -> tuple[int, dict[str, str]] | None:
        while b"\r\n\r\n" not in self._raw:
            if len(self._raw) > 65536:
                raise ValueError("an HTTP head of more than 64 KiB")
            if not self._recv(deadline):
                return None
        end = self._raw.index(b"\r\n\r\n")
        lines = bytes(self._raw[:end]).decode("latin-1").split("\r\n")
        del self._raw[: end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise ValueError(f"not an HTTP answer: {lines[0][:100]!r}")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        return int(parts[1]), headers

    def _read_error_body(self, headers: dict[str, str], deadline: Deadline) -> bytes:
        """The body of an error answer (best effort: a few KiB at most)."""
        with contextlib.suppress(OSError, ValueError):
            want = min(int(headers.get("content-length", "0")), 8192)
            while len(self._raw) < want and self._recv(deadline):
                pass
        return bytes(self._raw[:8192])

    def _next_line(self) -> bytes | None:
        """De-chunks what ``_raw`` holds into ``_body``; returns one whole line, if any."""
        while True:
            newline = self._body.find(b"\n")
            if newline >= 0:
                line = bytes(self._body[: newline + 1])
                del self._body[: newline + 1]
                return line
            if self._chunk_left > 0:
                if not self._raw:
                    return None
                take = min(len(self._raw), self._chunk_left)
                data = self._raw[:take]
                del self._raw[:take]
                self._chunk_left -= take
                # The chunk's trailing CRLF (the last 2 bytes counted) is not data.
                keep = len(data) - max(0, 2 - self._chunk_left)
                self._body += data[: max(0, keep)]
                continue
            end = self._raw.find(b"\r\n")
            if end < 0:
                if len(self._raw) > 1024:
                    raise ValueError("a chunk header of more than 1 KiB")
                return None
            size = int(bytes(self._raw[:end]).split(b";")[0].strip() or b"0", 16)
            del self._raw[: end + 2]
            if size == 0:
                raise ConnectionError("etcd ended the watch stream")
            self._chunk_left = size + 2

    def _read(self, deadline: Deadline) -> list[WatchEvent] | None:
        endpoint = self._endpoint.url if self._endpoint is not None else "etcd"
        while True:
            try:
                line = self._next_line()
                if line is None:
                    if not self._recv(deadline):
                        return None
                    continue
                message = json.loads(line)
            except (OSError, ValueError) as exc:
                raise _AttemptFailed(
                    f"watch stream from {endpoint} broke: {exc!r}", sent=True, timed_out=False
                ) from exc
            if not isinstance(message, dict):
                raise _AttemptFailed(
                    f"unexpected watch message {line[:200]!r}", sent=True, timed_out=False
                )
            if "error" in message:
                # A broken watch (for example after a leader change): open it again.
                raise _AttemptFailed(
                    f"watch error from {endpoint}: {message['error']}", sent=True, timed_out=False
                )
            result = message.get("result") or {}
            compact = int(result.get("compact_revision", 0) or 0)
            if compact > 0:
                self._drop()
                raise WatchCompacted(
                    f"etcd compacted revisions up to {compact}; the watch needed "
                    f"{self._next} on: re-read the keys",
                    compact,
                )
            if result.get("canceled"):
                raise _AttemptFailed(
                    f"etcd canceled the watch: {result}", sent=True, timed_out=False
                )
            events: list[WatchEvent] = []
            for raw in result.get("events") or []:
                kv = _kv_from_json(raw.get("kv") or {})
                if kv.mod_revision < self._next:
                    continue  # already reported before a reconnect
                prev = raw.get("prev_kv")
                events.append(
                    WatchEvent(
                        deleted=raw.get("type") == "DELETE",
                        kv=kv,
                        prev=_kv_from_json(prev) if prev else None,
                    )
                )
            if events:
                self._next = max(e.kv.mod_revision for e in events) + 1
                return events

    def _drop(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _abandon(self) -> None:
        """In a forked child: closes this process's copy of the socket, nothing else."""
        sock = self._sock
        if sock is not None:
            sock.close()
