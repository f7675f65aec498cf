"""The transport of the etcd client: etcd's v3 JSON gateway over pooled HTTP/1.1 connections,
with fail-over across endpoints, a deadline on every call and exact retry rules.

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
  blindly repeated: it raises :class:`~flashckpt.elastic.etcd.errors.EtcdOutcomeUnknown` so
  that the caller re-reads, since a repeated increment would count twice.

A connection goes back to the pool only after its response was read to the end, and never
when etcd said it would close it. Streams (a watch, the lease keep-alive stream) use connections
of their own, never pooled; the pool keeps the watch streams of ``EtcdClient.watch_events``
open between one caller's calls, so a watch loop holds one connection, not one per call. A pool
belongs to the process that filled it: a child forked with a client open starts with an empty
one. :meth:`Gateway.close` closes the idle connections.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import select
import ssl
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol
from urllib.parse import urlsplit

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd import _kvproto
from flashckpt.elastic.etcd._grpckv import CallFailed, GrpcChannel, GrpcError, NotHttp2
from flashckpt.elastic.etcd._leasestream import KeepAliveStream, _StreamBroken
from flashckpt.elastic.etcd.errors import (
    EtcdAuthError,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdOutcomeUnknown,
    EtcdTimeout,
    EtcdUnavailable,
)
from flashckpt.elastic.etcd.security import EtcdSecurity

__all__ = ["ConnectionStats", "Endpoint", "Gateway", "parse_endpoints"]

logger = logging.getLogger(__name__)

_DEFAULT_PORT = 2379
INITIAL_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
# Idle connections kept per endpoint; more concurrent requests open more, closed after use.
_MAX_IDLE_PER_ENDPOINT = 4
# A connection idle longer than this is closed, never reused: well under the idle timeouts of
# proxies and NATs (AWS ELB 60 s) that drop a connection without telling either end.
_IDLE_TIMEOUT_S = 20.0
# EtcdClient.watch_events keeps a caller's stream open this long between two calls (a watch
# loop calls again at once), and at most this many per client.
_WATCH_KEEP_S = 60.0
_MAX_KEPT_WATCHES = 32
# After an endpoint closed a gRPC connection's opening without a word (not a definite "not
# HTTP/2": a restarting etcd does that too), key-value calls go to the gateway this long.
_GRPC_RETRY_AFTER_S = 30.0
# Key-value calls go over gRPC (``_grpckv``) only for a client made with ``grpc_kv=True``.
# Off by default: etcd spends half the CPU per call there (benchmarks/etcd_transport.py), but at
# 1,024 simulated machines on 2 cores (benchmarks/rendezvous_scale.py, two runs each way, same
# code) round 1 took 7.0-9.5 s over gRPC against 5.2-5.4 s over the gateway, the machines'
# CPU rose by half (a reader thread per client, a thread hand-off per call) and each machine
# made one transaction more (issue 31). That one is not sent by the gRPC path (issue 45): at 128
# simulated machines, counted per call site in every process, both transports send the same
# transactions (4.6 per machine over the run), each once on the wire (no retries); what moves
# is when they come: the ring watch's first read of its window (``_spans_read``, one per
# machine: a registration folded into the first join reads no window) lands inside etcd's
# round-1 measurement when the calls are faster.
GRPC_KV_DEFAULT = False
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


HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}

# TLS alerts by which etcd refuses this client's certificate (or the lack of one): a retry
# cannot fix them.
_CERT_REFUSED = frozenset(
    {
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "TLSV1_ALERT_UNKNOWN_CA",
        "SSLV3_ALERT_HANDSHAKE_FAILURE",
    }
)


class KeptStream(Protocol):
    """A watch stream the pool keeps open between two calls of one caller."""

    @property
    def next_revision(self) -> int: ...

    def close(self) -> None: ...

    def _abandon(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Endpoint:
    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


class _AttemptFailed(Exception):
    """One request to one endpoint failed in a way that another attempt may fix."""

    def __init__(self, message: str, *, sent: bool, timed_out: bool) -> None:
        super().__init__(message)
        self.sent = sent
        self.timed_out = timed_out


class _AuthRetry(_AttemptFailed):
    """etcd rejected the request's auth token (expired, or issued before a change of users or
    roles) before applying it: authenticate again and repeat it."""


def auth_problem(message: str, where: str, path: str) -> Exception | None:
    """What an etcd error message about authentication means: an :class:`_AuthRetry` (get a
    new token), an :class:`EtcdAuthError` naming the fix, or ``None`` (not about auth)."""
    text = message.lower()
    if "invalid auth token" in text or "auth store is old" in text:
        return _AuthRetry(f"{where}: {message}", sent=False, timed_out=False)
    if "user name is empty" in text:
        return EtcdAuthError(
            f"etcd at {where} has authentication enabled and this client sent no user: pass "
            "--etcd-user and set $FLASHCKPT_ETCD_PASSWORD or --etcd-password-file (torchrun: "
            "--rdzv-conf user=..., $FLASHCKPT_ETCD_PASSWORD)"
        )
    if "authentication failed" in text or "invalid user id or password" in text:
        return EtcdAuthError(
            f"etcd at {where} refused the user name or password ({message}); check "
            "--etcd-user and the password in $FLASHCKPT_ETCD_PASSWORD or --etcd-password-file"
        )
    if "commonname of client" in text:
        return EtcdAuthError(
            f"etcd at {where} refuses JSON-gateway requests (this client's transport) made with "
            "a client certificate that has a CommonName (etcd would ignore it as a user name "
            "there); issue the client certificate without a CN (cert-manager: leave commonName "
            "unset; openssl: -subj /O=flashckpt), and authenticate with --etcd-user"
        )
    if "permission denied" in text:
        return EtcdAuthError(
            f"etcd at {where} denied {path} to this client's user ({message}); grant its role "
            "readwrite on the job's key prefix: etcdctl role grant-permission <role> --prefix "
            "readwrite /flashckpt/ (deploy/README.md)"
        )
    return None


def cert_refused(exc: BaseException, where: str) -> EtcdAuthError | None:
    """An :class:`EtcdAuthError` naming the fix when ``exc`` is etcd's TLS alert refusing this
    client's certificate (or its absence); ``None`` for any other error."""
    reason = getattr(exc, "reason", None)
    if not isinstance(exc, ssl.SSLError) or reason not in _CERT_REFUSED:
        return None
    return EtcdAuthError(
        f"etcd at {where} refused this client's TLS certificate ({reason}): it admits only "
        "clients with a certificate signed by its --trusted-ca-file; pass --etcd-cert and "
        "--etcd-key ($FLASHCKPT_ETCD_CERT/$FLASHCKPT_ETCD_KEY, torchrun: --rdzv-conf "
        "ssl_cert=...,ssl_cert_key=...)"
    )


