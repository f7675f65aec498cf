"""A long-lived etcd v3 watch that hands over its events (key, value, previous value): the one
watch of the client (:meth:`~flashckpt.elastic.etcd.client.EtcdClient.watch_events` and
:meth:`~flashckpt.elastic.etcd.client.EtcdClient.wait_for_change` run on it too)."""

from __future__ import annotations

import binascii
import contextlib
import json
import logging
import math
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd._gateway import (
    INITIAL_BACKOFF_S,
    MAX_BACKOFF_S,
    Endpoint,
    Gateway,
    _AttemptFailed,
    _AuthRetry,
    auth_problem,
    cert_refused,
    error_from_response,
)
from flashckpt.elastic.etcd._wire import KeyValue, b64, kv_from_event_json, prefix_end
from flashckpt.elastic.etcd.errors import EtcdError, EtcdUnavailable, WatchClosed, WatchCompacted

__all__ = ["WatchClosed", "WatchCompacted", "WatchEvent", "WatchStream", "prefix_end"]

logger = logging.getLogger(__name__)

# A watch request etcd has not answered is waited for across calls this long, then the next
# endpoint is tried (an overloaded etcd answers late; reconnecting would add to its load).
_WATCH_OPEN_PATIENCE_S = 30.0

# The longest watch message (one JSON line) read before the stream fails: a peer that never
# ends its line would otherwise grow the buffer without bound. etcd takes a request of at most
# 1.5 MiB by default (--max-request-bytes), so one revision's events are about that much, 4/3
# of it in base64; a response may batch several revisions (catching up after a reconnect), each
# event with its previous value (prev_kv). This project's keys and values are a few KiB at
# most (the largest value the rendezvous writes is ~1 KB at 1,024 machines): 64 MiB is ~30
# maximal requests' worth, far above any message it is sent, and bounds what one stream holds.
MAX_WATCH_MESSAGE = 64 * 2**20


_JSON = json.JSONDecoder()


def _json_line(line: bytes) -> Any:
    """``json.loads(line)``, with less work for a line that starts as every message of etcd
    does (``{``): decoded as ``json.loads`` decodes UTF-8, one scan, then only whitespace may
    follow (``json.loads``'s "Extra data" otherwise). Raises ``ValueError`` as it does."""
    if not line.startswith(b"{"):
        return json.loads(line)
    text = line.decode("utf-8", "surrogatepass")
    message, end = _JSON.raw_decode(text)
    if text[end:].strip(" \t\n\r"):
        raise json.JSONDecodeError("Extra data", text, end)
    return message


def _kv_problem(kv: Any, where: str) -> str | None:
    """What is wrong with a watch event's ``kv`` or ``prev_kv`` (None: nothing found)."""
    if not isinstance(kv, dict):
        return f"{where}: expected a JSON object, got {kv!r:.80}"
    for field in ("key", "mod_revision"):
        if field not in kv:
            return f"{where}.{field}: missing (every event's key has one)"
    for field in ("key", "value"):
        text: Any = kv.get(field)
        if text is None and field == "value":
            continue
        try:
            binascii.a2b_base64(text, strict_mode=True)
        except (TypeError, ValueError) as exc:
            return f"{where}.{field}: expected base64 text, got {text!r:.80} ({exc})"
    for field in ("mod_revision", "create_revision", "version", "lease"):
        number = kv.get(field, 0)
        try:
            int(number)
        except (TypeError, ValueError):
            return f"{where}.{field}: expected an integer (a string of digits), got {number!r:.80}"
    if int(kv["mod_revision"]) < 1:
        return f"{where}.mod_revision: expected a revision >= 1, got {kv['mod_revision']!r:.80}"
    return None


def _problem(message: dict[str, Any], exc: BaseException) -> str:
    """Names what is wrong in a watch message whose decoding raised ``exc`` (the field, what
    was expected); found again here, off the hot path, only when decoding failed."""
    result = message.get("result")
    if not isinstance(result, dict):
        return f"result: expected a JSON object, got {result!r:.80}"
    compact = result.get("compact_revision")
    if compact is not None:
        try:
            int(compact)
        except (TypeError, ValueError):
            return f"result.compact_revision: expected an integer, got {compact!r:.80}"
    events = result.get("events")
    if events is not None and not isinstance(events, list):
        return f"result.events: expected a JSON list, got {events!r:.80}"
    for i, event in enumerate(events or ()):
        where = f"result.events[{i}]"
        if not isinstance(event, dict):
            return f"{where}: expected a JSON object, got {event!r:.80}"
        if "kv" not in event:
            return f"{where}.kv: missing (every event has one)"
        problem = _kv_problem(event["kv"], f"{where}.kv")
        if problem is not None:
            return problem
        kind = event.get("type")
        if kind not in (None, "PUT", "DELETE"):
            return f'{where}.type: expected "PUT" or "DELETE", got {kind!r:.80}'
        prev = event.get("prev_kv")
        if prev is not None:
            problem = _kv_problem(prev, f"{where}.prev_kv")
            if problem is not None:
                return problem
    return f"{type(exc).__name__}: {exc}"


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


