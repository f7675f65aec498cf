"""Unary gRPC calls to etcd (``KV.Range``, ``Put``, ``DeleteRange``, ``Txn``) on one persistent
HTTP/2 connection per client and process.

Every JSON-gateway request costs etcd far more CPU than the call it stands for: etcd's gateway
is a grpc-gateway proxy inside etcd (HTTP/1.1, JSON both ways, and a loopback gRPC call per
request); at 1,024 simulated machines etcd spent 0.45-0.8 ms of CPU per gateway request and the
rendezvous's first round was CPU-bound on it (issue 31). etcd's client port also serves gRPC
over HTTP/2 without TLS, which the lease keep-alive stream uses already
(:mod:`flashckpt.elastic.etcd._leasestream`); this module sends the key-value calls there too,
each a stream of its own on one connection: a new odd stream id per call, several calls in
flight from different threads, each answer matched to its call by stream id.

It speaks HTTP/2 (RFC 9113) with prior knowledge: request headers as HPACK literals, response
headers and trailers decoded in full (:mod:`flashckpt.elastic.etcd._hpack`: grpc-go uses the
dynamic table and Huffman coding) for ``:status``, ``grpc-status`` and ``grpc-message``; flow
control both ways (requests split to the peer's windows and frame size; the client's receive
windows are 2 GiB, reopened as they are used); SETTINGS, PING, GOAWAY and RST_STREAM. The
messages are protobuf (:mod:`flashckpt.elastic.etcd._kvproto`).

What a failed call tells its caller (the retry rules are the gateway's, applied by
:class:`~flashckpt.elastic.etcd._gateway.Gateway`):

- :class:`CallFailed` with ``sent=False``: etcd cannot have applied the request: the
  connection could not be opened or broke before the request's message was written whole, the
  stream was refused (``RST_STREAM REFUSED_STREAM``) or came after a GOAWAY's last stream id;
- :class:`CallFailed` with ``sent=True``: the message went out and no answer came (the
  connection broke, the stream was reset, the deadline passed): the outcome is unknown;
- :class:`GrpcError`: etcd answered with a non-OK ``grpc-status`` (mapped to the gateway's
  errors by the caller, by the same codes);
- :class:`NotHttp2`: the endpoint answered the connection's opening with something other than
  HTTP/2 (a TLS port, a proxy that passes HTTP/1.1 only); no request was sent on it, and the
  client sends its key-value calls to the gateway instead.

The connection is opened only once etcd's SETTINGS arrived, so a call is never written to a
peer that does not speak HTTP/2. A call whose deadline passes cancels its stream
(``RST_STREAM CANCEL``); if nothing at all came on the connection since that call was sent, for
at least ``_STUCK_S``, and no bytes wait unread, the connection is judged stuck and closed (the
next call opens a new one), as a timed-out gateway request closes its connection. Everything
read is bounded: frames to the 16 KiB this client allows, header blocks to
``_hpack.MAX_HEADER_LIST``, a message to ``MAX_MESSAGE``.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
import urllib.parse
from datetime import timedelta

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd._hpack import MAX_HEADER_LIST, HpackDecoder, HpackError
from flashckpt.elastic.etcd._leasestream import (
    NotHttp2,
    _frame,
    _hpack_literal,
    recv_exact,
    send_all,
)

__all__ = ["MAX_MESSAGE", "CallFailed", "GrpcChannel", "GrpcError", "NotHttp2"]

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PUSH_PROMISE, _PING, _GOAWAY = (
    0,
    1,
    2,
    3,
    4,
    5,
    6,
    7,
)
_WINDOW_UPDATE, _CONTINUATION = 8, 9
_END_STREAM = _ACK = 0x1
_END_HEADERS = 0x4
_PADDED = 0x8
_PRIORITY_FLAG = 0x20
_S_HEADER_TABLE_SIZE, _S_ENABLE_PUSH, _S_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
_S_INITIAL_WINDOW_SIZE, _S_MAX_FRAME_SIZE, _S_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6
_REFUSED_STREAM, _CANCEL = 0x7, 0x8
_MAX_WINDOW = 2**31 - 1
_DEFAULT_WINDOW = 65535
_DEFAULT_FRAME = 16384  # the largest frame this client accepts (it advertises no other)
_WINDOW_REFILL = 2**30  # received DATA bytes after which the connection window is reopened
_LAST_STREAM = 2**31 - 1
MAX_MESSAGE = 256 * 1024 * 1024
"""The largest answer accepted (etcd refuses requests over 1.5 MiB by default; a range's
answer can be larger)."""
# A call whose deadline passed breaks the connection when nothing was received on it since
# the call was sent, for this long at least, and no bytes wait unread (see the module doc).
_STUCK_S = 1.0
# How long the reader may block writing an acknowledgement before the connection is broken.
_CONTROL_SEND = timedelta(seconds=10)
# How long a caller whose deadline passed may block writing its stream's cancellation.
_CANCEL_SEND = timedelta(seconds=1)
_OK = 0


class CallFailed(Exception):
    """A call that got no answer; ``sent``: whether etcd may have applied it."""

    def __init__(self, message: str, *, sent: bool, timed_out: bool = False) -> None:
        super().__init__(message)
        self.sent = sent
        self.timed_out = timed_out


class GrpcError(Exception):
    """etcd answered a call with a non-OK ``grpc-status``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"gRPC status {code}: {message}")
        self.code = code
        self.grpc_message = message


