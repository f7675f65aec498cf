"""Lease keep-alives on one long-lived etcd ``LeaseKeepAlive`` stream per client and process.

Over the JSON gateway every keep-alive is an HTTP request of its own, which costs etcd far more
CPU than the renewal itself (the request, its JSON, a gRPC stream opened and closed inside
etcd for it). The gateway cannot carry a stream of them either: etcd's HTTP/1.1 server (Go's
``net/http``, etcd 3.5) sends no answer before the whole request body has arrived, so keep-alives
written one by one into one chunked request are all answered only when the body ends (tried
with etcd 3.5.1). etcd's client port also serves gRPC, over HTTP/2 without TLS (what etcd's own
Go client uses); there one ``LeaseKeepAlive`` stream carries every renewal as one small message
each way. Measured on one etcd 3.5.1 (``benchmarks/README.md``, "Lease keep-alive stream"): about
30 µs of etcd CPU per renewal on the stream against 130-200 µs per gateway request.

This module speaks only what that one stream needs: HTTP/2 (RFC 9113) with prior knowledge, one
stream (id 1), header blocks written as literals (HPACK, RFC 7541) and never decoded (the
stream's end is all we need of etcd's headers and trailers), flow control, and the two protobuf
messages (``LeaseKeepAliveRequest {int64 ID = 1}``, ``LeaseKeepAliveResponse {ResponseHeader
header = 1; int64 ID = 2; int64 TTL = 3}``).

etcd answers the requests of one stream one by one, in order (``v3rpc.LeaseServer``: receive, renew,
send), so the n-th answer is the n-th request's: each answer is matched to its request in order and
its lease ID checked; an answer whose caller gave up is dropped (unless it said it comes back for
it: ``keep``, a lease's sole renewer waiting in slices). One request per lease is in flight at a
time: a second caller for the same lease waits for the first answer, then sends its own. The stream
has no thread: the callers waiting for answers read the socket, one at a time. A stream that breaks
(etcd ends it, a reset, a GOAWAY, garbage) fails every request in flight; the callers retry on a new
stream, as they would a failed request. A caller whose deadline passes with no answer at all on the
stream since its request was sent, for a time that fits the leases renewed on it (``_STUCK_MIN_S``)
and with no bytes waiting to be read, closes the stream (etcd or the connection is stuck; the next
call opens a new one, as a timed-out request's connection is closed); one whose request waits behind
earlier ones that are being answered leaves the stream alone.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from flashckpt.elastic.deadline import Deadline

__all__ = ["KeepAliveStream"]

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
_END_STREAM = _ACK = 0x1
_END_HEADERS = 0x4
_PADDED = 0x8
_SETTINGS_ENABLE_PUSH = 0x2
_SETTINGS_INITIAL_WINDOW_SIZE = 0x4
_STREAM = 1  # the one stream of the connection
_MAX_WINDOW = 2**31 - 1
_DEFAULT_WINDOW = 65535
# Received DATA bytes after which the receive windows are opened again (we advertise 2 GiB).
_WINDOW_REFILL = 2**30
# How long the reading caller may block sending an acknowledgement before the stream breaks.
_CONTROL_SEND = timedelta(seconds=10)
_PATH = "/etcdserverpb.Lease/LeaseKeepAlive"
# A request whose caller gave up makes the stream count as stuck when nothing was answered on it
# since the request was sent, for at least a tenth of the shortest lease TTL etcd answered on the
# stream and at least _STUCK_MIN_S, at most a fifth of it (the renewal interval of
# NodeRegistry, well under TTL/3, so a dead stream is replaced with most of the lease left),
# and the reader has no bytes waiting unread. A healthy etcd answers in milliseconds, but a
# loaded one (1,024 machines on 2 cores) takes hundreds: a fixed 0.25 s broke healthy streams
# there, and each new connection and reader thread added to the load (801 streams opened for
# 128 clients in one run; issue 31). A caller whose deadline left it less time than this says
# nothing about the stream.
_STUCK_MIN_S = 1.0
# The payload of grpc-go's BDP ping (bandwidth-delay product estimation, ``bdpPing`` in
# grpc-go's ``internal/transport``): etcd sends one, with a connection WINDOW_UPDATE, after the
# first DATA frame it receives while none is outstanding, so after nearly every keep-alive
# request. It has no deadline (the estimator only waits for its ack before sending the next),
# so its ack goes out with the stream's next write instead of a write of its own (a send per
# renewal saved on both ends; issue 31); every other PING is acked at once. Written after the
# request, the ack also halves the BDP pings (and their WINDOW_UPDATEs) etcd sends.
_BDP_PING = bytes([2, 4, 16, 16, 9, 14, 7, 7])
# The largest keep-alive request's DATA payload: a gRPC message of a ten-byte lease ID varint.
_MAX_REQUEST = 16
# The largest gRPC message taken as a keep-alive answer: a LeaseKeepAliveResponse is a response
# header (cluster and member IDs, revision, raft term: four varints, under 50 bytes), a lease
# ID and a TTL (about 70 bytes in all). A declared length past this fails the stream at once
# instead of buffering up to the 4 GiB its length field allows.
MAX_KEEPALIVE_ANSWER = 64 * 1024
# An HTTP/2 frame header: length (24 bits: a byte and 16 bits), type, flags, stream id.
_HEAD = struct.Struct(">BHBBI")


class _StreamBroken(Exception):
    """The keep-alive stream failed; the request it carried (if any) may or may not have reached
    etcd (a keep-alive is safe to repeat)."""


class NotHttp2(Exception):
    """The endpoint does not speak HTTP/2 (gRPC) without TLS: a proxy in front of etcd that
    passes HTTP/1.1 only, for example; nothing was sent. The calls (keep-alives on
    :class:`KeepAliveStream`, key-value calls on ``_grpckv.GrpcChannel``) then go to the JSON
    gateway.

    ``definite``: it answered something else (a proxy's HTTP/1.1 error, a TLS alert); when
    false it closed the connection without a word, which a restarting etcd does too.
    """

    def __init__(self, message: str, *, definite: bool = True) -> None:
        super().__init__(message)
        self.definite = definite


class _Pending:
    """One keep-alive sent on the stream, waiting for its answer."""

    __slots__ = ("abandoned", "done", "error", "kept", "lease_id", "sent_at", "ttl")

    def __init__(self, lease_id: int) -> None:
        self.lease_id = lease_id
        # Answered or failed; set under the stream's lock, whose condition is then notified
        # (every wait for it is on that condition: no event of its own per request).
        self.done = False
        self.ttl = 0
        self.error: str | None = None
        self.sent_at = 0.0
        self.abandoned = False  # its caller's deadline passed first
        self.kept = False  # its caller's deadline passed first, and it comes back for it

    def is_done(self) -> bool:
        return self.done


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([value])
    out = bytearray([top])
    value -= top
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _hpack_literal(name: str, value: str) -> bytes:
    """A header field as a literal without indexing, new name, no Huffman coding."""
    raw_name, raw_value = name.encode(), value.encode()
    return (
        b"\x00"
        + _hpack_int(len(raw_name), 7)
        + raw_name
        + _hpack_int(len(raw_value), 7)
        + raw_value
    )


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    head = struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)
    return head + payload


def _varint(value: int) -> bytes:
    value &= 2**64 - 1  # int64 on the wire: a negative value takes ten bytes
    out = bytearray()
    while True:
        byte = value & 127
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 128)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at ``data[at:]`` (at most ten bytes) and the offset after it."""
    end = len(data)
    value = shift = 0
    while at < end:
        byte = data[at]
        at += 1
        if byte < 128:
            return value | byte << shift, at
        value |= (byte & 127) << shift
        shift += 7
        if shift > 63:
            break
    raise ValueError("a truncated protobuf varint")


def send_all(sock: socket.socket | None, data: bytes, deadline: Deadline) -> None:
    """Writes ``data`` whole to ``sock`` before ``deadline`` (a frame half written breaks the
    connection). Raises ``OSError`` (``TimeoutError`` when the deadline passed first)."""
    if sock is None:
        raise OSError("the connection was closed")
    try:  # the common case: the socket's buffer takes it all at once
        sent = sock.send(data, socket.MSG_DONTWAIT)
    except BlockingIOError:
        sent = 0
    if sent == len(data):
        return
    view = memoryview(data)[sent:]
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    while True:
        if deadline.expired():
            raise TimeoutError("the connection took no more bytes before the deadline")
        poller.poll(max(1, int(deadline.remaining() * 1000)))
        try:
            view = view[sock.send(view, socket.MSG_DONTWAIT) :]
        except BlockingIOError:
            pass
        if not view:
            return


def recv_exact(sock: socket.socket | None, size: int, buffer: bytearray, closed: str) -> bytes:
    """The next ``size`` bytes of ``sock``, ``buffer`` holding what was read ahead; raises
    ``ConnectionError(closed)`` at the end of the stream."""
    assert sock is not None
    while len(buffer) < size:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(closed)
        buffer += data
    out = bytes(buffer[:size])
    del buffer[:size]
    return out


def keepalive_request(lease_id: int) -> bytes:
    """The gRPC message (length-prefixed) of ``LeaseKeepAliveRequest{ID: lease_id}``."""
    message = b"\x08" + _varint(lease_id)
    return b"\x00" + struct.pack(">I", len(message)) + message


@functools.lru_cache(maxsize=4096)
def keepalive_frame(lease_id: int) -> bytes:
    """The HTTP/2 DATA frame (on the stream) carrying :func:`keepalive_request` of
    ``lease_id``: the same bytes for every renewal of a lease, so encoded once per lease (a
    machine renews its lease every second; leases per process are few, the cache is bounded)."""
    return _frame(_DATA, 0, _STREAM, keepalive_request(lease_id))


def parse_keepalive_response(message: bytes) -> tuple[int, int]:
    """``(ID, TTL)`` of a ``LeaseKeepAliveResponse`` (absent fields are 0, as in proto3)."""
    fields = [0, 0, 0, 0]  # by field number; 2: ID, 3: TTL, others dropped
    at = 0
    end = len(message)
    while at < end:
        tag, at = _read_varint(message, at)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, at = _read_varint(message, at)
            if number < 4:
                fields[number] = value - 2**64 if value >= 2**63 else value
        elif wire == 2:
            size, at = _read_varint(message, at)
            at += size
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"protobuf wire type {wire} in a keep-alive answer")
    if at != end:
        raise ValueError("a truncated keep-alive answer")
    return fields[2], fields[3]