def _sent_but_failed(
    endpoint: Endpoint, path: str, exc: BaseException, *, timed_out: bool | None = None
) -> _AttemptFailed:
    """A request that went out and got no whole answer (its outcome is unknown)."""
    return _AttemptFailed(
        f"{endpoint.url}{path} failed after the request was sent: {exc!r}",
        sent=True,
        timed_out=isinstance(exc, TimeoutError) if timed_out is None else timed_out,
    )


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
    keepalive_streams: int
    """Lease keep-alive streams opened (one per process while none breaks)."""
    grpc_connections: int = 0
    """HTTP/2 connections opened for key-value calls over gRPC (one per process and endpoint
    while none breaks)."""
    grpc_calls: int = 0
    """Key-value calls answered over gRPC."""


class _Pool:
    """Idle keep-alive connections per endpoint, for one process (``pid``)."""

    def __init__(self, *, closed: bool = False) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.closed = closed
        # Per endpoint, oldest first: (connection, monotonic time it went idle).
        self.idle: dict[Endpoint, list[tuple[http.client.HTTPConnection, float]]] = {}
        self.opened = self.reused = self.replaced = self.expired = 0
        # watch_events' open streams, per (thread, key, range end): (stream, time given back).
        self.watches: dict[tuple[int, bytes, bytes | None], tuple[KeptStream, float]] = {}
        # The lease keep-alive stream and its endpoint; keepalive_lock: one thread opens it.
        self.keepalive: tuple[KeepAliveStream, Endpoint] | None = None
        self.keepalive_lock = threading.Lock()
        self.keepalive_streams = 0
        # An endpoint answered the stream with something other than HTTP/2: requests instead.
        self.keepalive_by_request = False
        # Key-value calls over gRPC: one connection per endpoint; kv_lock: one thread opens it.
        self.kv: dict[Endpoint, GrpcChannel] = {}
        self.kv_lock = threading.Lock()
        self.kv_connections = 0
        self.kv_calls_before = 0  # calls answered on connections no longer in ``kv``
        # Key-value calls go to the gateway until this time (monotonic; inf: for good).
        self.kv_by_gateway_until = 0.0
        # A client dropped without close() closes its gRPC connections when it is collected
        # (each holds a socket and a reader thread, which do not hold the client).
        weakref.finalize(self, _close_channels, self.kv, self.pid)

    def take(self, endpoint: Endpoint) -> http.client.HTTPConnection | None:
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

    def give(self, endpoint: Endpoint, conn: http.client.HTTPConnection) -> None:
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
    ) -> KeptStream | None:
        """The open stream of ``slot`` if it goes on at ``next_revision``; closes streams
        nobody came back for within ``_WATCH_KEEP_S`` (their thread stopped watching)."""
        drop: list[KeptStream] = []
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

    def give_watch(self, slot: tuple[int, bytes, bytes | None], stream: KeptStream) -> None:
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
                keepalive_streams=self.keepalive_streams,
                grpc_connections=self.kv_connections,
                grpc_calls=self.kv_calls_before + sum(c.calls for c in self.kv.values()),
            )

    def close(self) -> None:
        """Closes the idle connections; connections in use are closed when given back."""
        with self.lock:
            self.closed = True
            conns = [c for per in self.idle.values() for c, _ in per]
            self.idle.clear()
            streams: list[KeptStream | KeepAliveStream] = [s for s, _ in self.watches.values()]
            self.watches.clear()
            if self.keepalive is not None:
                streams.append(self.keepalive[0])
                self.keepalive = None
            channels = list(self.kv.values())
            self.kv_calls_before += sum(c.calls for c in channels)
            self.kv.clear()
        for conn in conns:
            conn.close()
        for stream in streams:
            stream.close()
        for channel in channels:
            channel.close()

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
        if self.keepalive is not None:
            self.keepalive[0]._abandon()
        for channel in list(self.kv.values()):
            channel._abandon()