class _Call:
    """One call's stream: what came back on it."""

    __slots__ = (
        "data",
        "done",
        "error",
        "got_headers",
        "message",
        "sent",
        "sent_at",
        "status",
        "window",
    )

    def __init__(self, window: int) -> None:
        self.window = window  # the peer's receive window of this stream (our sends)
        self.done = threading.Event()
        self.got_headers = False
        self.data = bytearray()
        self.status: int | None = None
        self.message = ""
        self.error: CallFailed | None = None
        self.sent = False  # the request's message was written whole
        self.sent_at = 0.0


class GrpcChannel:
    """One HTTP/2 connection to one etcd, carrying unary gRPC calls (see the module doc).

    Args:
        sock: A connected TCP socket to etcd's client port (no TLS); the channel owns it.
        authority: ``host:port`` of the endpoint (the HTTP/2 ``:authority``).
        where: The endpoint's URL, for messages.
        deadline: When opening the connection (etcd's SETTINGS) gives up.

    Raises:
        NotHttp2: The endpoint answered something other than HTTP/2.
        CallFailed: The opening could not be sent or etcd did not answer it in time
            (``sent=False``).
    """

    def __init__(self, sock: socket.socket, authority: str, where: str, deadline: Deadline) -> None:
        self.where = where
        self._authority = authority
        self._sock: socket.socket | None = sock
        self._lock = threading.Lock()  # the state below
        self._send_lock = threading.Lock()  # the socket's writes (stream ids open in order)
        self._changed = threading.Condition(self._lock)  # windows opened, streams ended
        self._calls: dict[int, _Call] = {}
        self._next_stream = 1
        self._broken: str | None = None
        self._draining = False  # a GOAWAY came (or ids ran out): no new calls
        self._conn_window = _DEFAULT_WINDOW
        self._peer_initial_window = _DEFAULT_WINDOW
        self._peer_max_frame = _DEFAULT_FRAME
        self._peer_max_streams = 2**31
        self._received = 0
        self._last_frame = time.monotonic()
        self._idle_since = time.monotonic()
        self._settled = threading.Event()  # etcd's first SETTINGS came (or the reader ended)
        self._not_http2: str | None = None
        self._closed_unanswered: str | None = None
        self._headers_cache: dict[str, bytes] = {}
        self._decoder = HpackDecoder()
        self.calls = 0
        """Calls answered (diagnostics and tests)."""
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        settings = struct.pack(
            ">HIHIHI",
            _S_ENABLE_PUSH,
            0,
            _S_INITIAL_WINDOW_SIZE,
            _MAX_WINDOW,
            _S_MAX_HEADER_LIST_SIZE,
            MAX_HEADER_LIST,
        )
        opening = (
            _PREFACE
            + _frame(_SETTINGS, 0, 0, settings)
            + _frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", _MAX_WINDOW - _DEFAULT_WINDOW))
        )
        try:
            self._send(opening, deadline)
        except CallFailed:
            sock.close()
            self._sock = None
            raise
        self._reader = threading.Thread(target=self._read_loop, name="etcd-grpc-kv", daemon=True)
        self._reader.start()
        if not self._settled.wait(max(0.0, deadline.remaining())):
            self.close()
            raise CallFailed(
                f"{where} did not answer the opening of an HTTP/2 connection in time",
                sent=False,
                timed_out=True,
            )
        if self._not_http2 is not None:
            raise NotHttp2(self._not_http2, definite=True)
        if self._closed_unanswered is not None:
            raise NotHttp2(self._closed_unanswered, definite=False)
        if self._broken is not None:
            raise CallFailed(self._broken, sent=False)

    @property
    def usable(self) -> bool:
        """Whether new calls may go on this connection: not broken, not draining, and, while no
        call is in flight, not closed by etcd already. A FIN or RST that the reader thread has
        not acted on yet (a busy host) would otherwise take the next call's request, which then
        counts as sent with no answer (outcome unknown); an idle connection is checked before
        reuse, as the gateway's pooled ones are."""
        if self._broken is not None or self._draining:
            return False
        if not self._calls and self._peer_closed():
            self._fail(f"{self.where}: etcd closed the connection while it was idle")
            return False
        return True

    def _peer_closed(self) -> bool:
        """Whether the socket holds etcd's close (EOF or an error) ahead of any data; a peek,
        nothing is consumed."""
        sock = self._sock
        if sock is None:
            return True
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    @property
    def draining(self) -> bool:
        """Whether the connection takes no new calls but finishes those in flight (it closes
        itself after the last)."""
        return self._broken is None and self._draining

    def idle_for(self) -> float:
        """Seconds since the last call ended, 0 while calls are in flight."""
        with self._lock:
            return 0.0 if self._calls else time.monotonic() - self._idle_since

    def call(self, path: str, message: bytes, deadline: Deadline) -> bytes:
        """One unary call: ``message`` (protobuf) to method ``path``; returns the answer's
        message.

        Raises:
            CallFailed: No answer (``sent`` says whether etcd may have applied it).
            GrpcError: etcd answered a non-OK status.
        """
        if len(message) > MAX_MESSAGE:
            raise CallFailed(f"a request of {len(message)} bytes", sent=False)
        headers = self._headers_cache.get(path)
        if headers is None:
            headers = self._headers_cache[path] = b"".join(
                _hpack_literal(name, value)
                for name, value in (
                    (":method", "POST"),
                    (":scheme", "http"),
                    (":path", path),
                    (":authority", self._authority),
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                )
            )
        payload = b"\x00" + struct.pack(">I", len(message)) + message
        with self._lock:
            while self._broken is None and len(self._calls) >= self._peer_max_streams:
                if not self._changed.wait(deadline.remaining()):
                    raise CallFailed(
                        f"{self.where}: no free stream before the deadline",
                        sent=False,
                        timed_out=True,
                    )
        with self._send_lock:
            with self._lock:
                self._check_open()
                stream = self._next_stream
                self._next_stream += 2
                if self._next_stream > _LAST_STREAM:
                    self._draining = True  # the next call opens a new connection
                call = _Call(self._peer_initial_window)
                self._calls[stream] = call
                whole = min(self._conn_window, call.window) >= len(payload) and (
                    len(payload) <= self._peer_max_frame
                )
                if whole:
                    self._conn_window -= len(payload)
                    call.window -= len(payload)
            if whole:
                wire = _frame(_HEADERS, _END_HEADERS, stream, headers) + _frame(
                    _DATA, _END_STREAM, stream, payload
                )
            else:
                wire = _frame(_HEADERS, _END_HEADERS, stream, headers)
            call.sent_at = time.monotonic()
            # Set before the write: etcd may answer before this thread runs again.
            call.sent = whole
            try:
                self._send(wire, deadline)
            except CallFailed as exc:
                # Some bytes of the message may have gone out, never all: etcd cannot apply it.
                raise self._unsent(stream, call, exc) from exc
        if not whole:
            self._send_data(stream, call, payload, deadline)
        if not call.done.wait(max(0.0, deadline.remaining())):
            self._give_up(stream, call)
        return self._outcome(stream, call)

    def close(self) -> None:
        """Closes the connection; calls in flight fail (``sent=True``: outcome unknown)."""
        self._fail("the etcd gRPC connection was closed")

    def _abandon(self) -> None:
        """In a forked child: closes this process's copy of the socket, nothing else."""
        sock = self._sock
        if sock is not None:
            sock.close()

    # ------------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._broken is not None:
            raise CallFailed(self._broken, sent=False)
        if self._draining:
            raise CallFailed(f"{self.where} is closing the connection (GOAWAY)", sent=False)

    def _outcome(self, stream: int, call: _Call) -> bytes:
        if call.error is not None:
            raise call.error
        status = call.status
        if status != _OK:
            raise GrpcError(-1 if status is None else status, call.message)
        data = call.data
        if len(data) < 5 or data[0] != 0:
            raise CallFailed(
                f"{self.where}: a gRPC answer without a (plain) message on stream {stream}",
                sent=True,
            )
        size = int.from_bytes(data[1:5], "big")
        if len(data) != 5 + size:
            raise CallFailed(
                f"{self.where}: a gRPC answer of {len(data)} bytes framing a {size}-byte message",
                sent=True,
            )
        return bytes(data[5:])

    def _send_data(self, stream: int, call: _Call, payload: bytes, deadline: Deadline) -> None:
        """Sends a message that did not fit the windows at once, a frame at a time."""
        view = memoryview(payload)
        while view:
            with self._lock:
                while self._broken is None and not call.done.is_set():
                    room = min(self._conn_window, call.window, self._peer_max_frame)
                    if room > 0:
                        break
                    if not self._changed.wait(deadline.remaining()):
                        break
                room = min(self._conn_window, call.window, self._peer_max_frame, len(view))
                ok = self._broken is None and not call.done.is_set() and room > 0
                if ok:
                    self._conn_window -= room
                    call.window -= room
            if not ok:
                if call.done.is_set():
                    return  # etcd answered (an error) before the whole message went
                self._cancel(stream)
                self._end(
                    stream,
                    CallFailed(
                        f"{self.where}: the request did not fit etcd's flow-control windows "
                        "before the deadline",
                        sent=False,
                        timed_out=True,
                    ),
                )
                return
            last = room == len(view)
            chunk = _frame(_DATA, _END_STREAM if last else 0, stream, bytes(view[:room]))
            view = view[room:]
            call.sent = last  # before the write: etcd may answer before this thread runs again
            try:
                with self._send_lock:
                    self._send(chunk, deadline)
            except CallFailed as exc:
                self._unsent(stream, call, exc)
                return

    def _unsent(self, stream: int, call: _Call, exc: CallFailed) -> CallFailed:
        """Ends a call whose message could not be written whole (etcd cannot have applied it),
        whatever the broken connection told its calls."""
        call.sent = False
        error = CallFailed(str(exc), sent=False, timed_out=exc.timed_out)
        call.error = error
        self._end(stream, error)
        return error

    def _give_up(self, stream: int, call: _Call) -> None:
        """The deadline passed without an answer: cancels the stream, and breaks the connection
        if it looks stuck (nothing received since the call was sent)."""
        if call.done.is_set():
            return  # answered just now
        with self._lock:
            last = self._last_frame
            sock = self._sock
        self._cancel(stream)
        self._end(
            stream,
            CallFailed(
                f"{self.where}: no answer before the deadline", sent=call.sent, timed_out=True
            ),
        )
        stuck = time.monotonic() - call.sent_at >= _STUCK_S and last < call.sent_at
        if stuck and sock is not None:
            with contextlib.suppress(OSError, ValueError):
                poller = select.poll()
                poller.register(sock, select.POLLIN)
                stuck = not poller.poll(0)
        if stuck:
            self._fail(f"nothing received from {self.where} for {time.monotonic() - last:.1f} s")

    def _cancel(self, stream: int) -> None:
        """Tells etcd to drop a call nobody waits for; a connection that cannot take those few
        bytes within ``_CANCEL_SEND`` is broken."""
        with contextlib.suppress(CallFailed), self._send_lock:
            self._send(
                _frame(_RST_STREAM, 0, stream, struct.pack(">I", _CANCEL)),
                Deadline.after(_CANCEL_SEND),
            )

    def _end(self, stream: int, error: CallFailed | None) -> None:
        """Ends a call: with ``error``, or with what its stream received."""
        with self._lock:
            call = self._calls.pop(stream, None)
            if not self._calls:
                self._idle_since = time.monotonic()
            drained = self._draining and not self._calls and self._broken is None
            self._changed.notify_all()
        if call is not None and not call.done.is_set():
            if error is not None:
                call.error = error
            call.done.set()
        if drained:
            self._fail(f"{self.where}: the connection was drained (GOAWAY or stream ids used up)")

    def _fail(self, why: str) -> None:
        """Breaks the connection: every call in flight fails (outcome unknown)."""
        with self._lock:
            if self._broken is None:
                self._broken = why
            calls = list(self._calls.items())
            self._calls.clear()
            self._idle_since = time.monotonic()
            self._changed.notify_all()
            sock = self._sock
        for _, call in calls:
            if not call.done.is_set():
                call.error = CallFailed(why, sent=call.sent)
                call.done.set()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _send(self, data: bytes, deadline: Deadline) -> None:
        """Writes ``data`` whole before ``deadline``; the caller holds ``_send_lock`` or owns
        the socket alone. A write that fails breaks the connection."""
        try:
            send_all(self._sock, data, deadline)
        except OSError as exc:
            why = f"sending to {self.where} over gRPC failed: {exc!r}"
            self._fail(why)
            raise CallFailed(why, sent=False, timed_out=isinstance(exc, TimeoutError)) from exc

    def _send_control(self, data: bytes) -> None:
        with self._send_lock:
            self._send(data, Deadline.after(_CONTROL_SEND))

    def _recv_exact(self, size: int, buffer: bytearray) -> bytes:
        return recv_exact(self._sock, size, buffer, f"{self.where} closed the gRPC connection")

    def _read_loop(self) -> None:
        buffer = bytearray()
        first = True
        block = bytearray()  # a header block continued in CONTINUATION frames
        block_stream = 0
        block_end_stream = False
        try:
            while True:
                head = self._recv_exact(9, buffer)
                size = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                if first and (
                    kind != _SETTINGS or stream != 0 or flags & _ACK or size > _DEFAULT_FRAME
                ):
                    self._not_http2 = (
                        f"{self.where} does not speak HTTP/2 (gRPC) without TLS: it "
                        f"answered {bytes(head + buffer[:40])!r}"
                    )
                    raise ConnectionError(self._not_http2)
                if size > _DEFAULT_FRAME:
                    raise ValueError(f"an HTTP/2 frame of {size} bytes (at most 16384 allowed)")
                payload = self._recv_exact(size, buffer)
                with self._lock:
                    self._last_frame = time.monotonic()
                if block_stream:
                    if kind != _CONTINUATION or stream != block_stream:
                        raise ValueError("an HTTP/2 header block interrupted by another frame")
                    block += payload
                    if len(block) > MAX_HEADER_LIST:
                        raise ValueError("an HTTP/2 header block over the bound")
                    if flags & _END_HEADERS:
                        self._on_headers(block_stream, bytes(block), block_end_stream)
                        block.clear()
                        block_stream = 0
                    continue
                if kind == _HEADERS:
                    fragment = self._unpad(payload, flags)
                    if flags & _PRIORITY_FLAG:
                        fragment = fragment[5:]
                    if not stream:
                        raise ValueError("HTTP/2 HEADERS on stream 0")
                    if flags & _END_HEADERS:
                        self._on_headers(stream, fragment, bool(flags & _END_STREAM))
                    else:
                        block[:] = fragment
                        block_stream, block_end_stream = stream, bool(flags & _END_STREAM)
                elif kind == _CONTINUATION:
                    raise ValueError("an HTTP/2 CONTINUATION without its HEADERS")
                else:
                    self._on_frame(kind, flags, stream, payload)
                if first:
                    first = False
                    self._settled.set()
        except (OSError, ValueError, HpackError, CallFailed) as exc:
            if first and self._not_http2 is None:
                self._closed_unanswered = (
                    f"{self.where} closed the connection without answering an HTTP/2 opening: {exc}"
                )
            self._fail(f"the gRPC connection to {self.where} broke: {exc}")
        finally:
            self._settled.set()
            with self._send_lock:
                sock, self._sock = self._sock, None
                if sock is not None:
                    sock.close()

    @staticmethod
    def _unpad(payload: bytes, flags: int) -> bytes:
        if not flags & _PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ValueError("an HTTP/2 frame with invalid padding")
        return payload[1 : len(payload) - payload[0]]

    def _on_headers(self, stream: int, block: bytes, end_stream: bool) -> None:
        headers = self._decoder.decode(block)  # always: the table is the connection's
        with self._lock:
            call = self._calls.get(stream)
        if call is None:
            return  # a call that gave up
        fields = dict(headers)
        if not call.got_headers:
            call.got_headers = True
            status = fields.get(":status")
            if status != "200":
                self._end(
                    stream,
                    CallFailed(f"{self.where} answered HTTP status {status} over gRPC", sent=True),
                )
                return
        elif not end_stream:
            raise ValueError("a second HTTP/2 header block that does not end its stream")
        if end_stream:
            self._finish(stream, call, fields)

    def _finish(self, stream: int, call: _Call, trailers: dict[str, str]) -> None:
        raw = trailers.get("grpc-status")
        if raw is None or not raw.isdigit() or len(raw) > 3:
            self._end(
                stream,
                CallFailed(f"{self.where}: a gRPC answer without grpc-status ({raw!r})", sent=True),
            )
            return
        call.status = int(raw)
        call.message = urllib.parse.unquote(trailers.get("grpc-message", ""))[:1000]
        with self._lock:
            self.calls += 1
        self._end(stream, None)

    def _on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == _DATA:
            self._received += len(payload)
            if self._received >= _WINDOW_REFILL:
                refill = struct.pack(">I", self._received)
                self._received = 0
                self._send_control(_frame(_WINDOW_UPDATE, 0, 0, refill))
            if not stream:
                raise ValueError("HTTP/2 DATA on stream 0")
            with self._lock:
                call = self._calls.get(stream)
            if call is None:
                return
            call.data += self._unpad(payload, flags)
            if len(call.data) > MAX_MESSAGE + 5:
                self._cancel(stream)
                self._end(
                    stream,
                    CallFailed(f"{self.where}: an answer over {MAX_MESSAGE} bytes", sent=True),
                )
            elif flags & _END_STREAM:
                self._end(
                    stream,
                    CallFailed(f"{self.where}: a gRPC stream ended without trailers", sent=True),
                )
        elif kind == _RST_STREAM:
            code = int.from_bytes(payload[:4], "big") if len(payload) == 4 else -1
            with self._lock:
                call = self._calls.get(stream)
            sent = call is not None and call.sent and code != _REFUSED_STREAM
            self._end(
                stream,
                CallFailed(f"{self.where} reset the gRPC stream (HTTP/2 error {code})", sent=sent),
            )
        elif kind == _SETTINGS:
            if flags & _ACK:
                return
            if len(payload) % 6 or stream:
                raise ValueError("an invalid HTTP/2 SETTINGS frame")
            self._on_settings(payload)
            self._send_control(_frame(_SETTINGS, _ACK, 0))
        elif kind == _PING:
            if len(payload) != 8:
                raise ValueError("an HTTP/2 PING of the wrong size")
            if not flags & _ACK:
                self._send_control(_frame(_PING, _ACK, 0, payload))
        elif kind == _GOAWAY:
            if len(payload) < 8:
                raise ValueError("a short HTTP/2 GOAWAY")
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            with self._lock:
                self._draining = True
                refused = [s for s in self._calls if s > last]
                idle = not self._calls
            for other in refused:  # never processed: safe to send again
                self._end(
                    other,
                    CallFailed(f"{self.where} is closing the connection (GOAWAY)", sent=False),
                )
            if idle:
                raise ConnectionError(f"{self.where} is closing the connection (GOAWAY)")
        elif kind == _WINDOW_UPDATE:
            if len(payload) != 4:
                raise ValueError("an HTTP/2 WINDOW_UPDATE of the wrong size")
            increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
            with self._lock:
                if not stream:
                    self._conn_window += increment
                else:
                    call = self._calls.get(stream)
                    if call is not None:
                        call.window += increment
                self._changed.notify_all()
        elif kind == _PUSH_PROMISE:
            raise ValueError("an HTTP/2 PUSH_PROMISE (push is disabled)")
        # PRIORITY and unknown frame types are ignored (RFC 9113 section 4.1).

    def _on_settings(self, payload: bytes) -> None:
        with self._lock:
            for at in range(0, len(payload), 6):
                ident, value = struct.unpack(">HI", payload[at : at + 6])
                if ident == _S_INITIAL_WINDOW_SIZE:
                    if value > _MAX_WINDOW:
                        raise ValueError(f"an HTTP/2 initial window of {value}")
                    delta = value - self._peer_initial_window
                    self._peer_initial_window = value
                    for call in self._calls.values():
                        call.window += delta
                elif ident == _S_MAX_FRAME_SIZE:
                    if not _DEFAULT_FRAME <= value < 2**24:
                        raise ValueError(f"an HTTP/2 max frame size of {value}")
                    self._peer_max_frame = value
                elif ident == _S_MAX_CONCURRENT_STREAMS:
                    self._peer_max_streams = max(1, value)
            self._changed.notify_all()
