"""Trainer <-> node agent messages: one JSON object per line over a local Unix socket.

The messages are typed in :mod:`flashckpt.protocol.messages` (one class per request, reply and
event, and the one validation of what the agent receives); this module moves them. Requests carry an
``id``; the agent answers each with ``{"id": ..., "ok": ...}``. The agent also
pushes events (``{"event": ...}``, no id) such as a committed step or a persistence error. JSON
only: nothing on this channel is ever unpickled.

Requests: ``hello`` (a trainer takes its local-rank position; the reply names its slots), ``alloc``
(slots for the position this connection said hello for, nothing else), ``snap`` (one-way: a
snapshot is complete), ``hash`` (record the data hash of every complete snapshot now,
before a restore checks them), ``restored``, ``flush``, ``done``, ``status``, ``ping``.

A client connects only to a socket of its own user in a run dir private to that user
(:func:`check_socket`); anything else is another user's and is refused, never retried.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from flashckpt.errors import AgentError, ProtocolError, UnsafeLocalStateError
from flashckpt.format.shm import check_private_dir
from flashckpt.names import socket_path
from flashckpt.protocol.messages import Reply, Request, parse_event, parse_reply

__all__ = [
    "AgentClient",
    "AgentError",
    "check_depth",
    "check_socket",
    "default_node_id",
    "default_run_dir",
    "socket_path",
]

log = logging.getLogger(__name__)

MAX_LINE = 16 << 20


def default_node_id() -> str:
    """This machine's node id: its host name, confined to the characters of a segment name."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64] or "node"


def default_run_dir() -> str:
    return os.path.join("/tmp", f"flashckpt-{os.getuid()}")


def send_msg(sock: socket.socket, obj: dict[str, Any], lock: threading.Lock) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
    with lock:
        # MSG_NOSIGNAL: a peer that went away gives EPIPE, never a SIGPIPE, whatever the
        # process's SIGPIPE disposition (an embedding application may have reset it).
        sock.sendall(data, socket.MSG_NOSIGNAL)


MAX_DEPTH = 64
"""Deepest nesting of arrays and objects a message may have (the protocol's own use 3)."""

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(rb"[\[\]{}]")


