"""Held links to peers' probe ports: a peer launcher's death seen the instant its sockets close.

Without them, a launcher learns that a peer machine died in one of two ways: its own workers
fail in a collective (gloo sees the peer's sockets close) and it probes its peers, or the
peer's etcd lease lapses (``--lease-ttl``, seconds). The first needs the workers to fail: a
worker blocked in a gloo ``all_gather`` whose peer vanished does not always get an error (seen
in 2 of 8 sharded failovers: FSDP2's unshard waited until the lease lapsed, ~5 s), and a worker
that is not in a collective at all (a data loader stall, a long forward) fails later still.

A *link* is one TCP connection to a peer launcher's probe port, held open for the peer's life:
the peer's probe server answers ``hold?`` with ``held`` and keeps the connection without
sending anything more. When the peer's launcher dies (``kill -9``, OOM, a crash, a machine
killed in its namespace), its kernel closes the connection and this side reads EOF or a reset
within milliseconds, whatever the workers are doing. A broken link is a hint, never a verdict:
:class:`flashckpt.elastic.membership.nodes.NodeRegistry` then probes the peer, and only a probe that
is refused or answered with another token declares it dead (the same rule as when workers fail).
A machine that vanishes without closing anything (power loss, a cut cable) leaves the link
silent: its lease remains the authority.

Each launcher holds links to a few peers only (its successors in the ring of node ids,
:func:`ring_successors`), so a job of N machines holds about ``fanout * N`` connections in all,
and every machine is watched by ``fanout`` others. Each link is made (connected, token read,
hold answered) by a short-lived thread of its own: a target that does not answer (a partitioned
machine, a stopped process) holds up its own link only, never the watch on the links held.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

__all__ = [
    "HOLD_ANSWER",
    "HOLD_QUESTION",
    "LinkTarget",
    "PeerLinks",
    "connect_probe_port",
    "read_line",
    "ring_successors",
]

logger = logging.getLogger(__name__)

HOLD_QUESTION = b"hold?\n"
"""What a linker sends after reading the token line: keep this connection open."""
HOLD_ANSWER = b"held\n"
"""The probe server's answer: it holds the connection and sends nothing more on it."""

_CONNECT_TIMEOUT_S = 1.0
_RETRY_MIN_S = 0.5
_RETRY_MAX_S = 5.0
_TOKEN_MAX = 256


def read_line(sock: socket.socket, limit: int) -> bytes:
    """One line from ``sock`` (byte by byte: nothing after it is consumed), at most ``limit``
    bytes; what came if the peer closed first."""
    line = b""
    while not line.endswith(b"\n") and len(line) < limit:
        chunk = sock.recv(1)
        if not chunk:
            break
        line += chunk
    return line


def connect_probe_port(address: str, timeout: float) -> socket.socket:
    """A connection to a launcher's probe port at ``host:port`` (``[v6]:port``), with
    ``timeout`` on the connection and on every later read and write.

    Raises:
        OSError: It could not connect (``ConnectionRefusedError``: nothing listens there).
        ValueError: ``address`` has no port number.
    """
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    sock.settimeout(timeout)
    return sock


@dataclass(frozen=True, slots=True)
class LinkTarget:
    """A peer launcher to hold a link to."""

    node_id: str
    """Its node id."""
    token: str
    """Its instance token (what its probe port answers first)."""
    address: str
    """``host:port`` of its probe port (``[v6]:port`` for IPv6)."""


def ring_successors(own: str, others: Collection[str], fanout: int) -> list[str]:
    """The ``fanout`` node ids after ``own`` in the sorted ring of ``own`` and ``others``.

    Every machine computes its own successors from the same set of ids, so each machine is a
    successor of (watched by) ``fanout`` others while the set is the same everywhere.
    """
    ring = sorted(set(others) | {own})
    at = ring.index(own)
    count = min(fanout, len(ring) - 1)
    return [ring[(at + i) % len(ring)] for i in range(1, count + 1)]


