"""A TCP relay in front of a server (etcd) for tests of what a client does when the network
misbehaves between them: it counts the connections opened through it, closes them on demand
(with a FIN, or an RST alone), loses answers, holds the answers of chosen requests, or passes
nothing at all.

    relay = TcpRelay(etcd_url, track=b"/v3/lease/keepalive")
    client = EtcdClient(relay.url, ...)
    relay.delay = 1.2          # every tracked request's answer is held 1.2 s
    relay.drop_all(reset=True) # every open connection is reset
    relay.close()

A relay is one in-process accept thread plus two pump threads per connection; ``close`` ends
them all and closes every socket.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

__all__ = ["TcpRelay"]


class _Link:
    """One client connection through the relay and its connection to the server."""

    def __init__(self, down: socket.socket, up: socket.socket) -> None:
        self.down = down  # to the client
        self.up = up  # to the server
        self.pumps: list[threading.Thread] = []
        self.dropped = False  # drop_all owns the sockets: the pumps leave them alone
        self.pending = 0  # tracked requests sent upstream and not answered yet


class TcpRelay:
    """Relays TCP connections from ``url`` to ``upstream`` (``http://host:port``).

    Knobs, settable at any time:

    - ``lose_answers``: a server's answer is not relayed; the client's connection is closed
      instead, after the server took the request.
    - ``blackhole``: nothing is relayed either way; connections stay open.
    - ``delay``: seconds each answer to a tracked request (one whose bytes contain ``track``)
      is held before it is relayed.

    Counts: ``accepted`` connections; ``tracked`` requests, ``answered`` ones and the
    ``most_in_flight`` at once, over all connections.
    """

    def __init__(self, upstream: str, *, track: bytes | None = None) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 2379)
        self._track = track
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._threads: list[threading.Thread] = []
        self.lose_answers = False
        self.blackhole = False
        self.delay = 0.0
        self.accepted = 0
        self.tracked = 0
        self.answered = 0
        self.most_in_flight = 0
        self._start(self._accept_loop)

    def _start(self, target: Callable[..., None], *args: object) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    def _accept_loop(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                up = socket.create_connection(self._upstream)
            except OSError:
                down.close()  # the server is down: the client sees its connection closed
                continue
            link = _Link(down, up)
            with self._lock:  # drop_all finds the link with its pumps started
                self.accepted += 1
                self._links.append(link)
                link.pumps = [
                    self._start(self._pump, link, down, up, False),
                    self._start(self._pump, link, up, down, True),
                ]

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while data := src.recv(65536):
                if self.blackhole:
                    continue
                if answers and self.lose_answers:
                    dst.shutdown(socket.SHUT_RDWR)
                    break
                if answers and link.pending and self.delay:
                    time.sleep(self.delay)  # a tracked request's answer (its first bytes)
                elif not answers and self._track is not None and self._track in data:
                    with self._lock:
                        self.tracked += 1
                        link.pending += 1
                        in_flight = sum(other.pending for other in self._links)
                        self.most_in_flight = max(self.most_in_flight, in_flight)
                if answers:
                    # Counted before it is passed on: the client may send its next request
                    # as soon as it has the answer, before this thread runs again.
                    with self._lock:
                        if link.pending:
                            link.pending -= 1
                            self.answered += 1
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            link.pending = 0  # the client gave up on this connection's request
        if link.dropped:
            return
        for sock in (src, dst):  # one side ended: so does the other
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def drop_all(self, *, reset: bool = False) -> None:
        """Closes every client connection open now: with a FIN, or with ``reset`` an RST alone
        (nothing before it), as a server or a proxy closing a kept-alive connection would.
        Returns once the relay's sockets are closed; the client's kernel may take a moment
        more to see it (wait on the client for that)."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.dropped = True
            if reset:
                link.down.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            # Shutting down reading wakes the pumps without sending anything; the sockets are
            # closed only once the pumps are gone, so that no pump acts on a descriptor number
            # that a new socket may reuse.
            for sock, how in (
                (link.down, socket.SHUT_RD if reset else socket.SHUT_RDWR),
                (link.up, socket.SHUT_RDWR),
            ):
                try:
                    sock.shutdown(how)
                except OSError:
                    pass
            for pump in link.pumps:
                pump.join(timeout=10 + self.delay)
            link.down.close()  # with SO_LINGER 0: an RST
            link.up.close()

    def close(self) -> None:
        """Drops every connection and stops the relay and its threads."""
        self.blackhole, self.delay = False, 0.0
        self.drop_all()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self._listener.close()
        self.drop_all()  # one accepted meanwhile
        for thread in self._threads:
            thread.join(timeout=10)
