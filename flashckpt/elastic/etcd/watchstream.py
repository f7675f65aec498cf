"""A long-lived etcd v3 watch that hands over its events (key, value, previous value).

:meth:`flashckpt.elastic.etcd.client.EtcdClient.wait_for_change` answers "did anything change?" and
closes the stream; a caller that must follow many changes then re-reads everything after each one.
This stream stays open and returns the events themselves, so a follower applies each change in O(1)
(the rendezvous' round lead counts joins this way, and a member counts machines waiting for the
next round, :mod:`flashckpt.elastic.rendezvous.handler`).

- :meth:`WatchStream.next_events` blocks until events arrive or its timeout passes;
- a broken stream (etcd restarted, a leader change, a proxy timeout) is opened again from the
  revision after the last event returned, on any endpoint of the client, so no event is lost or
  repeated;
- when etcd compacted the revisions the stream still needs, :class:`WatchCompacted` is raised:
  the caller re-reads its keys and opens a new stream from the revision of that read;
- :meth:`WatchStream.close` may be called from another thread and wakes a blocked reader.

It speaks the JSON gateway's ``/v3/watch`` through the client's own connection and retry
helpers (same endpoints, TLS settings and back-off).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd.client import EtcdClient, EtcdError, EtcdUnavailable, KeyValue
from flashckpt.errors import FlashckptError

__all__ = ["WatchClosed", "WatchCompacted", "WatchEvent", "WatchStream", "prefix_end"]

logger = logging.getLogger(__name__)


class WatchCompacted(EtcdError):
    """etcd compacted the history the watch needs: re-read, then watch from that read."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class WatchClosed(EtcdError):
    """The stream was closed (:meth:`WatchStream.close`)."""


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change of one key."""

    deleted: bool
    """A delete (the key is gone; :attr:`kv` holds its key and the revision of the delete)."""
    kv: KeyValue
    """The key after the change (for a delete: the key, an empty value, the delete's revision
    as ``mod_revision``)."""
    prev: KeyValue | None
    """The key before the change, if the stream asked for it and it existed."""


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"


def _kv(raw: dict[str, Any] | None) -> KeyValue | None:
    if not raw:
        return None
    return KeyValue(
        key=base64.b64decode(raw.get("key") or ""),
        value=base64.b64decode(raw.get("value") or ""),
        mod_revision=int(raw.get("mod_revision", 0)),
        create_revision=int(raw.get("create_revision", 0)),
        version=int(raw.get("version", 0)),
        lease=int(raw.get("lease", 0)),
    )


class WatchStream:
    """Events of the keys in ``[key, range_end)`` from ``start_revision`` on.

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
        self._conn: http.client.HTTPConnection | None = None
        self._response: http.client.HTTPResponse | None = None
        self._closed = False

    @property
    def next_revision(self) -> int:
        """The first revision not reported yet."""
        return self._next

    def close(self) -> None:
        """Ends the stream; a reader blocked in :meth:`next_events` gets :class:`WatchClosed`."""
        with self._lock:
            self._closed = True
            conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def next_events(self, timeout: timedelta) -> list[WatchEvent]:
        """The next events, in revision order; ``[]`` when ``timeout`` passed without any.

        Raises:
            WatchCompacted: The revisions still to report were compacted.
            WatchClosed: :meth:`close` was called.
            EtcdUnavailable: No endpoint accepted the watch for the whole ``timeout``.
        """
        deadline = Deadline.after(timeout)
        failures = 0
        while True:
            if self._closed:
                raise WatchClosed("the watch was closed")
            try:
                if self._response is None:
                    self._open(deadline)
                events = self._read(deadline)
            except _Broken as exc:
                self._drop()
                if self._closed:
                    raise WatchClosed("the watch was closed") from None
                failures += 1
                if deadline.expired():
                    if exc.connected:
                        return []
                    raise EtcdUnavailable(
                        f"no etcd endpoint of {list(self._client.endpoints)} kept a watch open "
                        f"within {timeout.total_seconds():g} s: {exc}"
                    ) from exc
                deadline.sleep(min(1.0, 0.05 * 2 ** min(failures, 5)))
                continue
            if events is None:
                return []  # the deadline passed, the stream stays open
            if events:
                return events

    def _open(self, deadline: Deadline) -> None:
        request: dict[str, Any] = {
            "key": base64.b64encode(self._key).decode(),
            "start_revision": str(self._next),
        }
        if self._range_end is not None:
            request["range_end"] = base64.b64encode(self._range_end).decode()
        if self._prev_kv:
            request["prev_kv"] = True
        payload = json.dumps({"create_request": request}).encode()
        client = self._client
        endpoint = client._endpoint_for(0)  # the one that answered last
        try:
            conn = client._connect(endpoint, deadline)
        except Exception as exc:  # _AttemptFailed or a TLS error
            client._prefer(client._endpoint_for(1))  # try the next one next time
            raise _Broken(f"cannot connect to {endpoint.url}: {exc}", connected=False) from exc
        with self._lock:
            if self._closed:
                conn.close()
                raise _Broken("closed", connected=False)
            self._conn = conn
        try:
            conn.request(
                "POST",
                "/v3/watch",
                body=payload,
                headers={"Content-Type": "application/json", "Accept": "application/json"},
            )
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            raise _Broken(f"watch on {endpoint.url} failed: {exc!r}", connected=False) from exc
        if response.status != 200:
            body = response.read()[:300]
            raise _Broken(
                f"watch on {endpoint.url}: HTTP {response.status}: {body!r}", connected=False
            )
        self._response = response

    def _read(self, deadline: Deadline) -> list[WatchEvent] | None:
        conn, response = self._conn, self._response
        assert conn is not None and response is not None
        while True:
            remaining = deadline.remaining()
            if remaining <= 0:
                return None
            try:
                assert conn.sock is not None
                conn.sock.settimeout(remaining)
                line = response.readline()
            except TimeoutError:
                return None
            except (OSError, http.client.HTTPException, AssertionError) as exc:
                raise _Broken(f"watch stream broke: {exc!r}", connected=True) from exc
            if not line:
                raise _Broken("the watch stream ended", connected=True)
            try:
                message = json.loads(line)
            except ValueError as exc:
                raise _Broken(f"unreadable watch message {line[:200]!r}", connected=True) from exc
            if "error" in message:
                raise _Broken(f"watch error: {message['error']}", connected=True)
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
                raise _Broken(f"etcd canceled the watch: {result}", connected=True)
            raw_events = result.get("events") or []
            if not raw_events:
                continue
            events: list[WatchEvent] = []
            for raw in raw_events:
                kv = _kv(raw.get("kv"))
                if kv is None:
                    continue
                if kv.mod_revision < self._next:
                    continue  # already reported before a reconnect
                events.append(
                    WatchEvent(
                        deleted=raw.get("type") == "DELETE",
                        kv=kv,
                        prev=_kv(raw.get("prev_kv")),
                    )
                )
            if events:
                self._next = max(e.kv.mod_revision for e in events) + 1
            return events

    def _drop(self) -> None:
        with self._lock:
            conn, self._conn, self._response = self._conn, None, None
        if conn is not None:
            conn.close()


class _Broken(FlashckptError):
    def __init__(self, message: str, *, connected: bool) -> None:
        super().__init__(message)
        self.connected = connected