class PeerLinks:
    """Holds a link to each target's probe port, watched by one daemon thread (each link is made
    by a thread of its own, see the module).

    Args:
        on_broken: Called from the link thread with a target whose link broke (EOF or a reset
            after it was held), whose port refused a connection, or whose port answered with
            another token. It should be quick (start the probe elsewhere); exceptions are
            logged. A target that stays a target is linked again after a pause.
        connect_timeout: Seconds to connect and read the answers.
    """

    def __init__(
        self,
        on_broken: Callable[[LinkTarget, str], None],
        *,
        connect_timeout: float = _CONNECT_TIMEOUT_S,
    ) -> None:
        self._on_broken = on_broken
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._targets: dict[str, LinkTarget] = {}  # by token
        self._conns: dict[str, socket.socket] = {}  # by token; the thread changes it, locked
        self._retry_at: dict[str, tuple[float, float]] = {}  # token -> (when, pause)
        # Links being made (the watch thread's), and what their threads made of them (locked).
        self._connecting: set[str] = set()
        self._made: list[tuple[LinkTarget, socket.socket | None, str | None]] = []
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="flashckpt-node-links", daemon=True)
        self._thread.start()

    def set_targets(self, targets: Sequence[LinkTarget]) -> None:
        """Links these peers from now on (and no others)."""
        with self._lock:
            self._targets = {t.token: t for t in targets}
        self._wake()

    def held(self) -> set[str]:
        """Node ids whose link is held now."""
        with self._lock:
            return {self._targets[t].node_id for t in self._conns if t in self._targets}

    def intact(self, token: str) -> bool:
        """Whether the link to the peer launcher with this token is held and has not closed,
        checked now (a look at the socket without waiting for the link thread, which may not
        have read a close that already came): a held link that is intact says the peer's
        launcher is running as surely as a probe that it answers would. A link not held (not
        made yet, closed, failed) says nothing: False."""
        with self._lock:  # the link thread closes a socket only after it left _conns
            sock = self._conns.get(token)
            if sock is None:
                return False
            try:
                data = sock.recv(1, socket.MSG_PEEK)  # non-blocking (_take)
            except BlockingIOError:
                return True  # open, and quiet as a held link is
            except OSError:
                return False  # reset
            return bool(data)  # b"": the peer closed it

    def close(self) -> None:
        """Closes every link and stops the thread. Never raises. A link still being made is
        closed by its thread when it is made."""
        with self._lock:
            self._stop.set()
        self._wake()
        self._thread.join(timeout=2)
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
            conns += [sock for _, sock, _ in self._made if sock is not None]
            self._made = []
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(OSError):
            self._selector.close()
        for sock in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()

    # ------------------------------------------------------------------------ internals

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                timeout = self._sync()
                for key, _ in self._selector.select(timeout):
                    sock = key.fileobj
                    if sock is self._wake_r:
                        with contextlib.suppress(OSError):
                            while self._wake_r.recv(4096):
                                pass
                        continue
                    assert isinstance(sock, socket.socket)
                    self._readable(key.data, sock)
            except Exception:  # one bad link must not end the watch on the others
                logger.exception("the peer link thread failed; retrying")
                self._stop.wait(_RETRY_MIN_S)

    def _sync(self) -> float | None:
        """Drops links to peers that are no longer targets, links new ones whose pause is over;
        returns how long to wait for the next event (None: until woken, no timer: a host of
        1,024 simulated machines woke 1,024 link threads a second for nothing)."""
        with self._lock:
            targets = dict(self._targets)
            made, self._made = self._made, []
        for target, sock, broken in made:
            self._connecting.discard(target.token)
            self._take(target, sock, broken, current=target.token in targets)
        for token in [t for t in self._conns if t not in targets]:
            self._drop(token)
        for token in [t for t in self._retry_at if t not in targets]:
            del self._retry_at[token]
        now = time.monotonic()
        wait: float | None = None
        for token, target in targets.items():
            if token in self._conns or token in self._connecting:
                continue
            when, _ = self._retry_at.get(token, (0.0, 0.0))
            if when > now:
                wait = when - now if wait is None else min(wait, when - now)
                continue
            self._connecting.add(token)
            threading.Thread(
                target=self._connect,
                args=(target,),
                name="flashckpt-node-link-connect",
                daemon=True,
            ).start()
        return None if wait is None else max(0.0, wait)

    def _pause(self, token: str) -> None:
        _, pause = self._retry_at.get(token, (0.0, 0.0))
        pause = min(_RETRY_MAX_S, max(_RETRY_MIN_S, pause * 2))
        self._retry_at[token] = (time.monotonic() + pause, pause)

    def _connect(self, target: LinkTarget) -> None:
        """A link-making thread: connects, reads the token, asks to hold; hands the outcome
        to the watch thread (:meth:`_take`)."""
        sock: socket.socket | None = None
        broken: str | None = None  # why the peer may be dead; None: no verdict
        held = False
        try:
            sock = connect_probe_port(target.address, self._connect_timeout)
            token = read_line(sock, _TOKEN_MAX).strip().decode(errors="replace")
            if token != target.token:
                broken = "its probe port answered with another token"
            else:
                sock.sendall(HOLD_QUESTION)
                # Anything but "held": a probe server that does not hold links, or is closing.
                held = read_line(sock, len(HOLD_ANSWER)) == HOLD_ANSWER
        except ConnectionRefusedError:
            broken = "its probe port refused the link"
        except (OSError, ValueError) as exc:
            logger.debug("cannot link node %s at %s: %s", target.node_id, target.address, exc)
        if not held and sock is not None:
            sock.close()
            sock = None
        with self._lock:
            if not self._stop.is_set():
                self._made.append((target, sock, broken))
                sock = None
        if sock is not None:  # closed meanwhile
            sock.close()
        self._wake()

    def _take(
        self, target: LinkTarget, sock: socket.socket | None, broken: str | None, *, current: bool
    ) -> None:
        """The watch thread: a link made (``sock``), refused or answered wrongly (``broken``,
        the peer may be dead), or not made (neither: the pause grows)."""
        if sock is None:
            self._pause(target.token)
            if broken is not None and current:
                self._broken(target, broken)
            return
        if not current:  # no longer a target
            sock.close()
            return
        sock.setblocking(False)
        with self._lock:
            self._conns[target.token] = sock
        self._retry_at.pop(target.token, None)
        self._selector.register(sock, selectors.EVENT_READ, data=target)
        logger.debug("holding a link to node %s at %s", target.node_id, target.address)

    def _readable(self, target: LinkTarget, sock: socket.socket) -> None:
        try:
            data = sock.recv(64)
        except BlockingIOError:
            return
        except OSError as exc:
            why = f"its link failed ({exc.strerror or exc})"
        else:
            if data:
                return  # nothing is expected; what comes is dropped
            why = "its link closed"
        self._drop(target.token)
        self._pause(target.token)
        self._broken(target, why)

    def _drop(self, token: str) -> None:
        with self._lock:
            sock = self._conns.pop(token, None)
        if sock is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _broken(self, target: LinkTarget, why: str) -> None:
        try:
            self._on_broken(target, why)
        except Exception:
            logger.exception("handling the broken link to node %s failed", target.node_id)