def _close_channels(channels: dict[Endpoint, GrpcChannel], pid: int) -> None:
    """Closes a collected pool's gRPC connections, in the process that opened them only (a
    forked child's copies share the parent's connections: closing them there would break the
    parent's)."""
    if os.getpid() == pid:
        for channel in list(channels.values()):
            channel.close()


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
    return [e.url for e in parse_endpoint_list(endpoints)]


def parse_endpoint_list(endpoints: str | Sequence[str]) -> list[Endpoint]:
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed: list[Endpoint] = []
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
        parsed.append(Endpoint(parts.scheme, parts.hostname, port))
    if not parsed:
        raise ValueError(
            f"no etcd endpoint given ({endpoints!r}); pass e.g. 'http://127.0.0.1:2379' or "
            "'host1:2379,host2:2379'"
        )
    return parsed


class Gateway:
    """etcd's v3 JSON gateway at a list of endpoints: the transport of
    :class:`~flashckpt.elastic.etcd.client.EtcdClient` (see its arguments), shared with the
    watch and lease-keep-alive streams that take a client."""

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
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if connect_timeout.total_seconds() <= 0:
            raise ValueError(f"connect_timeout must be positive, got {connect_timeout!r}")
        self._endpoints = parse_endpoint_list(endpoints)
        self._timeout = timeout
        self._connect_timeout_s = connect_timeout.total_seconds()
        if security is not None and ssl_context is None and security.tls:
            ssl_context = security.ssl_context()
        self._ssl_context = ssl_context
        self._security = security
        self._token: str | None = None
        self._authentications = 0
        self._auth_lock = threading.Lock()
        self._lock = threading.Lock()
        self._preferred = 0  # index of the endpoint that answered last
        self._pool = _Pool()
        self._tls = any(e.scheme == "https" for e in self._endpoints)
        if security is not None and security.tls and not self._tls:
            raise ValueError(
                f"etcd TLS files were given but the endpoints {list(self.endpoints)} are plain "
                "http://: use https:// endpoints (or host:port, which then means https)"
            )
        # The HTTP/2 streams (gRPC key-value calls, the lease keep-alive stream) share one socket
        # between a reader thread and the callers; a TLS socket must not be read and written
        # from two threads at once, and they carry no auth token: with TLS or auth every call
        # goes over the gateway (HTTP/1.1 over TLS, one request per connection at a time).
        self._streams_ok = not self._tls and not (security is not None and security.auth)
        self._grpc_kv = GRPC_KV_DEFAULT if grpc_kv is None else grpc_kv

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints, as URLs."""
        return tuple(e.url for e in self._endpoints)

    @property
    def timeout(self) -> timedelta:
        """The default deadline of each call."""
        return self._timeout

    @property
    def security(self) -> EtcdSecurity | None:
        """The TLS files and credentials this client was made with."""
        return self._security

    @property
    def authentications(self) -> int:
        """How many auth tokens this client obtained (one, plus one per expired token)."""
        return self._authentications

    def _headers(self, endpoint: Endpoint, deadline: Deadline) -> tuple[dict[str, str], str]:
        """The headers of a gateway request: with a user, its auth token (obtained from
        ``endpoint`` when none is held). Returns the headers and the token (empty: none)."""
        security = self._security
        if security is None or not security.auth:
            return HEADERS, ""
        token = self._token
        if token is None:
            with self._auth_lock:
                token = self._token
                if token is None:
                    token = self._token = self._authenticate(endpoint, deadline)
        if not token:
            return HEADERS, ""
        return {**HEADERS, "Authorization": token}, token

    def _authenticate(self, endpoint: Endpoint, deadline: Deadline) -> str:
        security = self._security
        assert security is not None and security.user is not None
        body = json.dumps({"name": security.user, "password": security.password}).encode()
        try:
            answer = self._post_once(endpoint, "/v3/auth/authenticate", body, deadline, HEADERS)
        except EtcdError as exc:
            if "authentication is not enabled" in str(exc):
                logger.warning(
                    "etcd at %s does not have authentication enabled, yet user %r was given: "
                    "anyone who reaches it can read and write every job's keys; enable it "
                    "(deploy/README.md, etcd security)",
                    endpoint.url,
                    security.user,
                )
                return ""
            raise
        token = answer.get("token")
        if not isinstance(token, str) or not token:
            raise EtcdError(f"{endpoint.url}/v3/auth/authenticate answered no token: {answer!r}")
        self._authentications += 1
        return token

    def _auth_was_off(self, exc: EtcdAuthError, token: str) -> bool:
        """Whether etcd refused a request this client sent without a token because its auth
        was off at login (see :meth:`_authenticate`): it has a user to log in with now."""
        security = self._security
        return (
            token == ""
            and security is not None
            and security.auth
            and self._token == ""
            and "this client sent no user" in str(exc)
        )

    def _forget_token(self, token: str) -> None:
        """Drops ``token`` (etcd rejected it) so that the next request authenticates again."""
        with self._auth_lock:
            if self._token == token:
                self._token = None

    def close(self) -> None:
        """Closes the pooled connections (a request in flight closes its own when done).

        Calls made after it still work, each on a connection of its own; watches and
        :class:`~flashckpt.elastic.etcd.client.LeaseKeepAlive` threads are not stopped (close
        those first).
        """
        self._pool_here().close()

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

    def _attempts(self, deadline: Deadline) -> Iterator[Endpoint]:
        """The endpoint of each attempt of one call, endlessly: every endpoint in turn from the
        preferred one, and after each round a pause that doubles up to ``MAX_BACKOFF_S``. The
        caller stops when an attempt succeeds or its deadline has passed."""
        backoff = INITIAL_BACKOFF_S
        attempt = 0
        while True:
            yield self._endpoint_for(attempt)
            attempt += 1
            if attempt % len(self._endpoints) == 0:
                deadline.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _endpoint_for(self, attempt: int) -> Endpoint:
        with self._lock:
            preferred = self._preferred
        return self._endpoints[(preferred + attempt) % len(self._endpoints)]

    def _prefer(self, endpoint: Endpoint) -> None:
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
        """POSTs ``body`` to ``path``, retrying across endpoints until the deadline.

        The key-value calls (``/v3/kv/range``, ``put``, ``deleterange``, ``txn``) go over gRPC
        instead (:meth:`_call_grpc`), with the same body and answer, retry rules and errors,
        where they can: no TLS, a body the protobuf encoder knows, an endpoint that speaks
        HTTP/2; else, or once an endpoint is found not to speak HTTP/2, to the gateway.
        """
        budget = timeout if timeout is not None else self._timeout
        deadline = Deadline.after(budget)
        method = _kvproto.METHODS.get(path) if self._grpc_kv and self._streams_ok else None
        if method is not None:
            try:
                message = _kvproto.encode(method[1], body)
            except _kvproto.Untranslatable as exc:
                logger.debug("etcd %s goes to the gateway: %s", path, exc)
            else:
                answer = self._call_grpc(path, method, message, deadline, budget, idempotent)
                if answer is not None:
                    return answer
        payload = json.dumps(body).encode()
        logged_in_again = False
        for endpoint in self._attempts(deadline):
            token = ""
            try:
                headers, token = self._headers(endpoint, deadline)
                response = self._post_once(endpoint, path, payload, deadline, headers)
            except EtcdAuthError as exc:
                if not self._auth_was_off(exc, token) or logged_in_again:
                    raise
                # This client authenticated while etcd's auth was off (no token: every request
                # went without one) and an operator has turned it on since: log in, once.
                logger.warning(
                    "etcd at %s has authentication enabled now (it was off when this client "
                    "logged in): authenticating as %r",
                    endpoint.url,
                    self._security.user if self._security else None,
                )
                self._forget_token(token)
                logged_in_again = True
            except _AttemptFailed as exc:
                if isinstance(exc, _AuthRetry):
                    logger.info("etcd auth token of %s expired; authenticating again", path)
                    self._forget_token(token)
                if exc.sent and not idempotent:
                    raise EtcdOutcomeUnknown(
                        f"etcd at {endpoint.url} took {path} but its answer was lost ({exc}); "
                        "the write may or may not have been applied: re-read the key before "
                        "retrying"
                    ) from exc
                if deadline.expired():
                    raise self._gave_up(path, budget, exc) from exc
                logger.debug("etcd %s on %s failed, retrying: %s", path, endpoint.url, exc)
            else:
                self._prefer(endpoint)
                return response
        raise AssertionError("unreachable: _attempts never ends")

    def _call_grpc(
        self,
        path: str,
        method: tuple[str, Any, Any],
        message: bytes,
        deadline: Deadline,
        budget: timedelta,
        idempotent: bool,
    ) -> dict[str, Any] | None:
        """One key-value call over gRPC with :meth:`_call`'s retry rules; ``None`` when it
        must go to the gateway instead (nothing was sent over gRPC then)."""
        grpc_path, _, answer_schema = method
        for endpoint in self._attempts(deadline):
            pool = self._pool_here()
            if pool.closed or time.monotonic() < pool.kv_by_gateway_until:
                return None
            try:
                channel = self._kv_channel(pool, endpoint, deadline)
                answer = channel.call(grpc_path, message, deadline)
            except NotHttp2 as exc:
                with pool.lock:
                    pool.kv_by_gateway_until = (
                        float("inf") if exc.definite else time.monotonic() + _GRPC_RETRY_AFTER_S
                    )
                logger.warning("%s; etcd key-value calls go to the JSON gateway", exc)
                return None
            except CallFailed as exc:
                failed = _AttemptFailed(
                    f"{endpoint.url}{path} over gRPC: {exc}", sent=exc.sent, timed_out=exc.timed_out
                )
            except GrpcError as exc:
                mapped = error_from_grpc(exc, endpoint, path)
                if not isinstance(mapped, _AttemptFailed):
                    raise mapped from exc
                failed = mapped
            except _AttemptFailed as exc:  # the connection could not be opened
                failed = exc
            else:
                self._prefer(endpoint)
                try:
                    return _kvproto.decode(answer_schema, answer)
                except ValueError as exc:
                    error = EtcdError if idempotent else EtcdOutcomeUnknown
                    raise error(
                        f"etcd at {endpoint.url} answered {path} over gRPC with a malformed "
                        f"message ({exc}); the server or a proxy in between mangled it"
                    ) from exc
            if failed.sent and not idempotent:
                raise EtcdOutcomeUnknown(
                    f"etcd at {endpoint.url} took {path} but its answer was lost ({failed}); "
                    "the write may or may not have been applied: re-read the key before "
                    "retrying"
                ) from failed
            if deadline.expired():
                raise self._gave_up(path, budget, failed) from failed
            logger.debug("etcd %s over gRPC on %s failed, retrying: %s", path, endpoint.url, failed)
        raise AssertionError("unreachable: _attempts never ends")

    def _kv_channel(self, pool: _Pool, endpoint: Endpoint, deadline: Deadline) -> GrpcChannel:
        """The process's gRPC connection to ``endpoint`` if it is usable, else a new one (one
        idle longer than ``_IDLE_TIMEOUT_S`` is replaced, as a pooled connection would be)."""
        channel = pool.kv.get(endpoint)
        if channel is not None and channel.usable and channel.idle_for() < _IDLE_TIMEOUT_S:
            return channel
        if not pool.kv_lock.acquire(timeout=max(0.001, deadline.remaining())):
            raise _AttemptFailed(
                "another thread is still opening the gRPC connection",
                sent=False,
                timed_out=True,
            )
        try:
            channel = pool.kv.get(endpoint)
            if channel is not None:
                if channel.usable and channel.idle_for() < _IDLE_TIMEOUT_S:
                    return channel  # opened by the thread that held the lock
                with pool.lock:
                    pool.kv_calls_before += channel.calls
                    del pool.kv[endpoint]
                if not channel.draining:  # a draining one finishes its calls, then closes
                    channel.close()
            conn = self._connect(endpoint, deadline)
            sock = conn.sock
            assert sock is not None
            conn.sock = None  # the channel owns the socket from here
            host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
            channel = GrpcChannel(sock, f"{host}:{endpoint.port}", endpoint.url, deadline)
            with pool.lock:
                if pool.closed:
                    channel.close()
                    raise _AttemptFailed("the client was closed", sent=False, timed_out=False)
                pool.kv[endpoint] = channel
                pool.kv_connections += 1
            return channel
        finally:
            pool.kv_lock.release()

    def _gave_up(self, what: str, budget: timedelta, exc: _AttemptFailed) -> EtcdUnavailable:
        error = EtcdTimeout if exc.timed_out else EtcdUnavailable
        return error(
            f"etcd did not complete {what} within {budget.total_seconds():g} s; "
            f"tried {list(self.endpoints)}, last error: {exc}. Check that etcd is "
            "running and reachable from this machine, or raise the timeout."
        )

    def _keep_alive(
        self, lease_id: int, timeout: timedelta | None, *, keep: bool = False
    ) -> tuple[int, float]:
        """One keep-alive of lease ``lease_id``; returns the TTL etcd answered (0: the lease
        does not exist) and the monotonic time the answered keep-alive was sent, with the retry
        rules and errors of a lease request (:meth:`_call`).

        It goes on the client's keep-alive stream (one per process, opened on first use and
        again after it breaks: :mod:`flashckpt.elastic.etcd._leasestream`), or as a gateway
        request where a stream cannot be used: ``https://`` endpoints, an endpoint that does
        not speak HTTP/2, a closed client. ``keep``: see ``KeepAliveStream.renew_sent``.
        """
        budget = timeout if timeout is not None else self._timeout
        deadline = Deadline.after(budget)
        for endpoint in self._attempts(deadline):
            pool = self._pool_here()
            if pool.closed or pool.keepalive_by_request or not self._streams_ok:
                sent = time.monotonic()
                return self._keep_alive_by_request(lease_id, deadline), sent
            stream: KeepAliveStream | None = None
            try:
                stream, at = self._keepalive_stream(pool, endpoint, deadline)
                answered = stream.renew_sent(lease_id, deadline, keep=keep)
                if answered is None:
                    raise _AttemptFailed(
                        f"{at.url}: no answer to a lease keep-alive before the deadline",
                        sent=True,
                        timed_out=True,
                    )
            except (_StreamBroken, _AttemptFailed) as exc:
                if stream is not None and stream.not_http2:
                    logger.warning("%s; lease keep-alives go as gateway requests", exc)
                    pool.keepalive_by_request = True
                    continue
                failed = (
                    exc
                    if isinstance(exc, _AttemptFailed)
                    else _AttemptFailed(str(exc), sent=True, timed_out=False)
                )
                if deadline.expired():
                    raise self._gave_up("a lease keep-alive", budget, failed) from exc
                logger.debug("etcd lease keep-alive failed, retrying: %s", exc)
            else:
                self._prefer(at)
                return answered
        raise AssertionError("unreachable: _attempts never ends")

    def _keep_alive_by_request(self, lease_id: int, deadline: Deadline) -> int:
        timeout = timedelta(seconds=deadline.remaining())
        response = self._call(
            "/v3/lease/keepalive", {"ID": str(lease_id)}, timeout=timeout, idempotent=True
        )
        if "error" in response:
            raise EtcdError(f"etcd failed to refresh lease {lease_id:x}: {response['error']}")
        return int((response.get("result") or {}).get("TTL", 0))

    def _keepalive_stream(
        self, pool: _Pool, endpoint: Endpoint, deadline: Deadline
    ) -> tuple[KeepAliveStream, Endpoint]:
        """The process's keep-alive stream if it is alive, else a new one to ``endpoint``."""
        kept = pool.keepalive
        if kept is not None and not kept[0].broken:
            return kept
        if not pool.keepalive_lock.acquire(timeout=max(0.001, deadline.remaining())):
            raise _AttemptFailed(
                "another thread is still opening the lease keep-alive stream",
                sent=False,
                timed_out=True,
            )
        try:
            kept = pool.keepalive
            if kept is not None and not kept[0].broken:
                return kept  # opened by the thread that held the lock
            conn = self._connect(endpoint, deadline)
            sock = conn.sock
            assert sock is not None
            conn.sock = None  # the stream owns the socket from here
            host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
            try:
                stream = KeepAliveStream(sock, f"{host}:{endpoint.port}", endpoint.url, deadline)
            except _StreamBroken as exc:
                raise _AttemptFailed(str(exc), sent=False, timed_out=False) from exc
            with pool.lock:
                if pool.closed:
                    stream.close()
                    raise _AttemptFailed("the client was closed", sent=False, timed_out=False)
                pool.keepalive = (stream, endpoint)
                pool.keepalive_streams += 1
            return stream, endpoint
        finally:
            pool.keepalive_lock.release()

    def _connect(self, endpoint: Endpoint, deadline: Deadline) -> http.client.HTTPConnection:
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
            raise EtcdAuthError(
                f"TLS verification of {endpoint.url} failed: {exc.verify_message}; pass the CA "
                "that signed etcd's certificate: --etcd-ca ($FLASHCKPT_ETCD_CA, torchrun: "
                "--rdzv-conf ca_cert=...)"
            ) from exc
        except OSError as exc:
            conn.close()
            refused = cert_refused(exc, endpoint.url)
            if refused is not None:
                raise refused from exc
            raise _AttemptFailed(
                f"cannot connect to {endpoint.url}: {exc!r}",
                sent=False,
                timed_out=isinstance(exc, TimeoutError),
            ) from exc
        assert conn.sock is not None
        conn.sock.settimeout(max(0.001, deadline.remaining()))
        return conn

    def _post_once(
        self,
        endpoint: Endpoint,
        path: str,
        payload: bytes,
        deadline: Deadline,
        headers: dict[str, str] = HEADERS,
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
                conn.request("POST", path, body=payload, headers=headers)
            except _PEER_CLOSED_ERRORS as exc:
                conn.close()
                if reused:
                    # The peer closed the pooled connection after the poll: sendall failed, so
                    # etcd never received the whole request. Send it on another connection.
                    pool.count(replaced=1)
                    logger.debug("pooled connection to %s was closed: %r", endpoint.url, exc)
                    continue
                raise _sent_but_failed(endpoint, path, exc, timed_out=False) from exc
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise cert_refused(exc, endpoint.url) or _sent_but_failed(
                    endpoint, path, exc
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
            # A refused certificate: etcd closed the connection in the handshake, before it
            # read the request (TLS 1.3 reports it on the first read).
            raise cert_refused(exc, endpoint.url) or _sent_but_failed(endpoint, path, exc) from exc
        except BaseException:
            conn.close()
            raise
        if response.will_close:
            conn.close()
        else:
            pool.give(endpoint, conn)  # its response was read to the end
        if response.status == 200:
            return parse_json(data, endpoint, path)
        raise error_from_response(response.status, data, endpoint, path)


def error_from_grpc(exc: GrpcError, endpoint: Endpoint, path: str) -> Exception:
    """Maps a non-OK gRPC status to a final :class:`EtcdError` or a retryable failure, by the
    same codes as :func:`error_from_response` (the gateway reports etcd's gRPC status)."""
    code, message = exc.code, exc.grpc_message
    where = f"{endpoint.url}{path} (gRPC)"
    auth = auth_problem(message, endpoint.url, path)
    if auth is not None:
        return auth
    if code in _RETRY_NOT_APPLIED:
        return _AttemptFailed(f"{where}: {message}", sent=False, timed_out=False)
    if code in _RETRY_MAYBE_APPLIED:
        return _AttemptFailed(
            f"{where}: {message}",
            sent=True,
            timed_out=code == _GRPC_DEADLINE_EXCEEDED or "timed out" in message,
        )
    if code == _GRPC_NOT_FOUND and "lease" in message:
        return EtcdLeaseNotFound(
            f"{where}: {message}; the lease expired or was revoked: grant a new one"
        )
    return EtcdError(f"etcd rejected {path} at {endpoint.url}: gRPC code {code}: {message}")


def parse_json(data: bytes, endpoint: Endpoint, path: str) -> dict[str, Any]:
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


def error_from_response(status: int, data: bytes, endpoint: Endpoint, path: str) -> Exception:
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
    auth = auth_problem(message, endpoint.url, path)
    if auth is not None:
        return auth
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
