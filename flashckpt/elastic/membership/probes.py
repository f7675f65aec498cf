"""The probe port: one launcher asking another whether it is alive (:func:`probe`) and how
long ago it reached etcd (:func:`peer_etcd_age`), and the server that answers
(:class:`_ProbeServer`). Split out of
:mod:`flashckpt.elastic.membership.nodes` (issue 45), which re-exports the public names.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from flashckpt.elastic.membership.peerlinks import (
    HOLD_ANSWER,
    HOLD_QUESTION,
    connect_probe_port,
    read_line,
)
from flashckpt.elastic.membership.records import (
    NodeRecord,
)

logger = logging.getLogger("flashckpt.elastic.membership.nodes")  # its log, as before the split

_PROBE_TIMEOUT_S = 0.5
_PROBE_ATTEMPTS = 3
_PROBE_RETRY_S = 0.1


class ProbeResult(enum.Enum):
    """What a probe of a peer's launcher says."""

    ALIVE = "alive"
    """It answered with its token."""
    DEAD = "dead"
    """Its host refused the connection, or another process answered: the launcher is gone."""
    UNKNOWN = "unknown"
    """No answer in time: only the lease can tell."""


def probe(record: NodeRecord, timeout: float = _PROBE_TIMEOUT_S) -> ProbeResult:
    """Checks whether a peer's launcher is still running.

    Args:
        record: The peer's node record.
        timeout: Seconds to wait for the connection and the answer.

    Returns:
        :attr:`ProbeResult.DEAD` only when the peer is certainly gone.
    """
    if not record.probe:
        return ProbeResult.UNKNOWN
    try:
        with connect_probe_port(record.probe, timeout) as sock:
            answer = b""
            while not answer.endswith(b"\n") and len(answer) < 256:
                chunk = sock.recv(256)
                if not chunk:
                    break
                answer += chunk
    except ConnectionRefusedError:
        return ProbeResult.DEAD
    except (OSError, ValueError):
        return ProbeResult.UNKNOWN
    if not answer:
        return ProbeResult.UNKNOWN
    return (
        ProbeResult.ALIVE
        if answer.strip().decode(errors="replace") == record.token
        else (ProbeResult.DEAD)
    )


def _probe_patiently(record: NodeRecord) -> ProbeResult:
    """Probes up to three times while the answer is inconclusive.

    A launcher killed an instant ago may still be exiting: its listening socket accepts the
    connection but nobody answers. A moment later the port refuses.
    """
    result = ProbeResult.UNKNOWN
    for attempt in range(_PROBE_ATTEMPTS):
        if attempt:
            time.sleep(_PROBE_RETRY_S)
        result = probe(record)
        logger.debug("probe of node %s at %s: %s", record.node_id, record.probe, result.value)
        if result is not ProbeResult.UNKNOWN:
            break
    return result


_ETCD_QUESTION = b"etcd?\n"
"""What a prober sends after the token line to ask when the peer last renewed its lease."""
_ETCD_ANSWER_MAX = 64
"""Bytes of the answer to the etcd question a prober reads at most (it is one short line)."""
_MAX_HELD = 256
"""Links a probe port holds at most (a job's ring needs a few; more is somebody's mistake)."""
_QUESTION_WAIT_S = 1.0
"""How long a probe port waits for what a connection asks after the token (a plain probe
asks nothing and closes)."""


def peer_etcd_age(record: NodeRecord, timeout: float) -> float | None:
    """How many seconds ago a live peer's launcher last renewed its etcd lease (sent), as it
    answers on its probe port; None if it does not answer with its token, has no lease (it is
    fenced), or answers something else.

    Used when this machine's renewals fail while the peer answers: a peer that still reaches
    etcd says this machine alone is cut off from etcd (its lease will lapse and the others will
    form a new world without it), not an etcd outage that every machine sees.
    """
    if not record.probe:
        return None
    try:
        with connect_probe_port(record.probe, timeout) as sock:
            token = read_line(sock, 256).strip().decode(errors="replace")
            if token != record.token:
                return None
            sock.sendall(_ETCD_QUESTION)
            answer = read_line(sock, _ETCD_ANSWER_MAX).decode(errors="replace").split()
    except (OSError, ValueError):
        return None
    if len(answer) != 2 or answer[0] != "etcd":
        return None
    try:
        age = float(answer[1])
    except ValueError:
        return None  # "none": no lease
    return age if 0.0 <= age < 1e9 else None