def check_depth(line: bytes, limit: int = MAX_DEPTH) -> None:
    """Refuses a JSON text nested deeper than ``limit`` before it is parsed (a deep one would
    exhaust the parser's recursion: a ``RecursionError`` from the agent's reader thread).

    Raises:
        ProtocolError: it is nested deeper, naming the limit.
    """
    if line.count(b"[") + line.count(b"{") <= limit:
        return  # the common case: too few brackets to be nested that deep
    depth = 0
    for m in _BRACKETS.finditer(_STRINGS.sub(b'""', line)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        if depth > limit:
            raise ProtocolError(
                f"message nested deeper than {limit} levels of arrays and objects: refused "
                "unread (the protocol's messages nest 3 levels)"
            )


class LineReader:
    """Reads newline-delimited JSON objects from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def read(self) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buf += chunk
            if len(self.buf) > MAX_LINE:
                raise ValueError("message too long")
        line, self.buf = self.buf.split(b"\n", 1)
        check_depth(line)
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError("message is not a JSON object")
        return obj


class AgentClient:
    """A trainer's connection to its node agent.

    Args:
        path: the agent's socket.
        on_event: called (from the reader thread) with every pushed event.
        timeout: seconds to wait for the connection.
    """

    def __init__(
        self,
        path: str,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        timeout: float = 5.0,
    ) -> None:
        self.path = path
        self._on_event = on_event
        self._sock = _connect(path, timeout)
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._pending_lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="flashckpt-agent-rx")
        self._reader.daemon = True
        self._reader.start()

    @property
    def connected(self) -> bool:
        return not self._closed.is_set()

    def request(self, op: str, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        """Sends a request and waits for its answer.

        Raises:
            AgentError: the agent answered ``ok: false``, went away, or did not answer in time.
        """
        rid = next(self._ids)
        ev = threading.Event()
        box: list[dict[str, Any]] = []
        with self._pending_lock:
            self._pending[rid] = (ev, box)
        try:
            self._send({"id": rid, "op": op, **fields})
            if not ev.wait(timeout):
                raise AgentError(f"node agent did not answer {op!r} within {timeout:.0f} s")
        finally:
            with self._pending_lock:
                self._pending.pop(rid, None)
        if not box:
            raise AgentError(f"node agent at {self.path} went away during {op!r}")
        reply = box[0]
        if not reply.get("ok"):
            raise AgentError(reply.get("error", f"node agent refused {op!r}"), reply.get("kind"))
        return reply

    def call(self, req: Request, timeout: float = 30.0) -> Reply:
        """Sends a typed request and returns the agent's typed (validated) answer.

        Raises:
            AgentError: the agent refused, went away, did not answer in time, or answered with
                something that is not a reply to this request.
        """
        if req.one_way:
            raise ValueError(f"{req.op!r} is one-way: send it with notify_msg()")
        raw = self.request(req.op, timeout=timeout, **req.fields_json())
        try:
            return parse_reply(req.op, raw)
        except ProtocolError as e:
            raise AgentError(f"node agent at {self.path}: {e}", "ProtocolError") from None

    def notify_msg(self, req: Request) -> None:
        """Sends a typed one-way message; never raises (see :meth:`notify`)."""
        self.notify(req.op, **req.fields_json())

    def notify(self, op: str, **fields: Any) -> None:
        """Sends a one-way message; never raises (the agent may be gone: the trainer goes on)."""
        try:
            self._send({"op": op, **fields})
        except (AgentError, OSError) as e:
            log.debug("notify %r not delivered: %s", op, e)

    def _send(self, obj: dict[str, Any]) -> None:
        if self._closed.is_set():
            raise AgentError(f"connection to node agent at {self.path} is closed")
        try:
            send_msg(self._sock, obj, self._send_lock)
        except OSError as e:
            # The connection is dead (the agent went away): say so at once, before the reader
            # thread sees the end of the stream, so a caller that retries on a lost agent (a
            # hello racing an agent that is exiting) knows to connect again.
            self._closed.set()
            raise AgentError(f"lost the node agent at {self.path}: {e}") from e

    def _read_loop(self) -> None:
        reader = LineReader(self._sock)
        try:
            while True:
                msg = reader.read()
                if msg is None:
                    break
                rid = msg.get("id")
                if rid is None:
                    try:
                        parse_event(msg)  # an event the protocol has, its fields as it says
                    except ProtocolError as e:
                        log.warning("ignoring a malformed event from %s: %s", self.path, e)
                        continue
                    if self._on_event is not None:
                        try:
                            self._on_event(msg)
                        except Exception:
                            log.exception("event handler failed on %s", msg)
                    continue
                with self._pending_lock:
                    entry = self._pending.get(rid)
                if entry is not None:
                    entry[1].append(msg)
                    entry[0].set()
        except (OSError, ValueError) as e:
            log.debug("agent connection closed: %s", e)
        finally:
            self._closed.set()
            with self._pending_lock:
                for ev, _ in self._pending.values():
                    ev.set()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._reader.join(timeout=5)


def check_socket(path: str) -> None:
    """Refuses a socket (or its directory) another user could have put there: the trainer's
    ``hello`` and snapshots would go to whoever listens.

    Raises:
        UnsafeLocalStateError: the directory is not private to this user, or the socket is not
            a socket of this user.
    """
    check_private_dir(os.path.dirname(path) or ".", "agent run dir")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise UnsafeLocalStateError(
            f"{path} is not a socket of this user (uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}): remove it; the node agent creates its own"
        )


def _connect(path: str, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        if os.path.lexists(os.path.dirname(path) or "."):
            check_socket(path)  # raises: a foreign socket is never connected to, nor retried
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except OSError as e:
            s.close()
            if time.monotonic() >= deadline:
                raise AgentError(f"no node agent listening at {path}: {e}") from e
            time.sleep(0.05)