class HoldsTransport(Protocol):
    """What holds the connections a watch opens its own beside (an ``EtcdClient``)."""

    @property
    def transport(self) -> Gateway: ...


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
        client: The etcd client, or its transport (its endpoints and TLS settings are used).
        key: First key of the range.
        range_end: End of the range (exclusive); ``None``: the single key ``key``.
        start_revision: First revision to report.
        prev_kv: Also report each key's previous value (a delete then says what was deleted).
    """

    def __init__(
        self,
        client: Gateway | HoldsTransport,
        key: bytes,
        range_end: bytes | None,
        start_revision: int,
        *,
        prev_kv: bool = False,
    ) -> None:
        if start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, got {start_revision}")
        # An EtcdClient's transport (a Gateway, or what stands in for one, has none).
        transport: Any = getattr(client, "transport", client)
        self._client: Gateway = transport
        self._key = key
        self._range_end = range_end
        self._next = start_revision
        self._prev_kv = prev_kv
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._token = ""  # the auth token the stream was opened with ("": none)
        # The socket's poller when it is a plain one (see _open), else None.
        self._poller: select.poll | None = None
        self._endpoint: Endpoint | None = None
        self._raw = bytearray()  # received, not yet de-chunked
        self._body = bytearray()  # de-chunked, not yet a whole line
        self._chunk_left = 0  # bytes of the current chunk still to come (+2 for its CRLF)
        self._scanned = 0  # bytes at the start of _body known to hold no newline
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
                if isinstance(exc, _AuthRetry):
                    self._client._forget_token(self._token)
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
                deadline.sleep(min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * 2 ** min(failures, 5)))
                continue
            if events is None:
                return []  # the deadline passed; the stream stays open
            if events:
                return events

    # ------------------------------------------------------------------------ transport

    def _open(self, deadline: Deadline) -> None:
        request: dict[str, Any] = {"key": b64(self._key), "start_revision": str(self._next)}
        if self._range_end is not None:
            request["range_end"] = b64(self._range_end)
        if self._prev_kv:
            request["prev_kv"] = True
        payload = json.dumps({"create_request": request}).encode()
        client = self._client
        endpoint = client._endpoint_for(0)  # the one that answered last
        try:
            headers, self._token = client._headers(endpoint, deadline)
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
        self._scanned = 0
        host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
        head = (
            f"POST /v3/watch HTTP/1.1\r\nHost: {host}:{endpoint.port}\r\n"
            + "".join(f"{name}: {value}\r\n" for name, value in headers.items())
            + f"Content-Length: {len(payload)}\r\n\r\n"
        )
        try:
            sock.settimeout(max(0.001, deadline.remaining()))
            sock.sendall(head.encode() + payload)
            self._poller = None
            if not isinstance(sock, ssl.SSLSocket):  # (TLS buffers what poll() cannot see)
                # From here a blocking socket read when poll() says so: a read costs no
                # timeout change, and a quiet slice no TimeoutError (issue 31: a node watch
                # per simulated machine, each woken every slice).
                sock.settimeout(None)
                self._poller = select.poll()
                self._poller.register(sock, select.POLLIN)
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
            refused = cert_refused(exc, endpoint.url)
            if refused is not None:
                raise refused from exc
            raise _AttemptFailed(
                f"watch on {endpoint.url} failed: {exc!r}", sent=False, timed_out=False
            ) from exc
        if head is None:
            return False
        self._opened_at = None
        status, headers = head
        if status != 200:
            body = self._read_error_body(headers, deadline)
            error = error_from_response(status, body, endpoint, "/v3/watch")
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
        poller = self._poller
        if poller is not None:
            if not poller.poll(min(math.ceil(remaining * 1000), 2**31 - 1)):  # (C int ms)
                return False
            try:
                data = sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True  # nothing after all: the caller reads again
        else:
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
            newline = self._body.find(b"\n", self._scanned)  # (only what came since)
            if newline >= 0:
                self._scanned = 0
                if newline >= MAX_WATCH_MESSAGE:
                    raise self._too_long()
                line = bytes(self._body[: newline + 1])
                del self._body[: newline + 1]
                return line
            self._scanned = len(self._body)
            if self._scanned > MAX_WATCH_MESSAGE:
                raise self._too_long()
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
            raw = self._raw
            end = raw.find(b"\r\n")
            if end < 0:
                if len(raw) > 1024:
                    raise ValueError("a chunk header of more than 1 KiB")
                return None
            size = int(bytes(raw[:end]).split(b";")[0].strip() or b"0", 16)
            if size <= 0:
                if size < 0:
                    raise ValueError(f"a chunk of {size} bytes")
                raise ConnectionError("etcd ended the watch stream")
            start = end + 2
            last = start + size - 1  # the chunk's last data byte
            if (
                not self._body
                and len(raw) >= last + 3
                and raw[last] == 0x0A
                and raw.find(b"\n", start, last) < 0
            ):
                # The common case: a whole chunk here that is one whole line (etcd sends each
                # message as a chunk of its own): the line, without copying it through _body.
                line = bytes(raw[start : last + 1])
                del raw[: last + 3]
                return line
            del raw[:start]
            self._chunk_left = size + 2

    def _too_long(self) -> EtcdUnavailable:
        self._body.clear()  # (freed now, not when the stream is opened again)
        endpoint = self._endpoint.url if self._endpoint is not None else "etcd"
        return EtcdUnavailable(
            f"a watch message from {endpoint} ran past {MAX_WATCH_MESSAGE // 2**20} MiB without "
            f"ending its line (MAX_WATCH_MESSAGE: etcd sends one JSON message per line, far "
            f"shorter); the stream was dropped, and the next call opens it again from revision "
            f"{self._next}. Is {endpoint} an etcd v3 client URL, with no proxy that alters "
            "its answers?"
        )

    def _malformed(self, line: bytes, problem: str) -> EtcdUnavailable:
        """The error of a watch message that is not what etcd sends: the stream fails (the
        caller's "stream failed" path) and is opened again from the revision after the last
        event returned, so nothing is skipped or repeated."""
        endpoint = self._endpoint.url if self._endpoint is not None else "etcd"
        return EtcdUnavailable(
            f"malformed watch message from {endpoint}: {problem} (message: {line[:200]!r}); "
            f"the stream was dropped, and the next call opens it again from revision "
            f"{self._next}. Is {endpoint} an etcd v3 client URL, with no proxy that alters "
            "its answers?"
        )

    def _read(self, deadline: Deadline) -> list[WatchEvent] | None:
        endpoint = self._endpoint.url if self._endpoint is not None else "etcd"
        while True:
            try:
                line = self._next_line()
                if line is None:
                    if not self._recv(deadline):
                        return None
                    continue
                message = _json_line(line)
            except (OSError, ValueError) as exc:
                raise _AttemptFailed(
                    f"watch stream from {endpoint} broke: {exc!r}", sent=True, timed_out=False
                ) from exc
            if not isinstance(message, dict):
                raise self._malformed(line, f"expected a JSON object, got {type(message).__name__}")
            if "error" in message:
                auth = auth_problem(str(message["error"]), endpoint, "/v3/watch")
                if auth is not None:
                    raise auth
                # A broken watch (for example after a leader change): open it again.
                raise _AttemptFailed(
                    f"watch error from {endpoint}: {message['error']}", sent=True, timed_out=False
                )
            try:
                events = self._events(message)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise self._malformed(line, _problem(message, exc)) from exc
            if events:
                self._next = max(e.kv.mod_revision for e in events) + 1
                return events

    def _events(self, message: dict[str, Any]) -> list[WatchEvent]:
        """The new events of one watch message; raises ``KeyError``, ``TypeError``,
        ``ValueError`` or ``AttributeError`` for a malformed one (:func:`_problem` says what),
        before anything is reported."""
        result = message.get("result")
        if result is None:
            return []
        compact = result.get("compact_revision")
        if compact is not None and int(compact) > 0:
            compact = int(compact)
            self._drop()
            raise WatchCompacted(
                f"etcd compacted revisions up to {compact}; the watch needed "
                f"{self._next} on: re-read the keys",
                compact,
            )
        if result.get("canceled"):
            auth = auth_problem(str(result.get("cancel_reason", "")), "etcd", "/v3/watch")
            if auth is not None:
                raise auth
            raise _AttemptFailed(f"etcd canceled the watch: {result}", sent=True, timed_out=False)
        raws = result.get("events")
        if raws is None:
            return []
        if type(raws) is not list:
            raise TypeError("events")
        events: list[WatchEvent] = []
        after = self._next
        for raw in raws:
            kv = kv_from_event_json(raw["kv"])
            if kv.mod_revision < after:
                if kv.mod_revision < 1:
                    raise ValueError("mod_revision")
                continue  # already reported before a reconnect
            kind = raw.get("type")
            deleted = kind == "DELETE"
            if kind is not None and not deleted and kind != "PUT":
                raise ValueError("type")
            prev = raw.get("prev_kv")
            events.append(
                WatchEvent(
                    deleted=deleted,
                    kv=kv,
                    prev=kv_from_event_json(prev) if prev is not None else None,
                )
            )
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