class _ProbeServer:
    """Answers every connection with the launcher's token, from a daemon thread; a prober that
    then asks (:data:`_ETCD_QUESTION`) gets how long ago this launcher last renewed its lease
    (``etcd_age``; ``none`` while it holds no lease); a linker that asks
    (:data:`~flashckpt.elastic.membership.peerlinks.HOLD_QUESTION`) gets ``held`` and the connection
    stays open, silent, until this launcher exits (:mod:`flashckpt.elastic.membership.peerlinks`):
    its closing is what tells the
    linker that this launcher is gone. At most :data:`_MAX_HELD` links are held.

    No connection holds up another: the token is sent as the connection is accepted, and the
    question is read when it comes (within :data:`_QUESTION_WAIT_S`; a plain probe closes at
    once). A server that waited for each connection's question in turn would keep every
    probe behind a slow linker waiting, on a loaded host long enough for the probe to time
    out and learn nothing."""

    def __init__(
        self, token: str, bind_host: str, etcd_age: Callable[[], float | None] | None = None
    ) -> None:
        self.token = token
        self._etcd_age = etcd_age
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._sock = socket.create_server((bind_host, 0), family=family, backlog=128)
        self._sock.setblocking(False)
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._held: set[socket.socket] = set()
        # Connections that got the token and may ask a question: when they are given up.
        self._asking: dict[socket.socket, float] = {}
        self._thread = threading.Thread(target=self._serve, name="flashckpt-probe", daemon=True)
        self._thread.start()

    @property
    def held(self) -> int:
        """How many links are held now."""
        return len(self._held)

    def _serve(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for conn in [c for c, until in self._asking.items() if until <= now]:
                self._drop(conn)  # no question in time: a probe that went, or a stuck peer
            # Asleep until a connection comes or one asking runs out of time (close wakes it):
            # no timer per machine (1,024 wakes a second on a host of 1,024 simulated ones).
            wait = min((until - now for until in self._asking.values()), default=None)
            try:
                events = self._selector.select(None if wait is None else max(0.0, wait))
            except OSError:
                return
            for key, _ in events:
                sock = key.fileobj
                if sock is self._wake_r:
                    continue
                assert isinstance(sock, socket.socket)
                if sock is self._sock:
                    self._accept()
                elif sock in self._asking:
                    self._question(sock)
                else:
                    self._held_readable(sock)

    def _accept(self) -> None:
        for _ in range(64):  # what is waiting now; the rest at the next turn
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._stop.set()
                return
            try:
                conn.setblocking(False)
                line = self.token.encode() + b"\n"
                if conn.send(line) != len(line):  # a fresh connection's buffer takes it
                    raise OSError("the token did not fit in the socket's buffer")
                self._selector.register(conn, selectors.EVENT_READ)
            except (OSError, ValueError):
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            self._asking[conn] = time.monotonic() + _QUESTION_WAIT_S

    def _question(self, conn: socket.socket) -> None:
        """What a connection that got the token says next: nothing (a plain probe closed), the
        etcd question, or a request to hold the link."""
        del self._asking[conn]
        try:
            question = conn.recv(len(_ETCD_QUESTION))
        except BlockingIOError:
            self._asking[conn] = time.monotonic() + _QUESTION_WAIT_S
            return
        except OSError:
            question = b""
        try:
            if question == _ETCD_QUESTION:
                age = self._etcd_age() if self._etcd_age is not None else None
                conn.send(b"etcd none\n" if age is None else f"etcd {age:.3f}\n".encode())
            elif question == HOLD_QUESTION and len(self._held) < _MAX_HELD:
                conn.send(HOLD_ANSWER)
                self._held.add(conn)
                return
        except OSError:
            pass
        self._drop(conn)

    def _held_readable(self, conn: socket.socket) -> None:
        """A held link's holder closed it (or sent something it should not): let it go."""
        try:
            if conn.recv(64):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._held.discard(conn)
        self._asking.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        with contextlib.suppress(OSError):
            conn.close()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=2)
        # The held links close here, after the lease was revoked (NodeRegistry.close): a
        # linker that sees them close finds the key gone and declares nothing.
        for sock in (self._sock, *self._held, *self._asking, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        self._held.clear()
        self._asking.clear()
        with contextlib.suppress(OSError):
            self._selector.close()