def _bad_ping(payload: bytes) -> str:
    return (
        f"an HTTP/2 PING of {len(payload)} bytes (RFC 9113 6.7: exactly 8, anything else is a "
        "FRAME_SIZE_ERROR of the connection)"
    )


class KeepAliveStream:
    """One ``LeaseKeepAlive`` gRPC stream on an HTTP/2 connection of its own to one etcd.

    No thread of its own: a caller waiting for an answer (or for room in etcd's flow-control
    windows) reads the socket itself, one caller at a time; the others wait for their answers,
    which it hands over, and one of them takes over the reading when it leaves (at its answer or
    its deadline). What arrives while nobody waits (etcd's PING, SETTINGS, GOAWAY, its close)
    is read by the next caller before its answer. At 1,024 simulated machines on 2 cores a
    reader thread per client was a thread per machine, and every renewal crossed two threads
    (issue 31).

    Args:
        sock: A connected TCP socket to etcd's client port (no TLS); the stream owns it.
        authority: ``host:port`` of the endpoint (the HTTP/2 ``:authority``).
        where: The endpoint's URL, for messages.
        deadline: When sending the connection's opening gives up.

    Raises:
        _StreamBroken: If the connection's opening could not be sent.
    """

    def __init__(self, sock: socket.socket, authority: str, where: str, deadline: Deadline) -> None:
        self.where = where
        self._sock: socket.socket | None = sock
        self._lock = threading.Lock()  # the state below
        # The socket's writes, and its close (reentrant: a failed write breaks the stream).
        self._send_lock = threading.RLock()
        # Notified on every answer, window update, break, and when the reading caller leaves.
        self._change = threading.Condition(self._lock)
        self._reading = False  # a caller reads the socket now
        self._inbox = bytearray()  # bytes read, not yet whole frames
        # The reading caller's poller (one reader at a time), made once for the socket.
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._first = True  # no frame read yet (etcd's first is its SETTINGS)
        self._fifo: collections.deque[_Pending] = collections.deque()  # sent, in wire order
        self._busy: dict[int, _Pending] = {}  # lease ID -> its request in flight
        # lease ID -> a request answered after its caller left it to come back (renew(keep=True))
        self._late: dict[int, _Pending] = {}
        self._broken: str | None = None
        self._conn_window = self._stream_window = _DEFAULT_WINDOW
        self._peer_initial_window = _DEFAULT_WINDOW
        self._last_answer = time.monotonic()  # when etcd last answered a request
        self._shortest_ttl: int | None = None  # the shortest TTL etcd answered (seconds)
        self._received = 0  # DATA bytes since the receive windows were last opened
        self._grpc = bytearray()  # DATA received, not yet whole gRPC messages
        self._not_http2 = False
        # A BDP ping's ack, written before the next request (``_send_lock``; see _BDP_PING).
        self._deferred_ack = b""
        self.answers = 0
        """Answers matched to their requests (diagnostics and tests)."""
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Each keep-alive is a small write of its own: do not hold it for the last ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        headers = b"".join(
            _hpack_literal(name, value)
            for name, value in (
                (":method", "POST"),
                (":scheme", "http"),
                (":path", _PATH),
                (":authority", authority),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            )
        )
        settings = struct.pack(
            ">HIHI", _SETTINGS_ENABLE_PUSH, 0, _SETTINGS_INITIAL_WINDOW_SIZE, _MAX_WINDOW
        )
        opening = (
            _PREFACE
            + _frame(_SETTINGS, 0, 0, settings)
            + _frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", _MAX_WINDOW - _DEFAULT_WINDOW))
            + _frame(_HEADERS, _END_HEADERS, _STREAM, headers)
        )
        try:
            self._send(opening, deadline)
        except _StreamBroken:
            self._close_socket()
            raise

    @property
    def not_http2(self) -> bool:
        """Whether the endpoint answered something other than HTTP/2 (see :class:`NotHttp2`)."""
        return self._not_http2

    @property
    def broken(self) -> bool:
        """Whether the stream failed or was closed (a new one must be opened)."""
        return self._broken is not None

    def renew(self, lease_id: int, deadline: Deadline) -> int | None:
        """Sends one keep-alive of ``lease_id`` and waits for etcd's answer.

        Returns:
            The TTL etcd answered, in seconds (0: the lease does not exist), or ``None`` when
            the deadline passed first (the answer, if it comes later, is dropped).

        Raises:
            _StreamBroken: The stream failed before the answer came.
        """
        answered = self.renew_sent(lease_id, deadline)
        return None if answered is None else answered[0]

    def renew_sent(
        self, lease_id: int, deadline: Deadline, *, keep: bool = False
    ) -> tuple[int, float] | None:
        """:meth:`renew`, with the monotonic time the answered keep-alive was sent.

        ``keep``: the caller renews ``lease_id`` alone and comes back when its deadline passes
        first: its request stays in flight, neither dropped nor judged stuck, and the next call
        for the lease takes its answer (waits for it, or finds it if it came meanwhile) instead
        of sending another. A renewal that may take what the lease has left thus waits for it
        in slices (the renew loop wakes between them) with one request on the wire; its last
        slice, without ``keep``, gives it up as :meth:`renew` does (a stuck stream is closed).
        """
        with self._lock:
            if self._broken is not None:
                raise _StreamBroken(self._broken)
            # A kept request's answer that came between two calls, or the request itself:
            # taken by any call (only a lease's sole renewer keeps its requests).
            kept = self._late.pop(lease_id, None)
            before = self._busy.get(lease_id)
        if kept is not None:
            return kept.ttl, kept.sent_at
        if before is not None and before.kept:
            return self._answer_of(before, deadline, keep=keep)
        pending = _Pending(lease_id)
        request = keepalive_frame(lease_id)
        size = len(request) - 9
        while True:  # one request per lease in flight: wait for the one before
            with self._lock:
                if self._broken is not None:
                    raise _StreamBroken(self._broken)
                before = self._busy.get(lease_id)
                if before is None:
                    self._busy[lease_id] = pending
                    self._late.pop(lease_id, None)
                    # Room in etcd's receive windows (flow control), taken at once when there
                    # is (nearly always: etcd reopens them as it reads).
                    room = min(self._conn_window, self._stream_window) >= size
                    if room:
                        self._conn_window -= size
                        self._stream_window -= size
                    break
            # The one before, if its caller gave up, may be on a dead stream: look again every
            # stuck time (a stuck stream is replaced within this call's deadline).
            while not self._wait(
                before.is_done,
                Deadline.after(timedelta(seconds=min(deadline.remaining(), self.stuck_after()))),
            ):
                if before.abandoned:
                    self._fail_if_stuck(before)
                if deadline.expired():
                    self._fail_if_stuck(before)
                    return None
        if not room:  # wait for etcd to open its windows
            self._wait(
                lambda: (
                    self._broken is not None or min(self._conn_window, self._stream_window) >= size
                ),
                deadline,
            )
            with self._lock:
                room = self._broken is None and min(self._conn_window, self._stream_window) >= size
                if room:
                    self._conn_window -= size
                    self._stream_window -= size
        if not room:
            self._forget(pending)
            if self._broken is not None:
                raise _StreamBroken(self._broken)
            return None
        try:
            with self._send_lock:
                with self._lock:
                    if self._broken is not None:
                        raise _StreamBroken(self._broken)
                    pending.sent_at = time.monotonic()
                    self._fifo.append(pending)  # in the order of the writes
                # The ack after the request: etcd then reads the request while its BDP ping is
                # still out, so it sends no new one for it (one per two renewals, not one each).
                ack, self._deferred_ack = self._deferred_ack, b""
                self._send(request + ack if ack else request, deadline)
        except _StreamBroken:
            self._forget(pending)
            raise
        return self._answer_of(pending, deadline, keep=keep)

    def close(self) -> None:
        """Ends the stream; requests in flight fail with :class:`_StreamBroken`."""
        self._fail("the keep-alive stream was closed")

    def _abandon(self) -> None:
        """In a forked child: closes this process's copy of the socket, nothing else (the
        locks are the parent's)."""
        sock = self._sock
        if sock is not None:
            sock.close()

    # ------------------------------------------------------------------------ internals

    def _answer_of(
        self, pending: _Pending, deadline: Deadline, *, keep: bool
    ) -> tuple[int, float] | None:
        """Waits for ``pending``'s answer (see :meth:`renew_sent`)."""
        if not self._wait(pending.is_done, deadline):
            with self._lock:
                if not pending.done:
                    if keep:
                        pending.kept = True
                    else:
                        pending.abandoned = True
            if not pending.done:
                if not keep:
                    self._fail_if_stuck(pending)
                return None
        with self._lock:
            if self._late.get(pending.lease_id) is pending:
                del self._late[pending.lease_id]
        if pending.error is not None:
            raise _StreamBroken(pending.error)
        return pending.ttl, pending.sent_at

    def _wait(self, ready: Callable[[], bool], deadline: Deadline) -> bool:
        """Waits until ``ready()`` (called with ``_lock`` held) or the stream breaks, at most
        until ``deadline``; reads the socket meanwhile unless another caller does. Returns
        ``ready()``."""
        while True:
            with self._lock:
                while not ready() and self._broken is None and self._reading:
                    left = deadline.remaining()
                    if left <= 0:
                        return ready()
                    self._change.wait(left)
                if ready():
                    return True
                if self._broken is not None or deadline.expired():
                    return False
                self._reading = True
            try:
                self._read(ready, deadline)
            finally:
                with self._lock:
                    self._reading = False
                    broken = self._broken is not None
                    self._change.notify_all()  # another waiter reads from here
                if broken:
                    self._close_socket()

    def _read(self, ready: Callable[[], bool], deadline: Deadline) -> None:
        """Reads and handles frames until ``ready()`` or ``deadline`` (the reading caller)."""
        sock = self._sock
        inbox = self._inbox
        try:
            if sock is None:
                raise ConnectionError("the keep-alive connection was closed")
            poller = self._poller
            while True:
                while len(inbox) >= 9:
                    high, low, kind, flags, stream = _HEAD.unpack_from(inbox)
                    size = high << 16 | low
                    stream &= 0x7FFFFFFF
                    if self._first and (
                        kind != _SETTINGS or stream != 0 or inbox.startswith(b"HTTP/")
                    ):
                        raise NotHttp2(
                            f"{self.where} does not speak HTTP/2 (gRPC) without TLS: it "
                            f"answered {bytes(inbox[:49])!r}"
                        )
                    self._first = False
                    if size > 2**24:
                        raise ValueError(f"an HTTP/2 frame of {size} bytes")
                    if len(inbox) < 9 + size:
                        break
                    payload = bytes(inbox[9 : 9 + size])
                    del inbox[: 9 + size]
                    self._on_frame(kind, flags, stream, payload)
                with self._lock:
                    if ready() or self._broken is not None:
                        return
                if deadline.expired():
                    return
                if not poller.poll(max(1, int(deadline.remaining() * 1000))):
                    continue
                try:
                    data = sock.recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                if not data:
                    raise ConnectionError("etcd closed the keep-alive connection")
                inbox += data
        except NotHttp2 as exc:
            self._not_http2 = True  # before the callers wake
            self._fail(str(exc))
        except (OSError, ValueError, _StreamBroken) as exc:
            self._fail(f"the keep-alive stream to {self.where} broke: {exc}")

    def _close_socket(self) -> None:
        with self._send_lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _fail_if_stuck(self, pending: _Pending) -> None:
        """Breaks the stream if ``pending`` (sent, unanswered) got no answer and neither did
        anything sent after it: answers come in order, so none is coming."""
        with self._lock:
            sent = pending.sent_at
            stuck = (
                sent > 0
                and self._last_answer < sent
                and time.monotonic() - sent >= self.stuck_after()
            )
            sock = self._sock
        if stuck and sock is not None:
            # Bytes waiting unread: the callers that read them are behind (a loaded host), not
            # etcd.
            with contextlib.suppress(OSError, ValueError):
                poller = select.poll()
                poller.register(sock, select.POLLIN)
                stuck = not poller.poll(0)
        if stuck:
            self._fail(
                f"no answer from {self.where} on the keep-alive stream since a request sent "
                f"{time.monotonic() - sent:.1f} s ago"
            )

    def stuck_after(self) -> float:
        """Seconds without any answer after which a request whose caller gave up breaks the
        stream (see ``_STUCK_MIN_S``)."""
        ttl = self._shortest_ttl
        if ttl is None:
            return _STUCK_MIN_S
        return min(max(_STUCK_MIN_S, ttl / 10), ttl / 5)

    def _forget(self, pending: _Pending) -> None:
        """Frees the lease's slot of a request that was not sent."""
        with self._lock:
            if self._busy.get(pending.lease_id) is pending:
                del self._busy[pending.lease_id]
            pending.error = pending.error or "not sent"
            pending.done = True
            self._change.notify_all()

    def _fail(self, why: str) -> None:
        """Breaks the stream: every request in flight fails; the socket is closed by the caller
        that reads it, or here when none does."""
        with self._lock:
            if self._broken is not None:
                return
            self._broken = why
            failed = list(self._fifo) + list(self._busy.values())
            self._fifo.clear()
            self._busy.clear()
            self._late.clear()
            for pending in failed:
                if not pending.done:
                    pending.error = why
                    pending.done = True
            self._change.notify_all()
            reading, sock = self._reading, self._sock
        if reading:
            if sock is not None:
                # Wakes the reading caller, which closes the socket (never closed under it).
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        else:
            self._close_socket()

    def _send(self, data: bytes, deadline: Deadline) -> None:
        """Writes ``data`` whole before ``deadline`` (a frame half written breaks the stream);
        the caller holds ``_send_lock``, or owns the socket alone."""
        try:
            send_all(self._sock, data, deadline)
        except OSError as exc:
            why = f"sending on the keep-alive stream to {self.where} failed: {exc!r}"
            self._fail(why)
            raise _StreamBroken(why) from exc

    def _on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == _DATA and stream == _STREAM:
            if flags & _PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            self._on_data(payload, len(payload))
            if flags & _END_STREAM:
                raise ConnectionError("etcd ended the keep-alive stream")
        elif kind == _HEADERS and stream == _STREAM and flags & _END_STREAM:
            # Trailers (or a trailers-only answer): etcd ended the stream, with an error
            # (no leader, shutting down) or because it refused it.
            raise ConnectionError("etcd ended the keep-alive stream (gRPC trailers)")
        elif kind == _RST_STREAM and stream == _STREAM:
            code = int.from_bytes(payload[:4], "big") if len(payload) >= 4 else -1
            raise ConnectionError(f"etcd reset the keep-alive stream (HTTP/2 error {code})")
        elif kind == _GOAWAY:
            raise ConnectionError("etcd is closing the connection (HTTP/2 GOAWAY)")
        elif kind == _SETTINGS and not flags & _ACK:
            self._on_settings(payload)
            self._send_control(_frame(_SETTINGS, _ACK, 0))
        elif kind == _PING and not flags & _ACK:
            if len(payload) != 8:
                raise ValueError(_bad_ping(payload))
            ack = _frame(_PING, _ACK, 0, payload)
            if payload == _BDP_PING:
                with self._send_lock:
                    if not self._deferred_ack:  # at most one waits (else both go now)
                        self._deferred_ack = ack
                        return
            self._send_control(ack)
        elif kind == _PING and len(payload) != 8:  # (an ack: the same rule)
            raise ValueError(_bad_ping(payload))
        elif kind == _WINDOW_UPDATE and len(payload) >= 4:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            with self._lock:
                # A request waits for room only while a window is below the largest request.
                starved = min(self._conn_window, self._stream_window) < _MAX_REQUEST
                if stream == 0:
                    self._conn_window += increment
                elif stream == _STREAM:
                    self._stream_window += increment
                if starved:
                    self._change.notify_all()
        # Anything else (response headers, priorities, other streams' frames) is not ours.

    def _on_settings(self, payload: bytes) -> None:
        for at in range(0, len(payload) - 5, 6):
            ident, value = struct.unpack(">HI", payload[at : at + 6])
            if ident == _SETTINGS_INITIAL_WINDOW_SIZE:
                with self._lock:
                    self._stream_window += value - self._peer_initial_window
                    self._peer_initial_window = value
                    self._change.notify_all()

    def _on_data(self, payload: bytes, counted: int) -> None:
        self._grpc += payload
        self._received += counted
        if self._received >= _WINDOW_REFILL:
            refill = struct.pack(">I", self._received)
            self._received = 0
            self._send_control(
                _frame(_WINDOW_UPDATE, 0, 0, refill) + _frame(_WINDOW_UPDATE, 0, _STREAM, refill)
            )
        while len(self._grpc) >= 5:
            if self._grpc[0] != 0:
                raise ValueError("a compressed gRPC message (none was asked for)")
            size = int.from_bytes(self._grpc[1:5], "big")
            if size > MAX_KEEPALIVE_ANSWER:
                raise ValueError(
                    f"a gRPC message of {size} bytes declared, where a keep-alive answer is "
                    f"at most {MAX_KEEPALIVE_ANSWER} (MAX_KEEPALIVE_ANSWER; ~70 bytes from etcd)"
                )
            if len(self._grpc) < 5 + size:
                return
            message = bytes(self._grpc[5 : 5 + size])
            del self._grpc[: 5 + size]
            lease_id, ttl = parse_keepalive_response(message)
            self._answer(lease_id, ttl)

    def _answer(self, lease_id: int, ttl: int) -> None:
        with self._lock:
            if not self._fifo:
                raise ValueError(f"an answer for lease {lease_id:x} that nobody asked for")
            pending = self._fifo.popleft()
            if pending.lease_id != lease_id:
                raise ValueError(
                    f"an answer for lease {lease_id:x} where lease {pending.lease_id:x}'s was due"
                )
            if self._busy.get(lease_id) is pending:
                del self._busy[lease_id]
            self.answers += 1
            self._last_answer = time.monotonic()
            if ttl > 0 and (self._shortest_ttl is None or ttl < self._shortest_ttl):
                self._shortest_ttl = ttl
            pending.ttl = ttl
            pending.done = True
            if pending.kept:
                self._late[lease_id] = pending  # its caller comes back for it
            self._change.notify_all()

    def _send_control(self, data: bytes) -> None:
        with self._send_lock:
            ack, self._deferred_ack = self._deferred_ack, b""
            self._send(ack + data, Deadline.after(_CONTROL_SEND))
